"""Prefetching in the engine: background copies share the link, on-demand copies go first, a prefetched
expert still in flight is waited for; the oracle prefetch; cache swaps land before the layer's next visit.

Trace: the `overlap_trace` fixture of conftest.py: one sequence, 2 MoE layers, 3 experts, top-2:

    pos 0 prefill: layer 0 [0, 1]   layer 1 [2, 0]
    pos 1 prefill: layer 0 [0, 2]   layer 1 [2, 1]
    pos 2 decode:  layer 0 [1, 0]   layer 1 [1, 2]

Touch order (workloads): step 0 layer 0: 0 [2], 1, 2; layer 1: 2 [2], 0, 1; step 1 layer 0: 1, 0;
layer 1: 1, 2. Profile: dense 0.5 s, GPU 1 s per token, copy 2 s (CPU unused).

System: gpu-only, LRU with 0 cache slots (nothing is ever resident), 3 staging buffers, oracle
prefetch of the k=2 heaviest experts of the next layer, 4 prefetch buffers. Worked out on paper:

step 0, layer 0 (t=0): prefetches P(1,2), P(1,0) are issued at the layer start. P(1,2) takes the idle
  link 0-2; P(1,0) queues. Dense 0-0.5. The on-demand copies E0, E1, E2 ask for the link at 0.5 and,
  having priority, get it at 2 before P(1,0): E0 2-4, E1 4-6, E2 6-8 (the link is held between them);
  then P(1,0) 8-10. GPU: E0 (2 tokens) 4-6, E1 6-7, E2 8-9. Layer ends at 9.
step 0, layer 1 (t=9): E2 and E0 were prefetched (E2 landed at 2, E0 lands at 10), E1 is fetched.
  Dense 9-9.5. E1's copy waits for P(1,0) to finish: 10-12. GPU in touch order: E2 (2 tokens, present)
  9.5-11.5, E0 (landed 10) 11.5-12.5, E1 (landed 12) 12.5-13.5. Layer ends at 13.5.
step 1, layer 0 (t=13.5): P(1,1) 13.5-15.5, P(1,2) queued. Dense 13.5-14. On-demand E1, E0 get the link
  at 15.5 first: 15.5-17.5, 17.5-19.5; then P(1,2) 19.5-21.5. GPU: E1 17.5-18.5, E0 19.5-20.5.
step 1, layer 1 (t=20.5): E1 and E2 prefetched; E2 is still in flight. Dense 20.5-21. GPU: E1 21-22,
  E2 (landed 21.5) 22-23. Makespan 23 s.

Counts: 10 activated, 0 hits, 6 on-demand copies, 4 prefetches all used (precision 1, recall
4 / (4 + 6) = 0.4), 10 copies = 20 s of link time; GPU busy 2 s dense + 12 s experts = 14 s;
24 intervals (4 dense, 10 computes, 10 copies).
"""

from __future__ import annotations

import pytest

from dali_sim.policies.base import CachePolicy, LayerView, PrefetchPolicy
from dali_sim.policies.systems import PolicyChoice, resolve_system
from dali_sim.sim.engine import SimEngine
from dali_sim.sim.simulate import simulate
from conftest import WHOLE

ORACLE = {
    "cache": {"policy": "lru"}, "prefetch": {"policy": "oracle", "k": "2"},
    "memory": {"cache_experts": "0", "staging_slots": "3", "prefetch_slots": "4"},
}


@pytest.fixture(scope="module")
def trace(overlap_trace):
    return overlap_trace


@pytest.fixture(scope="module")
def profile(round_profile):
    return round_profile


def run(trace, profile, system="gpu-lru", overrides=ORACLE, **kw):
    return simulate(trace, system, hardware=profile, overrides=overrides, timeline=True, **kw, profiling=WHOLE)


def spans(result, track):
    return [(iv.name, iv.start, iv.end) for iv in result.intervals if iv.track == track]


def test_prefetch_timeline_by_hand(trace, profile):
    r = run(trace, profile)
    assert r.summary["makespan_s"] == 23.0
    assert r.summary["bounds"] == {} and r.summary["oracles"] == {"prefetch": "oracle"}
    assert sorted(spans(r, "pcie"), key=lambda x: x[1]) == [
        ("prefetch L1 E2", 0.0, 2.0), ("fetch L0 E0", 2.0, 4.0), ("fetch L0 E1", 4.0, 6.0),
        ("fetch L0 E2", 6.0, 8.0), ("prefetch L1 E0", 8.0, 10.0), ("fetch L1 E1", 10.0, 12.0),
        ("prefetch L1 E1", 13.5, 15.5), ("fetch L0 E1", 15.5, 17.5), ("fetch L0 E0", 17.5, 19.5),
        ("prefetch L1 E2", 19.5, 21.5)]
    gpu = [x for x in spans(r, "gpu") if not x[0].startswith("dense")]
    assert gpu == [("L0 E0", 4.0, 6.0), ("L0 E1", 6.0, 7.0), ("L0 E2", 8.0, 9.0),
                   ("L1 E2", 9.5, 11.5), ("L1 E0", 11.5, 12.5), ("L1 E1", 12.5, 13.5),
                   ("L0 E1", 17.5, 18.5), ("L0 E0", 19.5, 20.5), ("L1 E1", 21.0, 22.0), ("L1 E2", 22.0, 23.0)]
    s = r.summary
    assert (s["activated"], s["hits"], s["on_demand"], s["prefetch_issued"], s["prefetch_used"],
            s["prefetch_wasted"]) == (10, 0, 6, 4, 4, 0)
    assert s["prefetch_precision"] == 1.0 and s["prefetch_recall"] == pytest.approx(0.4)
    assert s["busy"]["pcie"] == pytest.approx(20 / 23) and s["busy"]["gpu"] == pytest.approx(14 / 23)
    assert s["events"] == 24
    # GPU idle waiting for weights: layer 0 waits 0.5-4 and 7-8 (step 0), 14-17.5 and 18.5-19.5 (step 1);
    # layer 1 always finds its next expert landed (prefetched, or fetched during a compute)
    assert r.per_layer["gpu_wait_s"].tolist() == [3.5 + 1.0 + 3.5 + 1.0, 0.0]


def test_event_path_equals_direct_path_with_prefetch(trace, profile, monkeypatch):
    direct = run(trace, profile)
    monkeypatch.setitem(SimEngine.__init__.__kwdefaults__, "shortcut", False)
    general = run(trace, profile)
    assert spans(direct, "pcie") == spans(general, "pcie") and spans(direct, "gpu") == spans(general, "gpu")
    assert direct.summary == general.summary


def test_no_timing_counts_agree_with_prefetch(trace, profile):
    timed = run(trace, profile)
    counts = simulate(trace, "gpu-lru", hardware=profile, overrides=ORACLE, timing=False, profiling=WHOLE)
    for key in ("hits", "on_demand", "prefetch_issued", "prefetch_used", "prefetch_wasted", "staged", "transfers"):
        assert counts.summary[key] == timed.summary[key], key
    assert counts.per_layer["prefetch_used"].tolist() == [0, 4]


def test_prefetch_needs_buffers_and_buffers_limit_it(trace, profile):
    with pytest.raises(ValueError, match="prefetch policy 'oracle' needs prefetch buffers"):
        simulate(trace, "gpu-lru", hardware=profile, overrides={"prefetch": {"policy": "oracle"}}, timing=False,
                 profiling=WHOLE)
    one = dict(ORACLE, memory={**ORACLE["memory"], "prefetch_slots": "1"})
    r = simulate(trace, "gpu-lru", hardware=profile, overrides=one, timing=False, profiling=WHOLE)
    assert r.summary["prefetch_issued"] == 2  # one buffer: one prefetch per step


class WrongGuess(PrefetchPolicy):
    """Always prefetches expert 0 of the next layer (used at step 0, wasted at step 1)."""

    name = "test-wrong-guess"

    def prefetch(self, view: LayerView) -> list[tuple[int, int]]:
        return [(view.layer + 1, 0)] if view.layer + 1 < view.num_layers else []


def with_policy(family: str, cls, overrides):
    sysconf = resolve_system("gpu-lru", overrides)
    return type(sysconf)(**{**sysconf.__dict__, family: PolicyChoice(family, cls.name, cls.Config())})


def test_wasted_prefetch_is_counted(trace, profile, monkeypatch):
    from dali_sim.policies.base import PREFETCHERS

    monkeypatch.setitem(PREFETCHERS._items, WrongGuess.name, WrongGuess)
    system = with_policy("prefetch", WrongGuess, {"memory": {"cache_experts": "0", "prefetch_slots": "1"}})
    r = simulate(trace, system, hardware=profile, profiling=WHOLE)
    s = r.summary
    assert (s["prefetch_issued"], s["prefetch_used"], s["prefetch_wasted"]) == (2, 1, 1)
    assert s["prefetch_precision"] == 0.5
    assert r.per_layer["prefetch_wasted"].tolist() == [0, 1]


class SwapIn(CachePolicy):
    """Declines admissions; after layer 0 of step 0 swaps expert 2 in for expert 0 (of 2 slots)."""

    name = "test-swap-in"

    def initial(self, layer, capacity, ctx, init, rng):
        return [0, 1]

    def accepts(self, layer, expert, view):
        return False

    def victim(self, layer, expert, view, evictable):
        return None

    def rebalance(self, view, resident):
        return [(2, 0)] if (view.step, view.layer) == (0, 0) else []


def test_cache_swap_lands_before_next_visit(trace, profile, monkeypatch):
    from dali_sim.policies.base import CACHES

    monkeypatch.setitem(CACHES._items, SwapIn.name, SwapIn)
    system = with_policy("cache", SwapIn, {"memory": {"cache_experts": "2", "staging_slots": "2"}})
    r = simulate(trace, system, hardware=profile, timeline=True, profiling=WHOLE)
    s = r.summary
    assert s["swaps"] == 1 and s["transfers"] == s["on_demand"] + 1
    # step 1 layer 0 activates 1 and 0: after the swap layer 0 holds {1, 2}, so 1 hits and 0 is fetched
    assert r.per_layer["hits"].tolist()[0] == 2 + 1  # step 0: experts 0 and 1 were resident; step 1: 1
    swap = [iv for iv in r.intervals if iv.name.startswith("swap")]
    assert len(swap) == 1 and swap[0].name == "swap L0 +E2 -E0"
    step1_layer0 = [iv for iv in r.intervals if iv.name == "dense L0" and iv.args["step"] == 1][0]
    assert swap[0].end <= step1_layer0.start  # landed before the layer's next visit
