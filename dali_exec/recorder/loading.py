"""Load a transformers MoE causal LM (and its tokenizer, if any) from a local folder or the local cache.

Nothing is downloaded (``local_files_only``); the family is checked against the adapters before any
weights are read, so an unsupported model fails at once with the list of supported families.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dali_exec.models import get_adapter
from dali_sim.dtypes import canonical_dtype

DTYPES = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available on this machine")
        return torch.device(device)
    raise ValueError(f"--device must be cpu, cuda or cuda:N, got {device!r}")


def load_config(path_or_name: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path_or_name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model {path_or_name}: cannot read a transformers config locally "
                         f"(a folder with config.json, or a name in the local cache): {exc}") from None


def load_model(path_or_name: str, *, device: str = "cpu", dtype: str = "float32", progress: bool = True):
    """(model in eval mode on ``device``, tokenizer or None). ``dtype``: auto (the checkpoint's), fp32, bf16, fp16
    (or torch's names: float32, ...)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()

    dtype = canonical_dtype(dtype, allow_auto=True)
    target = resolve_device(device)
    config = load_config(path_or_name)
    get_adapter(config)  # unsupported family: fail before loading weights
    model = _load_weights(AutoModelForCausalLM, path_or_name, DTYPES[dtype])
    model = model.to(target).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path_or_name, local_files_only=True)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    return model, tokenizer


def _load_weights(auto, path_or_name: str, dtype):
    """``auto.from_pretrained`` with its failures (no weights, an unreadable pickle, a truncated file) as one
    line naming the model."""
    import pickle

    try:
        return auto.from_pretrained(path_or_name, dtype=dtype, local_files_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"--model {path_or_name}: cannot load its pickle weights (.bin; torch loads only plain "
                         f"tensors from pickles): {first}; convert them to safetensors") from None
    except (OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"--model {path_or_name}: cannot load the weights: {first.removeprefix('Error ')}") from None


def config_file(path_or_name: str) -> Path | None:
    """The checkpoint's config.json when ``path_or_name`` is a local folder (the trace's model spec is read from it)."""
    path = Path(path_or_name) / "config.json"
    return path if path.is_file() else None
