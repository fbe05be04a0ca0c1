"""Loading model presets and precisions from the shipped ``presets.toml``."""

from __future__ import annotations

import functools
import tomllib
from importlib import resources
from typing import Any

from dali_sim.models.spec import AttentionSpec, ModelSpec, Precision
from dali_sim.registry import UnknownNameError


def expand_moe_layers(value: Any, num_layers: int, where: str) -> tuple[int, ...]:
    """``"all"`` | list of indices | ``{first, step}`` -> tuple of block indices."""
    if value == "all":
        return tuple(range(num_layers))
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    if isinstance(value, dict) and set(value) <= {"first", "step"}:
        return tuple(range(int(value.get("first", 0)), num_layers, int(value.get("step", 1))))
    raise ValueError(f"{where}: moe_layers must be 'all', a list or {{first, step}}, got {value!r}")


@functools.lru_cache(maxsize=1)
def _load() -> tuple[dict[str, Precision], dict[str, dict[str, Any]]]:
    text = resources.files("dali_sim.models").joinpath("presets.toml").read_text(encoding="utf-8")
    data = tomllib.loads(text)
    precisions = {name: Precision(name=name, **p) for name, p in data["precisions"].items()}
    return precisions, data["models"]


def precision_names() -> list[str]:
    return sorted(_load()[0])


def get_precision(name: str) -> Precision:
    precisions = _load()[0]
    if name not in precisions:
        raise UnknownNameError(f"unknown precision {name!r}; known: {', '.join(sorted(precisions))}")
    return precisions[name]


def parse_precision(text: str) -> tuple[Precision, Precision | None]:
    """``"q4_0"`` -> (q4_0, None: the whole model); ``"mxfp4/bf16"`` -> (experts mxfp4, the rest bf16)."""
    experts, sep, dense = text.partition("/")
    if sep and not dense:
        raise ValueError(f"precision {text!r}: expected EXPERTS or EXPERTS/DENSE, e.g. mxfp4/bf16")
    return get_precision(experts), (get_precision(dense) if sep else None)


def apply_precision(spec: ModelSpec, text: str | None) -> ModelSpec:
    """``spec`` at the precision ``text`` (see :func:`parse_precision`); ``None`` leaves it as it is."""
    if text is None:
        return spec
    experts, dense = parse_precision(text)
    return spec.with_precision(experts, dense)


def model_names() -> list[str]:
    return sorted(_load()[1])


def get_model(name: str, precision: str | None = None) -> ModelSpec:
    """The preset ``name`` (e.g. ``mixtral-8x7b``), optionally at another precision (e.g. ``q4_0``); a scaled
    preset (``mixtral-8x7b-x0.125``, ``...-4L``: :mod:`dali_sim.models.scaled`) too."""
    models = _load()[1]
    if name not in models:
        from dali_sim.models.scaled import parse_scaled_name, scale_model

        parsed = parse_scaled_name(name)
        if parsed is not None and parsed[0] in models:
            base, scale, layers = parsed
            try:
                return scale_model(get_model(base, precision), scale, layers)
            except ValueError as exc:
                raise UnknownNameError(f"model {name!r}: {exc}") from None
        raise UnknownNameError(f"unknown model preset {name!r}; known: {', '.join(sorted(models))} "
                               "(or a scaled one, e.g. mixtral-8x7b-x0.125 or mixtral-8x7b-x0.125-4L)")
    raw = dict(models[name])
    raw["moe_layers"] = expand_moe_layers(raw["moe_layers"], raw["num_layers"], f"model preset {name!r}")
    raw["attention"] = AttentionSpec(**raw["attention"])
    default = raw.pop("precision", "bf16")
    dense_default = raw.pop("dense_precision", None)
    spec = ModelSpec(name=name, **raw, precision=get_precision(default),
                     dense_precision=get_precision(dense_default) if dense_default else None)
    return apply_precision(spec, precision)
