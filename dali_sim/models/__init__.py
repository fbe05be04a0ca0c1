"""Model shapes: presets, precisions and specs read from Hugging Face configs."""

from dali_sim.models.hf_config import spec_from_hf_config
from dali_sim.models.presets import get_model, get_precision, model_names, precision_names
from dali_sim.models.spec import AttentionSpec, ModelSpec, Precision

__all__ = [
    "AttentionSpec", "ModelSpec", "Precision", "get_model", "get_precision", "model_names",
    "precision_names", "spec_from_hf_config",
]
