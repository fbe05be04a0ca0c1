"""Reading JSON inputs with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_json(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON (truncated or corrupt?): {exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text: {exc}") from None


def require(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"{where}: missing field {key!r}")
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise ValueError(f"{where}: field {key!r} must be {names}, got {type(value).__name__}")
    return value
