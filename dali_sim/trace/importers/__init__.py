"""Importers turn public routing traces into dali traces; one registry, one module per format."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from dali_sim.files import check_input, check_output, files_of
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
    inputs = []
    for p in paths:
        inputs += files_of(check_input(p, "input", folder_ok=True))
    check_output(out, inputs, "trace")
    return importer.run(paths, Path(out), command)


@contextlib.contextmanager
def input_named(path: Path):
    """Rows an importer converted from ``path`` that the trace format still refuses: the error names the
    input file first (the rows' seq_id and pos locate the entry in it)."""
    try:
        yield
    except ValueError as exc:
        raise ValueError(f"{path}: an entry is not a valid routing row: {exc}") from None


def expand_inputs(paths: Sequence[Path], pattern: str) -> list[Path]:
    """Files as given; a folder contributes its files matching ``pattern``, sorted by name."""
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(p.glob(pattern))
            if not found:
                raise ValueError(f"{p}: folder has no {pattern} files")
            files.extend(check_input(f, "input") for f in found)
        else:
            files.append(p)
    return files


# register the built-in formats
from dali_sim.trace.importers import gpt_oss_fingerprint, switch_router_v2  # noqa: E402,F401

__all__ = ["IMPORTERS", "Importer", "expand_inputs", "import_trace", "input_named"]
