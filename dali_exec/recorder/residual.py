"""DALI's residual vectors: per MoE layer l, the mean over calibration tokens of x_{l+1} - x_l, where
x_l is the gate input of MoE layer l (the tensor its router receives) and l+1 the next MoE layer.

Residual-based prefetching predicts layer l+1's routing as router_{l+1}(x_l + r_l). The vectors are
stored in a safetensors file, one float32 tensor ``layer.<block index>`` per MoE layer but the last,
with provenance as string metadata under ``dali.residual`` (JSON).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from dali_exec.models import MoEAdapter
from dali_exec.recorder.generation import left_pad
from dali_exec.recorder.hooks import GateInputHooks
from dali_sim.files import atomic_output, check_input

META_KEY = "dali.residual"
FORMAT = "dali-residual-v1"
WHAT = ("DALI residual vectors: r_l = mean over calibration tokens of (gate input of the next MoE layer - "
        "gate input of MoE layer l), keyed by MoE block index l; the last MoE layer has none")


def config_sha256(config) -> str:
    """SHA-256 of a transformers config as canonical JSON, without path- and version-dependent keys."""
    d = config.to_dict()
    for key in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        d.pop(key, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class ResidualVectors:
    """Residual vector per MoE block index (all MoE layers but the last) plus provenance."""

    vectors: dict[int, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # the file it was loaded from

    @property
    def hidden_size(self) -> int:
        return int(next(iter(self.vectors.values())).numel())

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        tensors = {f"layer.{layer}": v.detach().float().cpu().contiguous() for layer, v in sorted(self.vectors.items())}
        with atomic_output(path) as tmp:
            save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(self.meta, sort_keys=True)})
        return path

    @classmethod
    def load(cls, path: str | Path) -> "ResidualVectors":
        from safetensors import safe_open

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such residual file (make one with `dali trace calibrate-residual`)")
        check_input(path, "residual file")
        try:
            with safe_open(str(path), framework="pt") as f:
                raw = (f.metadata() or {}).get(META_KEY)
                vectors = {}
                for key in f.keys():
                    if not key.startswith("layer.") or not key[6:].isdigit():
                        raise ValueError(f"unexpected tensor {key!r}")
                    vectors[int(key[6:])] = f.get_tensor(key)
        except Exception as exc:  # safetensors raises its own error types
            raise ValueError(f"{path}: not a dali residual file: {exc}") from None
        if raw is None:
            raise ValueError(f"{path}: not a dali residual file (no '{META_KEY}' metadata)")
        if not vectors:
            raise ValueError(f"{path}: holds no residual vectors")
        for layer, v in sorted(vectors.items()):
            if v.ndim != 1 or not v.is_floating_point():
                raise ValueError(f"{path}: tensor layer.{layer} has shape {tuple(v.shape)} and dtype "
                                 f"{str(v.dtype).replace('torch.', '')}; a residual vector is 1-D floating point")
            if not torch.isfinite(v).all():
                bad = int((~torch.isfinite(v)).sum())
                raise ValueError(f"{path}: tensor layer.{layer} has {bad} non-finite values (NaN or inf); "
                                 "recompute the vectors with `dali trace calibrate-residual`")
        try:
            meta = json.loads(raw)
        except ValueError:
            raise ValueError(f"{path}: its '{META_KEY}' metadata is not valid JSON") from None
        return cls(vectors, meta if isinstance(meta, dict) else {}, str(path))

    def check_matches(self, model, moe_layers: Sequence[int], where: str) -> None:
        """Raise a clear error unless these vectors fit the model (hidden size, MoE layers, family)."""
        expected = list(moe_layers)[:-1]
        dims = {int(v.numel()) for v in self.vectors.values()}
        hidden = int(model.config.hidden_size)
        if dims != {hidden}:
            raise ValueError(f"{where}: residual vectors have size {sorted(dims)}, the model's hidden size is {hidden}")
        if sorted(self.vectors) != expected:
            raise ValueError(f"{where}: residual vectors are for MoE blocks {sorted(self.vectors)}, the model needs "
                             f"{expected} (every MoE block but the last)")
        family = self.meta.get("model_type")
        if family is not None and family != model.config.model_type:
            raise ValueError(f"{where}: residual vectors were calibrated on a {family!r} model, "
                             f"this model is {model.config.model_type!r}")


class _DiffAccumulator(GateInputHooks):
    """Sums x_{l+1} - x_l over recorded tokens, in float64, per consecutive MoE layer pair."""

    def __init__(self, model, adapter: MoEAdapter):
        super().__init__(model, adapter)
        self.sums = [None] * (len(self.blocks) - 1)
        self.tokens = 0
        self._prev: torch.Tensor | None = None

    def on_router(self, ordinal: int, x: torch.Tensor, output: Any) -> None:
        x = x.double()
        if ordinal > 0:
            diff = (x - self._prev).sum(dim=0)
            self.sums[ordinal - 1] = diff if self.sums[ordinal - 1] is None else self.sums[ordinal - 1] + diff
        self._prev = x
        if ordinal == 0:
            self.tokens += x.shape[0]


@torch.inference_mode()
def calibrate_residuals(model, adapter: MoEAdapter, texts: Sequence[Sequence[int]], *, batch_size: int = 8,
                        pad_id: int = 0, progress: bool = False, meta: dict[str, Any] | None = None) -> ResidualVectors:
    """Residual vectors from forward passes over tokenised calibration ``texts`` (no generation)."""
    from tqdm.auto import tqdm

    texts = [list(t) for t in texts if len(t)]
    if not texts:
        raise ValueError("no calibration tokens: every text is empty")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    acc = _DiffAccumulator(model, adapter)
    if len(acc.blocks) < 2:
        raise ValueError("the model has a single MoE layer: there is no next layer to predict")
    with acc, tqdm(total=len(texts), unit="text", desc="calibrate", disable=not progress) as bar:
        for start in range(0, len(texts), batch_size):
            batch = texts[start:start + batch_size]
            ids, mask = left_pad(batch, pad_id, model.device)
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
            acc.start_forward(mask.reshape(-1).nonzero().squeeze(1))
            model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=1)
            acc.check_complete()
            bar.update(len(batch))
    vectors = {b.layer: (s / acc.tokens).float().cpu() for b, s in zip(acc.blocks[:-1], acc.sums)}
    info = {"format": FORMAT, "what": WHAT, "model_type": model.config.model_type,
            "hidden_size": int(model.config.hidden_size), "moe_layers": [b.layer for b in acc.blocks],
            "config_sha256": config_sha256(model.config), "num_texts": len(texts), "num_tokens": acc.tokens,
            "dtype": str(model.dtype).replace("torch.", "")}
    return ResidualVectors(vectors, info | dict(meta or {}))
