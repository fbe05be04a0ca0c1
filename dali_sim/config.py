"""Typed configuration dataclasses that take ``--set``-style string overrides (``PolicyConfig``): the base
of every policy's config and of the memory plan's (``dali_sim.runtime.memory.MemoryConfig``). Its own module
so that the memory plan does not import the policies package."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class PolicyConfig:
    """Base of the typed per-policy configs; fields carry ``metadata={"help": ...}``."""

    def with_overrides(self, values: Mapping[str, str], where: str) -> "PolicyConfig":
        fields = {f.name: f for f in dataclasses.fields(self)}
        changes: dict[str, Any] = {}
        for key, raw in values.items():
            if key not in fields:
                known = ", ".join(sorted(fields)) or "(none)"
                raise ValueError(f"unknown parameter {where}.{key}; {where} parameters: {known}")
            changes[key] = _parse_value(raw, fields[key].type, f"{where}.{key}")
        return dataclasses.replace(self, **changes)

    def describe(self) -> dict[str, str]:
        return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(self)}


def _parse_value(raw: Any, typ: Any, where: str) -> Any:
    if not isinstance(raw, str):
        return raw
    t = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    try:
        if t.startswith("int"):
            return int(raw)
        if t.startswith("float"):
            return float(raw)
        if t.startswith("bool"):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
    except ValueError:
        raise ValueError(f"{where}: cannot read {raw!r} as {t}") from None
    return raw


__all__ = ["PolicyConfig"]
