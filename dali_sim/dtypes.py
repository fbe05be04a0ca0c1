"""Weight dtypes: one vocabulary for every command (``bf16``, ``fp16``, ``fp32``; ``auto`` = a checkpoint's
own, where a real model is loaded); torch's names (``bfloat16``, ``float16``, ``float32``) are aliases."""

from __future__ import annotations

DTYPES = ("bf16", "fp16", "fp32")
AUTO = "auto"
ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def canonical_dtype(name: str, *, allow_auto: bool = False) -> str:
    """``"bfloat16"`` -> ``"bf16"``; a name outside the vocabulary is a ValueError listing it."""
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    allowed = DTYPES + ((AUTO,) if allow_auto else ())
    if key not in allowed:
        aliases = ", ".join(f"{k}={v}" for k, v in ALIASES.items())
        raise ValueError(f"dtype must be one of {', '.join(allowed)} (aliases {aliases}), got {name!r}")
    return key


__all__ = ["ALIASES", "AUTO", "DTYPES", "canonical_dtype"]
