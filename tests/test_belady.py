"""Belady (an oracle heuristic): hand example, never fewer hits than LRU or LFU here, the future only for
policies that read it. Belady is not the optimum of the cache semantics: see tests/test_cache_optimal.py."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import WHOLE, demand_rows, tiny_model, write_hand_trace
from hypothesis import given, settings
from hypothesis import strategies as st

from dali_sim.policies import resolve_system
from dali_sim.runtime.future import NEVER, FutureDemand, write_future
from dali_sim.sim import simulate
from dali_sim.trace import TraceWriter, read_trace
from dali_sim.workload import Workload, WorkloadConfig

ONE = tiny_model(num_layers=1, moe_layers=(0,), num_experts=4, top_k=1)


def demand_trace(path, demand, model=ONE):
    """One sequence, one token per step, token p routes to demand[p] (top-1, one MoE layer)."""
    return read_trace(write_hand_trace(path, model, demand_rows(demand)))


def hits(trace, cache, slots, batch=1):
    if cache in ("belady", "optimal"):
        write_future(trace, WorkloadConfig(batch), share=0.0)
    r = simulate(trace, "gpu-lru", batch_size=batch, timing=False,
                 overrides={"cache": {"policy": cache}, "memory": {"cache_experts": str(slots)}}, profiling=WHOLE)
    return r.summary["hits"], r


def test_belady_by_hand(tmp_path):
    """2 slots, demand 0 1 2 0 1 3 0 1 (empty start).
    LRU: 0 m, 1 m, 2 m (evict 0), 0 m (evict 1), 1 m (evict 2), 3 m (evict 0), 0 m (evict 1), 1 m -> 0 hits.
    Belady: 0 m, 1 m, 2 m: next uses 0 -> step 3, 1 -> 4, 2 -> never: bypass 2 (staged); 0 h, 1 h;
    3 m: next uses 0 -> 6, 1 -> 7, 3 -> never: bypass; 0 h, 1 h -> 4 hits."""
    t = demand_trace(tmp_path / "t.parquet", [0, 1, 2, 0, 1, 3, 0, 1])
    assert hits(t, "lru", 2)[0] == 0
    n, r = hits(t, "belady", 2)
    assert n == 4 and r.summary["staged"] == 2 and r.summary["evicted"] == 0
    assert r.summary["bounds"] == {} and r.summary["oracles"] == {"cache": "belady"}


def test_belady_breaks_ties_by_later_uses(tmp_path):
    """1 slot, two sequences run one after the other (batch 1): steps {0,1} {1,2} {0,1} {1,2}.
    At step 1, expert 1 (incoming) and expert 0 (resident) are both next used at step 2, where only
    one can hit; 1 is used again at step 3, so keeping 1 gives 2 hits (steps 2 and 3), keeping 0 one.
    LRU happens to keep 1 as well; plain Belady (depth 1, ties bypass) keeps 0 and loses to it."""
    model = tiny_model(num_layers=1, moe_layers=(0,), num_experts=3, top_k=2)
    rows = [(seq, pos, "decode", [experts]) for seq in (0, 1) for pos, experts in enumerate(([0, 1], [1, 2]))]
    t = read_trace(write_hand_trace(tmp_path / "t.parquet", model, rows))
    assert hits(t, "lru", 1)[0] == 2
    assert hits(t, "belady", 1)[0] == 2
    write_future(t, WorkloadConfig(1), share=0.0)
    classic = simulate(t, "gpu-lru", timing=False, overrides={"cache": {"policy": "belady", "depth": "1"},
                                                              "memory": {"cache_experts": "1"}}, profiling=WHOLE)
    assert classic.summary["hits"] == 1


def test_future_demand_next_use(tmp_path):
    t = demand_trace(tmp_path / "t.parquet", [0, 1, 2, 0, 1, 3, 0, 1])
    f = FutureDemand.from_workload(Workload(t))
    assert f.next_use(0, np.array([0, 1, 2, 3]), 0).tolist() == [3, 1, 2, 5]
    assert f.next_use(0, np.array([2]), 2).tolist() == [NEVER]
    assert f.next_use(0, np.array([0, 1, 3]), 6).tolist() == [NEVER, 7, NEVER]
    assert f.next_uses(0, np.array([0, 3]), 0, 3).tolist() == [[3, 6, NEVER], [5, NEVER, NEVER]]


def test_only_policies_that_read_the_future_get_it():
    from dali_sim.policies.base import CACHES, SetupContext

    with pytest.raises(ValueError, match="needs next-use times"):
        CACHES.get("belady")().setup(SetupContext(1, 4, 1, np.zeros(1), np.zeros((1, 4)), None, 0, (0,)))
    belady = resolve_system("gpu-lru", {"cache": {"policy": "belady"}}).cache.build()
    assert belady.reads_future and not belady.is_bound


@settings(max_examples=30, deadline=None)
@given(demand=st.lists(st.lists(st.integers(0, 5), min_size=2, max_size=2, unique=True), min_size=2, max_size=30),
       slots=st.integers(0, 6), batch=st.integers(1, 3), seqs=st.integers(1, 3))
def test_the_optimum_never_loses_to_belady_lru_or_lfu(tmp_path_factory, demand, slots, batch, seqs):
    """Belady itself can lose to LRU and LFU (the 9-step case in tests/test_cache_optimal.py)."""
    model = tiny_model(num_layers=1, moe_layers=(0,), num_experts=6, top_k=2)
    path = tmp_path_factory.mktemp("b") / "t.parquet"
    with TraceWriter(path, model, provenance={"source": "hypothesis"}) as w:
        for i, experts in enumerate(demand):
            w.write(seq_id=i % seqs, phase="decode", pos=i // seqs, layer=0, experts=np.array([experts]),
                    weights=np.array([[0.5, 0.5]], np.float32))
    t = read_trace(path)
    batch = min(batch, t.num_sequences)  # a larger batch is an error (it used to run as this one)
    best = hits(t, "optimal", slots, batch)[0]
    for other in ("belady", "lru", "lfu"):
        assert best >= hits(t, other, slots, batch)[0], other
