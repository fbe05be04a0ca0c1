"""The ``link-budget`` cache and preset (ours, docs/policies.md "Beyond DALI, honestly"): its
decisions on hand-checked cases, determinism, and that it never beats the time lower bound."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from conftest import WHOLE

from dali_sim.policies import CACHES, LayerView, SetupContext, resolve_system
from dali_sim.policies.cache_link import LinkBudget, LinkBudgetConfig, expected_saving, layer_estimate
from dali_sim.sim import simulate
from dali_sim.trace import read_trace
from dali_sim.trace.synth import SynthConfig, synthesize


class RoundCosts:
    """Round numbers: GPU expert 1 s whatever its tokens, CPU expert 3 s per token, a copy 4 s, the dense
    part 0.5 s (the only cost-model calls the policy makes)."""

    def expert_time(self, device, n):
        n = np.asarray(n, dtype=float)
        return np.ones_like(n) if device == "gpu" else 3.0 * n

    def expert_transfer_time(self):
        return 4.0

    def dense_time(self, device, n_tokens, *args, **kwargs):
        return 0.5


E = 4


def ctx(frequencies) -> SetupContext:
    f = np.asarray(frequencies, dtype=float)
    return SetupContext(num_layers=f.shape[0], num_experts=E, top_k=1, capacities=np.full(f.shape[0], 2),
                        frequencies=f, costs=RoundCosts(), seed=0, block_of_layer=tuple(range(f.shape[0])),
                        staging_slots=2)


def view(experts, counts, resident, *, tokens=None, step=0, layer=0, pending=()) -> LayerView:
    res = np.zeros(E, dtype=bool)
    res[list(resident)] = True
    pen = np.zeros(E, dtype=bool)
    pen[list(pending)] = True
    return LayerView(step=step, layer=layer, phase=1, tokens=sum(counts) if tokens is None else tokens,
                     experts=np.asarray(experts), counts=np.asarray(counts), ranks=np.zeros(len(experts), int),
                     resident=res, pending=pen, num_layers=1, num_experts=E, costs=RoundCosts(),
                     lookahead=lambda name, layer: np.zeros(E))


def test_expected_saving_by_hand():
    # share 1 at 1 token: p = 1 - e^-1, n = round(1 / p) = round(1.582) = 2 tokens; a resident copy saves
    # min(t_cpu(2) = 6, 4 + 1) - 1 = 4 s when active
    got = expected_saving(np.array([1.0, 0.0, 0.1]), 1, RoundCosts())
    p = 1 - math.exp(-1)
    assert got[0] == pytest.approx(p * 4.0)
    assert got[1] == 0.0
    # share 0.1: p = 1 - e^-0.1, n = round(0.1 / p) = 1: saves min(3, 5) - 1 = 2 s when active
    assert got[2] == pytest.approx((1 - math.exp(-0.1)) * 2.0)


def test_scores_start_from_the_profile_and_follow_the_workload():
    c = LinkBudget(LinkBudgetConfig(a=0.5))
    c.setup(ctx([[6, 2, 2, 0]]))
    assert c.share[0].tolist() == [0.6, 0.2, 0.2, 0.0]  # token shares, summing to top_k = 1
    c.observe(view([3], [1], resident=[0, 1]))
    assert c.share[0].tolist() == pytest.approx([0.3, 0.1, 0.1, 0.5])


def test_admits_a_fetched_expert_only_when_it_saves_more():
    c = LinkBudget()
    c.setup(ctx([[6, 3, 1, 0]]))
    v = view([0], [1], resident=[1, 2])
    c.observe(v)
    evictable = np.array([1, 2])
    assert c.victim(0, 0, v, evictable) == 2  # expert 0 beats the worst resident (2)
    assert c.victim(0, 3, v, evictable) is None  # expert 3 (never used) does not
    always = LinkBudget(LinkBudgetConfig(admit="always"))
    always.setup(ctx([[6, 3, 1, 0]]))
    always.observe(v)
    assert always.victim(0, 3, v, evictable) == 2


def test_swaps_are_paid_from_idle_link_time():
    c = LinkBudget(LinkBudgetConfig(a=0.5, max_credit=2.0))
    c.setup(ctx([[0, 0, 5, 5]]))  # experts 2 and 3 start hot; 0 and 1 are resident
    # visit 1: expert 0 (resident) runs on the GPU: 0.5 + 1 s, no copy; credit 1.5 s < one copy (4 s)
    v = view([0], [1], resident=[0, 1])
    c.observe(v)
    assert c.credit == pytest.approx(1.5)
    assert c.rebalance(v, v.resident) == []
    # visit 2: expert 3 on the CPU (3 s < 4 + 1 s: not fetched): +3.5 s, credit 5 s: one swap, 3 in for 1 out
    v = view([3], [1], resident=[0, 1])
    c.observe(v)
    assert layer_estimate(v) == (3.5, 0)
    assert c.credit == pytest.approx(5.0)
    assert c.rebalance(v, v.resident) == [(3, 1)]
    assert c.credit == pytest.approx(1.0)


def test_on_demand_copies_stop_background_swaps():
    c = LinkBudget(LinkBudgetConfig(max_credit=10.0))
    c.setup(ctx([[0, 0, 5, 5]]))
    c.credit = 20.0
    # expert 2 with 3 tokens: CPU 9 s > copy 4 + GPU 1 s, so the schedule fetches it: the link is busy
    v = view([2], [3], resident=[0, 1])
    c.observe(v)
    assert layer_estimate(v)[1] == 1
    assert c.credit == 0.0
    assert c.rebalance(v, v.resident) == []


def test_config_is_checked():
    for bad in ({"a": 0}, {"a": 1.5}, {"min_gain": -1}, {"max_credit": -0.5}, {"max_swaps": -1},
                {"admit": "sometimes"}):
        with pytest.raises(ValueError, match="cache."):
            LinkBudgetConfig(**bad)
    assert "link-budget" in CACHES.names()


def test_preset_reading_and_source():
    s = resolve_system("link-budget")
    assert s.reading == "ours" and s.cache.name == "link-budget" and s.placement.name == "hybrimoe"
    assert "cache_link.py" in s.source


def small_trace(tmp_path, model="mixtral-8x7b", seed=0, sequences=6):
    path = tmp_path / f"{model}-{seed}.parquet"
    synthesize(SynthConfig(model=model, sequences=sequences, prompt_len=6, gen_len=10, seed=seed,
                           precision="q4_0"), path)
    return read_trace(path)


def test_deterministic_and_it_swaps(tmp_path):
    trace = small_trace(tmp_path)
    mem = {"memory": {"cache_ratio": 0.5}}
    a = simulate(trace, "link-budget", batch_size=1, overrides=mem)
    b = simulate(trace, "link-budget", batch_size=1, overrides=mem)
    assert a.summary["makespan_s"] == b.summary["makespan_s"]
    assert a.per_step.equals(b.per_step)
    assert a.summary["swaps"] > 0  # at batch 1 nothing is fetched on demand: the link is idle for swaps
    off = simulate(trace, "link-budget", batch_size=1, overrides={**mem, "cache": {"max_swaps": 0}})
    assert off.summary["swaps"] == 0


@pytest.mark.parametrize("i", range(3))
def test_never_beats_the_lower_bound(i, tmp_path):
    rng = random.Random(7000 + i)
    model = ("mixtral-8x7b", "deepseek-v2-lite", "olmoe-1b-7b")[i]
    trace = small_trace(tmp_path, model, seed=i, sequences=rng.randint(2, 4))
    batch = rng.randint(1, trace.num_sequences)
    ratio = rng.choice((0.25, 0.5, 0.75))
    r = simulate(trace, "link-budget", batch_size=batch, overrides={"memory": {"cache_ratio": ratio}},
                 profiling=WHOLE)
    budget = r.manifest["memory"]["used_gib"]
    lb = simulate(trace, "lower-bound", batch_size=batch, overrides={"memory": {"gpu_memory_gib": budget}},
                  profiling=WHOLE)
    for key in ("makespan_s", "prefill_s", "decode_s"):
        assert r.summary[key] >= lb.summary[key] * (1 - 1e-9), key
