"""System presets: every preset resolves and runs; per-model parameters; DALI and mixtral-offloading.
The time bound (`lower-bound`, no policies) is tested in tests/test_lower_bound.py."""

from __future__ import annotations

import pytest

from dali_sim.models import get_model
from dali_sim.policies import resolve_system, system_names
from dali_sim.policies.systems import READINGS
from dali_sim.runtime.future import write_future
from dali_sim.sim import simulate
from dali_sim.trace import TraceError, read_trace
from dali_sim.trace.synth import SynthConfig, synthesize
from dali_sim.workload import WorkloadConfig
from conftest import WHOLE

COUNTERS = ("hits", "on_demand", "prefetch_issued", "prefetch_used", "prefetch_wasted", "admitted",
            "evicted", "staged", "swaps", "gpu_experts")


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """A small Mixtral-shaped trace with every lookahead column a preset reads (prefill + decode)."""
    path = tmp_path_factory.mktemp("presets") / "mix.parquet"
    synthesize(SynthConfig(model="mixtral-8x7b", sequences=4, prompt_len=16, gen_len=12, seed=5,
                           lookahead=("residual=0.9", "next-gate=0.7", "gate2=0.6@2", "gate3=0.5@3")), path)
    t = read_trace(path)
    for share in (0.0, 0.25):  # next-use times for presets that read them (belady): whole, and the default split
        write_future(t, WorkloadConfig(batch_size=2), share=share)
    return t


def test_dali_parameters_follow_the_model_family():
    mixtral = resolve_system("dali", model=get_model("mixtral-8x7b"))
    assert (mixtral.prefetch.config.k, mixtral.cache.config.w, mixtral.cache.config.u) == (1, 4, 1)
    assert mixtral.memory.prefetch_slots == 1 and mixtral.memory.cache_init == "random"
    for name in ("deepseek-v2-lite", "qwen3-30b-a3b"):
        other = resolve_system("dali", model=get_model(name))
        assert (other.prefetch.config.k, other.cache.config.u, other.memory.prefetch_slots) == (4, 8, 4)
    # an override still wins over the per-model value
    assert resolve_system("dali", {"prefetch": {"k": "2"}}, get_model("mixtral-8x7b")).prefetch.config.k == 2


@pytest.mark.parametrize("name", [n for n in system_names() if not resolve_system(n).time_bound])
def test_every_preset_runs_and_both_paths_agree(trace, name):
    """With the default profiling split: the first of the 4 sequences profiles, 3 are evaluated."""
    timed = simulate(trace, name, batch_size=2)
    counted = simulate(trace, name, batch_size=2, timing=False)
    for key in COUNTERS:
        assert timed.summary[key] == counted.summary[key], key
    assert timed.summary["makespan_s"] > 0 and timed.summary["sequences"] == 3
    assert timed.config["system"]["name"] == name and timed.config["system"]["reading"] in READINGS


def test_dali_uses_its_three_techniques(trace):
    r = simulate(trace, "dali", batch_size=2, profiling=WHOLE)
    s = r.summary
    assert s["swaps"] > 0  # the window cache rebalanced
    assert s["prefetch_issued"] > 0 and s["prefetch_used"] > 0  # residual prefetching
    assert 0 < s["gpu_fraction"] < 1  # greedy assignment split experts between the devices
    assert r.config["system"]["prefetch"] == {"policy": "dali-residual", "predictor": "residual", "k": 1}


def test_lookahead_presets_need_their_column(tmp_path):
    path = tmp_path / "plain.parquet"
    synthesize(SynthConfig(model="mixtral-8x7b", sequences=1, prompt_len=4, gen_len=4, seed=1), path)
    with pytest.raises(TraceError, match=r"no lookahead column 'residual'.*dali trace record.*dali trace synth"):
        simulate(path, "dali", timing=False, profiling=WHOLE)
    with pytest.raises(TraceError, match=r"no lookahead column 'next-gate'"):
        simulate(path, "mixtral-offloading-best", timing=False, profiling=WHOLE)
    simulate(path, "mixtral-offloading", timing=False, profiling=WHOLE)  # the released code reads no column


@pytest.mark.parametrize("ratio, resident", [("0", 0), ("0.5", 16)])
def test_moe_lightning_streams_whole_layers(trace, ratio, resident):
    """The DALI paper's reading: the last MoE layers resident whole (as many as hold the bytes of the cache
    ratio: 16 of 32 at 50%; none at 0, the former wg = 0 preset), every expert of each other layer but the
    first streamed during the layer before it (the first is copied on demand)."""
    r = simulate(trace, "moe-lightning", batch_size=2, timing=False, profiling=WHOLE,
                 overrides={"memory": {"cache_ratio": ratio}})
    mem = r.manifest["memory"]
    L = trace.model.num_moe_layers
    assert mem["cache_slots_per_layer"] == [0] * (L - resident) + [8] * resident
    # prefetch_slots = -1: one layer's experts (8 for Mixtral) of buffers
    assert mem["breakdown_gib"]["prefetch_buffers"] * 2**30 == pytest.approx(8 * trace.model.expert_bytes)
    assert r.config["system"]["system"]["dense_device"] == "cpu"
    s = r.summary
    # every expert of the streamed layers 1..L-resident-1 is prefetched each step: 8 per layer per step
    assert s["prefetch_issued"] == s["steps"] * 8 * (L - resident - 1)
    assert s["prefetch_used"] + s["prefetch_wasted"] == s["prefetch_issued"]
