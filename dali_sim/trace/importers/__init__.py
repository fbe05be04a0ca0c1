"""Importers turn public routing traces into dali traces; one registry, one module per format."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from dali_sim.registry import Registry


@dataclass(frozen=True)
class Importer:
    name: str
    description: str
    run: Callable[[Sequence[Path], Path, str], Path]  # (input files, output path, command) -> written path


IMPORTERS: Registry[Importer] = Registry("import format")


def import_trace(fmt: str, files: Sequence[str | Path], out: str | Path, command: str = "(python API)") -> Path:
    """Convert ``files`` of format ``fmt`` into a dali trace at ``out``."""
    importer = IMPORTERS.get(fmt)
    paths = [Path(f) for f in files]
    if not paths:
        raise ValueError(f"import format {fmt!r}: no input files given")
    for p in paths:
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such file or folder")
    return importer.run(paths, Path(out), command)


def expand_inputs(paths: Sequence[Path], pattern: str) -> list[Path]:
    """Files as given; a folder contributes its files matching ``pattern``, sorted by name."""
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(p.glob(pattern))
            if not found:
                raise ValueError(f"{p}: folder has no {pattern} files")
            files.extend(found)
        else:
            files.append(p)
    return files


# register the built-in formats
from dali_sim.trace.importers import gpt_oss_fingerprint, switch_router_v2  # noqa: E402,F401

__all__ = ["IMPORTERS", "Importer", "expand_inputs", "import_trace"]
