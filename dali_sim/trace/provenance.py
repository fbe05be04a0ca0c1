"""Provenance recorded in every trace: where the rows came from and with which software.

No timestamps: the same inputs give byte-identical files.
"""

from __future__ import annotations

import platform
from importlib import metadata
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
