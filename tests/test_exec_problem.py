"""What a replay builds: scaled shapes, reduced traces, the budget scaled from the full model's plan,
and clear errors for impossible requests."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from dali_exec.executor.problem import ReplayOptions, prepare_replay, reduce_trace, scale_model  # noqa: E402
from dali_sim.models.presets import get_model  # noqa: E402
from dali_sim.runtime.memory import GIB  # noqa: E402
from dali_sim.sim import simulate  # noqa: E402
from dali_sim.trace import read_trace  # noqa: E402

from conftest import REPO  # noqa: E402

GPT_OSS = REPO / "traces" / "gpt-oss-20b.parquet"


@pytest.fixture(scope="module")
def gptoss():
    return read_trace(GPT_OSS)


def test_scale_model_scales_sizes_and_cuts_layers():
    ds = get_model("deepseek-v2-lite")
    m = scale_model(ds, 0.25, 3, "fp32")
    assert m.moe_layers == (1, 2, 3) and m.num_layers == 4  # the dense first block is kept
    assert (m.hidden_size, m.expert_intermediate_size, m.dense_intermediate_size) == (512, 352, 2736)
    assert m.attention.kv_lora_rank == 128 and m.attention.num_heads == ds.attention.num_heads
    assert (m.num_experts, m.top_k, m.num_shared_experts) == (64, 6, 2) and m.precision.name == "fp32"
    assert scale_model(ds) == ds
    with pytest.raises(ValueError, match="layers must lie in 1..26"):
        scale_model(ds, 1.0, 27)
    with pytest.raises(ValueError, match="scale must lie in"):
        ReplayOptions(scale=0)


def test_reduce_trace_keeps_the_first_layers_sequences_and_tokens(gptoss):
    m = scale_model(gptoss.model, 0.5, 3)
    t = reduce_trace(gptoss, m, sequences=2, max_tokens=5)
    assert t.model == m and set(np.unique(t.layer)) == {0, 1, 2}
    assert np.unique(t.seq_id).tolist() == np.unique(gptoss.seq_id)[:2].tolist()
    assert len(t) == 2 * 5 * 3
    first_pos = {s: np.sort(gptoss.pos[(gptoss.seq_id == s) & (gptoss.layer == 0)])[:5].tolist() for s in np.unique(t.seq_id)}
    for s, pos in first_pos.items():
        assert np.unique(t.pos[t.seq_id == s]).tolist() == pos


def test_scaled_budget_keeps_the_full_plans_slots(gptoss):
    opts = ReplayOptions(layers=4, scale=0.125, sequences=2, max_tokens=4)
    lru = prepare_replay(gptoss, "gpu-lru", opts)
    full = lru.full_memory.capacities
    assert (full == full[0]).all() and 0 < full[0] < 32
    assert lru.memory.capacities.tolist() == [full[0]] * 4  # uniform: slots per layer kept exactly
    # whole layers (llama.cpp): the same share of layers, rounded down, from the last one
    cpp = prepare_replay(gptoss, "llamacpp", opts)
    share = (cpp.full_memory.capacities > 0).sum() / 24
    assert cpp.memory.capacities.tolist() == [0, 0, 32, 32] and int(share * 4) == 2
    # an explicit cache size is kept; the resolved system reproduces the plan in the simulator
    k6 = prepare_replay(gptoss, "gpu-lru", opts, overrides={"memory": {"cache_experts": "6"}})
    assert k6.memory.capacities.tolist() == [6] * 4
    sim = simulate(k6.trace, k6.sysconf, hardware=k6.hardware, timing=False)
    assert sim.manifest["memory"]["cache_slots_per_layer"] == [6] * 4
    assert k6.sysconf.memory.gpu_memory_gib * GIB == k6.memory.budget_bytes
    # a smaller full budget gives fewer slots
    small = prepare_replay(gptoss, "gpu-lru", opts, overrides={"memory": {"gpu_memory_gib": "8"}})
    assert small.full_memory.capacities[0] == small.memory.capacities[0] < full[0]


def test_impossible_requests_name_the_parameter(gptoss):
    opts = ReplayOptions(layers=2, scale=0.125, sequences=1, max_tokens=2)
    with pytest.raises(ValueError, match="GPU memory budget 1.00 GiB cannot hold.*memory.gpu_memory_gib"):
        prepare_replay(gptoss, "gpu-lru", opts, overrides={"memory": {"gpu_memory_gib": "1"}})
    with pytest.raises(ValueError, match="--model-shape mixtral-8x7b: 8 experts.*32 experts"):
        prepare_replay(gptoss, "gpu-lru", ReplayOptions(model_shape="mixtral-8x7b"))
    with pytest.raises(ValueError, match="unknown system 'nope'"):
        prepare_replay(gptoss, "nope", opts)
    with pytest.raises(ValueError, match="cache_experts=40 exceeds"):
        prepare_replay(gptoss, "gpu-lru", opts, overrides={"memory": {"cache_experts": "40"}})
