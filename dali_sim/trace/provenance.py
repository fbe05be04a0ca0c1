"""Provenance recorded in every trace: where the rows came from and with which software.

No timestamps: the same inputs give byte-identical files.
"""

from __future__ import annotations

import hashlib
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

_PACKAGES = ("dali", "numpy", "pyarrow", "pandas")


def software_versions(extra: tuple[str, ...] = ()) -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _PACKAGES + extra:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def default_provenance(source: str, command: str | None = None, **details: Any) -> dict[str, Any]:
    """``source`` says what produced the rows (``synth``, ``import:gpt-oss-fingerprint``, ``record``)."""
    return {
        "source": source,
        "command": command if command is not None else "(python API)",
        "versions": software_versions(),
        **details,
    }


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes, read in blocks (inputs named in provenance and manifests)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
