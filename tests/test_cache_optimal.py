"""The exact cache optimum (``cache.policy=optimal``, a BOUND): brute force, realisation, counter-examples.

The brute force (:func:`brute_force`) is an exhaustive search over every decision the shared cache
semantics (docs/policies.md) allow: at each (step, layer), in touch order, each miss is declined, or
admitted into a free slot, or admitted in place of any entry not activated in the step; hits are
counted against the contents at the step's start. It shares no code with the min-cost flow.
"""

from __future__ import annotations

import itertools
import random
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from conftest import WHOLE, tiny_model

from dali_sim.policies import CACHES, PLACEMENTS, PREFETCHERS
from dali_sim.policies.cache_optimal import optimal_cache_schedule
from dali_sim.runtime.controller import Controller
from dali_sim.runtime.future import FutureDemand, write_future
from dali_sim.sim import simulate
from dali_sim.sim.counters import PlanCounters
from dali_sim.trace import TraceWriter, read_trace
from dali_sim.workload import Workload, WorkloadConfig

REPO = Path(__file__).resolve().parents[1]
SEQS = 3  # tokens per step (one per sequence, batch SEQS): a step activates 1..3 experts
SMALL = [[0, 2], [2, 1], [1, 2]]
NINE = [[1, 4, 0], [2, 4, 5], [5, 4, 3], [0, 2, 5], [5, 1, 2], [5, 3, 1], [1, 4, 5], [1, 5, 3], [5, 0, 1]]


def brute_force(steps, capacity: int, initial=None) -> int:
    """Most hits over every decision the semantics allow; ``initial`` None = best initial contents too."""
    T = len(steps)

    @lru_cache(maxsize=None)
    def best(t: int, start: frozenset) -> int:
        if t == T:
            return 0
        A = steps[t]
        outcomes: set[frozenset] = set()

        def touch(i: int, cur: frozenset) -> None:
            if i == len(A):
                outcomes.add(cur)
                return
            e = A[i]
            if e in start:  # a hit: refreshed, stays
                touch(i + 1, cur)
                return
            touch(i + 1, cur)  # declined (staged)
            if len(cur) < capacity:
                touch(i + 1, cur | {e})
            else:
                for v in cur - set(A):  # evict an entry not activated in this step
                    touch(i + 1, (cur - {v}) | {e})

        touch(0, start)
        return len(start & set(A)) + max(best(t + 1, s) for s in outcomes)

    if initial is not None:
        return best(0, frozenset(initial))
    experts = sorted({e for A in steps for e in A})
    return max(best(0, frozenset(s)) for k in range(capacity + 1) for s in itertools.combinations(experts, k))


def activations(steps):
    """(experts, steps) sorted by expert, then step: the solver's input."""
    pairs = sorted((e, t) for t, A in enumerate(steps) for e in A)
    return np.array([p[0] for p in pairs], np.int64), np.array([p[1] for p in pairs], np.int64)


def solve(steps, num_experts, capacity, initial=None):
    init = None
    if initial is not None:
        init = np.zeros(num_experts, bool)
        init[list(initial)] = True
    return optimal_cache_schedule(*activations(steps), num_experts, capacity, init)


def random_streams(n: int, seed: int):
    """(steps, experts, slots): 3-6 experts, 1-3 slots, 1-10 steps of 1-3 distinct experts."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        E = rng.randint(3, 6)
        steps = [rng.sample(range(E), rng.randint(1, 3)) for _ in range(rng.randint(1, 10))]
        out.append((steps, E, rng.randint(1, 3)))
    return out


STREAMS = random_streams(320, seed=11) + [(SMALL, 3, 1), (NINE, 6, 2)]


def test_brute_force_by_hand():
    """[0,2] [2,1] [1,2], one slot, empty start: keep 2 through (hits at steps 1 and 2) = 2; belady's
    choice (admit 0 into the free slot, keep it) reaches 1."""
    assert brute_force(SMALL, 1, ()) == 2
    assert brute_force([[0], [0], [0]], 1, ()) == 2 and brute_force([[0], [0], [0]], 1) == 3
    assert brute_force([[0, 1], [0, 1]], 1, ()) == 1  # both activated: one slot, one hit


def test_solver_equals_brute_force_on_random_streams():
    """322 streams, each with an empty start, a random given start and the best start."""
    rng = random.Random(5)
    for steps, E, C in STREAMS:
        given = rng.sample(range(E), rng.randint(0, C))
        for init in ((), given, None):
            got = solve(steps, E, C, init)
            assert got.hits == brute_force(steps, C, init), (steps, E, C, init)
            assert got.hits == int(got.keep.sum() + got.initial.sum())
            if init is not None:
                assert set(np.flatnonzero(got.initial)) <= set(init)


# ---- through the controller ----------------------------------------------------------------------
def stream_trace(path: Path, steps, num_experts: int):
    """One MoE layer, top-1, SEQS sequences decoded together: at step t the tokens route to steps[t]
    (token j to steps[t][j % len])."""
    model = tiny_model(num_layers=1, moe_layers=(0,), num_experts=num_experts, top_k=1)
    with TraceWriter(path, model, provenance={"source": "hypothesis", "command": "tests/test_cache_optimal.py"}) as w:
        for t, A in enumerate(steps):
            for j in range(SEQS):
                w.write(seq_id=j, phase="decode", pos=t, layer=0, experts=np.array([[A[j % len(A)]]]),
                        weights=np.ones((1, 1), np.float32))
    return read_trace(path)


def counted_hits(workload, cache_name, capacity, init, overrides=None, seed=0):
    cls = CACHES.get(cache_name)
    cache = cls(cls.Config().with_overrides(overrides or {}, "cache"))
    ctl = Controller(workload, None, PLACEMENTS.get("gpu-only")(), cache, PREFETCHERS.get("none")(),
                     np.array([capacity]), cache_init=init, staging_slots=SEQS, seed=seed,
                     future=FutureDemand.from_workload(workload))
    counters = PlanCounters(1)
    for plan in ctl.plans():
        counters.add(plan)
    return counters.totals()["hits"], ctl


@pytest.mark.parametrize("stride", [pytest.param(4, id="every-4th"),
                                    pytest.param(1, id="all", marks=pytest.mark.slow)])
def test_the_controller_counts_the_optimum(tmp_path, stride):
    """The optimal cache, run by the controller, counts exactly the brute-force optimum (given start:
    empty, random, frequency; and the best start), and no other cache counts more."""
    for i, (steps, E, C) in enumerate(STREAMS[::stride] + STREAMS[-2:]):
        w = Workload(stream_trace(tmp_path / f"s{i}.parquet", steps, E), WorkloadConfig(SEQS))
        for init in ("empty", "random", "frequency"):
            got, ctl = counted_hits(w, "optimal", C, init, seed=i)
            start = np.flatnonzero(ctl.initial_resident[0]).tolist()
            assert got == int(ctl.cache.optimum[0]) == brute_force(steps, C, start), (steps, E, C, init)
            for other in ("lru", "lfu", "belady"):
                assert counted_hits(w, other, C, init, seed=i)[0] <= got, (other, steps, C, init)
        best, ctl = counted_hits(w, "optimal", C, "empty", {"init": "optimal"})
        assert best == int(ctl.cache.optimum[0]) == brute_force(steps, C)


def sets_trace(path: Path, steps, num_experts: int):
    """One MoE layer, one sequence, one token per step routed to all of steps[t] (top-k = the set size)."""
    k = len(steps[0])
    assert all(len(A) == k for A in steps)
    model = tiny_model(num_layers=1, moe_layers=(0,), num_experts=num_experts, top_k=k)
    with TraceWriter(path, model, provenance={"source": "issue 11", "command": "tests/test_cache_optimal.py"}) as w:
        for t, A in enumerate(steps):
            w.write(seq_id=0, phase="decode", pos=t, layer=0, experts=np.array([A]),
                    weights=np.full((1, k), 1 / k, np.float32))
    return read_trace(path)


@pytest.mark.parametrize("steps,E,C,want", [(SMALL, 3, 1, {"belady": 1, "optimal": 2}),
                                             (NINE, 6, 2, {"lru": 12, "lfu": 12, "belady": 11, "optimal": 13})],
                         ids=["3-steps", "9-steps"])
def test_the_issue_counter_examples(tmp_path, steps, E, C, want):
    """From the issue: belady below the optimum; in the 9-step case lru and lfu beat belady too."""
    trace = sets_trace(tmp_path / "t.parquet", steps, E)
    write_future(trace, WorkloadConfig(1), share=0.0)
    for name, hits in want.items():
        r = simulate(trace, "gpu-lru", timing=False, overrides={"cache": {"policy": name},
                                                                "memory": {"cache_experts": str(C)}}, profiling=WHOLE)
        assert r.summary["hits"] == hits, name
        bound = name == "optimal"
        assert r.summary["bounds"] == ({"cache": "optimal"} if bound else {})
        assert r.summary["oracles"] == ({"cache": "belady"} if name == "belady" else {})
    assert brute_force(steps, C, ()) == want["optimal"]


def test_optimal_needs_the_future_and_a_known_init():
    from dali_sim.policies.base import SetupContext

    with pytest.raises(ValueError, match="needs next-use times"):
        CACHES.get("optimal")().setup(SetupContext(1, 4, 1, np.zeros(1), np.zeros((1, 4)), None, 0, (0,)))
    with pytest.raises(ValueError, match="cache.init must be one of given, optimal"):
        CACHES.get("optimal").Config(init="frequency")
    with pytest.raises(ValueError, match="sorted by expert"):
        optimal_cache_schedule(np.array([1, 0]), np.array([0, 0]), 2, 1)


# ---- shipped traces ------------------------------------------------------------------------------
#: the shipped traces (not their sidecars: hidden states, next-use files `dali trace enrich` writes beside them)
SHIPPED = sorted(p for p in (REPO / "traces").glob("*.parquet")
                 if ".hidden." not in p.name and ".future-" not in p.name)


def _per_layer_hits(trace, cache, slots, batch, future):
    r = simulate(trace, "gpu-lru", batch_size=batch, timing=False, future=future,
                 overrides={"cache": {"policy": cache},
                            "memory": {"cache_experts": str(slots), "gpu_memory_gib": "4096"}}, profiling=WHOLE)
    return r.per_layer["hits"].to_numpy()


def _check_shipped(path: Path, tmp_path, batch: int):
    """Per layer and at several cache sizes, optimal >= belady, lru, lfu."""
    trace = read_trace(path)
    future = write_future(trace, WorkloadConfig(batch), tmp_path / f"{path.stem}.future.parquet", share=0.0)
    E = trace.num_experts
    for slots in sorted({1, 2, E // 4, E // 2, E - 1} - {0}):
        best = _per_layer_hits(trace, "optimal", slots, batch, future)
        for other in ("belady", "lru", "lfu"):
            hits = _per_layer_hits(trace, other, slots, batch, future)
            assert (best >= hits).all(), (path.name, slots, other, best.tolist(), hits.tolist())


def test_optimal_beats_every_cache_on_the_smallest_shipped_trace(tmp_path):
    _check_shipped(REPO / "traces" / "switch-base-8.parquet", tmp_path, 1)


@pytest.mark.slow
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
@pytest.mark.parametrize("batch", [1, 8])
def test_optimal_beats_every_cache_on_every_shipped_trace(path, batch, tmp_path):
    _check_shipped(path, tmp_path, batch)
