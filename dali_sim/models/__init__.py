"""Model shapes: presets, precisions and specs read from Hugging Face configs."""

from pathlib import Path

from dali_sim.models.hf_config import spec_from_hf_config
from dali_sim.models.presets import get_model, get_precision, model_names, precision_names
from dali_sim.models.spec import AttentionSpec, ModelSpec, Precision


def resolve_model(name_or_config: str | Path, precision: str | None = None) -> ModelSpec:
    """A preset (scaled ones included, e.g. ``mixtral-8x7b-x0.125``) or the spec read from a ``config.json``
    or a model folder holding one: what every ``--model`` of a model shape accepts."""
    text = str(name_or_config)
    if text in model_names() or not Path(text).exists():
        return get_model(text, precision)
    return spec_from_hf_config(text, precision=precision)


__all__ = [
    "AttentionSpec", "ModelSpec", "Precision", "get_model", "get_precision", "model_names",
    "precision_names", "resolve_model", "spec_from_hf_config",
]
