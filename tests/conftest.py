"""Shared fixtures: tiny model specs, paths to the shared validation traces."""

from __future__ import annotations

from pathlib import Path

import json

import numpy as np
import pytest

from dali_sim.hardware.measured import ModelShape
from dali_sim.models.spec import AttentionSpec, ModelSpec

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "validation-traces"


def tiny_model(num_layers: int = 3, moe_layers=(0, 1, 2), num_experts: int = 4, top_k: int = 2) -> ModelSpec:
    return ModelSpec(
        name="tiny-moe", family="test", num_layers=num_layers, moe_layers=tuple(moe_layers),
        num_experts=num_experts, top_k=top_k, hidden_size=8, expert_intermediate_size=16,
        dense_intermediate_size=16, vocab_size=16,
        attention=AttentionSpec(kind="gqa", num_heads=1, num_kv_heads=1, head_dim=8),
    )


@pytest.fixture
def tiny() -> ModelSpec:
    return tiny_model()


@pytest.fixture
def shared() -> Path:
    if not SHARED.exists():
        pytest.skip(f"{SHARED} is not present (CI puts ../shared beside the clone)")
    return SHARED


def random_rows(model: ModelSpec, seqs: int, tokens: int, seed: int = 0):
    """Complete rows for ``seqs`` sequences of ``tokens`` tokens (half prefill), all MoE layers."""
    rng = np.random.default_rng(seed)
    layers = np.asarray(model.moe_layers)
    n = seqs * tokens * len(layers)
    seq = np.repeat(np.arange(seqs), tokens * len(layers))
    pos = np.tile(np.repeat(np.arange(tokens), len(layers)), seqs)
    layer = np.tile(layers, seqs * tokens)
    phase = np.where(pos < tokens // 2, 0, 1)
    experts = np.argsort(rng.random((n, model.num_experts)), axis=1)[:, : model.top_k]
    weights = rng.dirichlet(np.ones(model.top_k), size=n).astype(np.float32)
    weights = -np.sort(-weights, axis=1)
    return dict(seq_id=seq, phase=phase, pos=pos, layer=layer, experts=experts, weights=weights)


def round_number_profile(path: Path, model, *, gpu=(1.0, 2.0), cpu=(3.0, 6.0), xfer=2.0, dense=0.5) -> Path:
    """A measured profile of round numbers for ``model``'s shape (all exact in binary floating point):
    GPU expert = 1 s per token (table 1 s at 1 token, 2 s at 2, extended linearly), CPU expert = 3 s
    per token, one expert's copy = ``xfer`` s, dense part of a layer = ``dense`` s at any size."""
    shape = ModelShape.of(model)
    data = {
        "kind": "measured", "format_version": 1, "name": "simple-numbers",
        "description": "round numbers for hand-computed tests (not a measurement)",
        "gpu": {"name": "test GPU", "memory_gib": 24}, "cpu": {"name": "test CPU", "memory_gib": 64},
        "link": {"name": "test link"},
        "model": {f: getattr(shape, f) for f in ModelShape.__dataclass_fields__},
        "tables": {
            "gpu_expert": {"tokens": [1, 2], "seconds": list(gpu)},
            "cpu_expert": {"tokens": [1, 2], "seconds": list(cpu)},
            "h2d": {"bytes": [1, model.expert_bytes], "seconds": [xfer, xfer]},
            "gpu_dense": {"tokens": [1, 2], "context_lens": [0], "seconds": [[dense, dense]]},
            "cpu_dense": {"tokens": [1, 2], "context_lens": [0], "seconds": [[dense, dense]]},
        },
        "provenance": {"command": "tests (hand-computed timelines)", "date": "2025-01-01", "versions": {}},
    }
    path.write_text(json.dumps(data))
    return path
