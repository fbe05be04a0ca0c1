"""Shared fixtures: tiny model specs, paths to the shared validation traces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

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
