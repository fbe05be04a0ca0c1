"""Per-architecture MoE adapters for transformers (v5) models: where the routers and experts are,
what top-k is, and how a router turns logits into top-k ids and weights.

>>> adapter = get_adapter(model)                  # or get_adapter("qwen3_moe")
>>> for block in adapter.blocks(model):           # MoE blocks only, with their block index
...     routing = adapter.route(block, x)         # Routing(logits, ids, weights), rank order
...     y = adapter.run_experts(block, x, routing.ids, routing.weights)

Used by the recorder (forward hooks on routers) and, later, by the executor (replacing MoE blocks).
"""

from __future__ import annotations

from typing import Any

from dali_exec.models.base import MoEAdapter, MoEBlock, Routing, RoutingRule, rank_order
from dali_exec.models.families import FAMILIES

MIN_TRANSFORMERS = (5, 0)

_BY_TYPE: dict[str, MoEAdapter] = {t: cls() for cls in FAMILIES for t in cls.model_types}


def supported_model_types() -> list[str]:
    """Sorted ``config.model_type`` values that have an adapter."""
    return sorted(_BY_TYPE)


def _check_transformers() -> None:
    import transformers

    major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if major_minor < MIN_TRANSFORMERS:
        raise RuntimeError(f"dali_exec.models needs transformers >= 5.0 (router modules that return "
                           f"logits, weights and ids); installed: {transformers.__version__}")


def get_adapter(model_or_type: Any) -> MoEAdapter:
    """The adapter for a model, a config, or a ``model_type`` string; a clear error lists the supported ones."""
    if isinstance(model_or_type, str):
        model_type = model_or_type
    else:
        config = getattr(model_or_type, "config", model_or_type)
        model_type = getattr(config, "model_type", None)
        if model_type is None:
            raise ValueError(f"{type(model_or_type).__name__}: no config.model_type; "
                             "pass a transformers model or config")
    if model_type not in _BY_TYPE:
        raise ValueError(f"model_type {model_type!r} has no MoE adapter; "
                         f"supported: {', '.join(supported_model_types())}")
    _check_transformers()
    return _BY_TYPE[model_type]


__all__ = ["MoEAdapter", "MoEBlock", "Routing", "RoutingRule", "get_adapter", "rank_order", "supported_model_types"]
