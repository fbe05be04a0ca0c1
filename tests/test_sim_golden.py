"""Golden numbers of the simulator on the checked-in trace tests/data/sim-golden.parquet.

The trace (rows listed in tests/data/make_sim_golden.py): 2 MoE layers, 5 experts, top-2,
seq 0 = 3 prefill + 3 decode tokens, seq 1 = 2 prefill + 2 decode tokens. At batch size 1 it has 7
steps; touch order per (step, layer), workloads in brackets where not all 1:

    step            0                   1      2      3      4                5      6
    layer 0   0,1,3,2 [2,2,1,1]        4,0    4,2    3,1    4,2,3 [2,1,1]    0,2    2,3
    layer 1   2,3,4   [3,2,1]          0,1    2,0    4,3    1,0,4 [2,1,1]    3,1    4,3

Each counter tuple below is (hits, on_demand, admitted, evicted, staged).

* gpu-lru, 2 slots per layer, empty caches, batch 1: derived by hand in
  :func:`test_lru_two_slots_by_hand`.
* gpu-static, frequency init, 2 slots: derived by hand in :func:`test_static_frequency_by_hand`.
* cpu-only and llamacpp: derived by hand in their tests.
* every other entry of :data:`GOLDEN` is a pinned value, checked here against :func:`reference`, an
  independent re-implementation of the cache semantics that reads the raw trace rows (its own
  batching and touch order; no dali_sim code beyond the trace reader).
* the makespan and event count of one timed configuration on a measured profile of simple numbers:
  derived by hand in :func:`test_golden_makespan_by_hand`.
"""

from __future__ import annotations

import functools
import importlib
import runpy
from pathlib import Path

import numpy as np
import pytest
from conftest import WHOLE, round_number_profile

from dali_sim.runtime.memory import kv_cache_bytes
from dali_sim.sim.engine import SimEngine
from dali_sim.sim.simulate import simulate
from dali_sim.trace import read_trace

DATA = Path(__file__).resolve().parent / "data"
GOLDEN_TRACE = DATA / "sim-golden.parquet"
COUNTERS = ("hits", "on_demand", "admitted", "evicted", "staged")
SYSTEM_OF = {"lru": "gpu-lru", "lfu": "gpu-lfu", "static": "gpu-static"}


@pytest.fixture(scope="module")
def trace():
    return read_trace(GOLDEN_TRACE)


def test_checked_in_trace_matches_its_script(tmp_path, trace):
    """The .parquet is exactly what make_sim_golden.py writes (rows and model)."""
    script = runpy.run_path(str(DATA / "make_sim_golden.py"))
    fresh = read_trace(script["write"](tmp_path / "sim-golden.parquet"))
    assert fresh.model == trace.model
    for col in ("seq_id", "pos", "layer", "phase", "experts"):
        assert np.array_equal(getattr(fresh, col), getattr(trace, col)), col
    assert len(trace) == 20  # 10 tokens x 2 MoE layers


# ---- an independent re-implementation ------------------------------------------------------------
def reference_steps(trace, batch_size: int):
    """Per step, per MoE layer, the touch list [(expert, workload)] built from the raw rows."""
    layers = list(trace.layers)
    tokens: dict[int, dict[int, list]] = {}
    for s, p, ph, lay, ex in zip(trace.seq_id.tolist(), trace.pos.tolist(), trace.phase.tolist(),
                                 trace.layer.tolist(), trace.experts.tolist()):
        tok = tokens.setdefault(s, {}).setdefault(p, [None, [None] * len(layers)])
        tok[0] = ph
        tok[1][layers.index(lay)] = ex
    seqs = sorted(tokens)
    steps = []
    for b in range(0, len(seqs), batch_size):
        batch = seqs[b:b + batch_size]
        pre = [[tokens[s][p][1] for p in sorted(tokens[s]) if tokens[s][p][0] == 0] for s in batch]
        dec = [[tokens[s][p][1] for p in sorted(tokens[s]) if tokens[s][p][0] == 1] for s in batch]
        if any(pre):
            steps.append([t for x in pre for t in x])
        for i in range(max(len(d) for d in dec)):
            steps.append([d[i] for d in dec if i < len(d)])
    out = []
    for step_tokens in steps:
        per_layer = []
        for li in range(len(layers)):
            count: dict[int, int] = {}
            best: dict[int, int] = {}
            for t in step_tokens:
                for rank, e in enumerate(t[li]):
                    count[e] = count.get(e, 0) + 1
                    best[e] = min(best.get(e, rank), rank)
            per_layer.append(sorted(count.items(), key=lambda x: (-x[1], best[x[0]], x[0])))
        out.append(per_layer)
    return out


def reference(trace, policy: str, slots: int, batch_size: int = 1, init: str = "empty",
              lfu_count: str = "tokens") -> dict[str, np.ndarray]:
    """Per-layer counters of ``policy`` (lru | lfu | static) with ``slots`` entries per layer cache."""
    steps = reference_steps(trace, batch_size)
    L, E = len(trace.layers), trace.num_experts
    total = np.zeros((L, E), int)
    for st in steps:
        for li in range(L):
            for e, n in st[li]:
                total[li, e] += n
    resident = [set(sorted(range(E), key=lambda e: (-total[li, e], e))[:slots]) if init == "frequency" else set()
                for li in range(L)]
    stamp = np.full((L, E), -1)  # initial entries: older than any touch; ties by lower id
    freq = np.zeros((L, E), int)
    clock = 0
    c = {k: np.zeros(L, int) for k in ("activated",) + COUNTERS}
    for st in steps:
        for li in range(L):
            touch, cache = st[li], resident[li]
            active = {e for e, _ in touch}
            if policy == "lfu":
                for e, n in touch:
                    freq[li, e] += n if lfu_count == "tokens" else 1
            c["activated"][li] += len(touch)
            c["hits"][li] += len(active & cache)
            for e, _ in touch:
                if e in cache:
                    clock += 1
                    stamp[li, e] = clock
                    continue
                c["on_demand"][li] += 1
                if policy == "static":
                    c["staged"][li] += 1
                    continue
                if len(cache) >= slots:
                    evictable = [x for x in cache if x not in active]
                    if not evictable:
                        c["staged"][li] += 1
                        continue
                    if policy == "lru":
                        victim = min(evictable, key=lambda x, li=li: (stamp[li, x], x))
                    else:
                        victim = min(evictable, key=lambda x, li=li: (freq[li, x], stamp[li, x], x))
                    cache.remove(victim)
                    c["evicted"][li] += 1
                cache.add(e)
                c["admitted"][li] += 1
                clock += 1
                stamp[li, e] = clock
    return c


# ---- golden counters --------------------------------------------------------------------------
# (policy, batch size, slots per layer) -> ((hits, on_demand, admitted, evicted, staged), per-layer hits)
GOLDEN = {
    ("lru", 1, 0): ((0, 33, 0, 0, 33), [0, 0]),
    ("lru", 1, 1): ((5, 28, 9, 7, 19), [2, 3]),
    ("lru", 1, 2): ((8, 25, 20, 16, 5), [4, 4]),
    ("lru", 1, 3): ((13, 20, 19, 13, 1), [7, 6]),
    ("lru", 1, 4): ((18, 15, 15, 7, 0), [10, 8]),
    ("lru", 1, 5): ((23, 10, 10, 0, 0), [12, 11]),
    ("lfu", 1, 0): ((0, 33, 0, 0, 33), [0, 0]),
    ("lfu", 1, 1): ((5, 28, 9, 7, 19), [2, 3]),
    ("lfu", 1, 2): ((8, 25, 20, 16, 5), [4, 4]),
    ("lfu", 1, 3): ((11, 22, 21, 15, 1), [5, 6]),
    ("lfu", 1, 4): ((17, 16, 16, 8, 0), [9, 8]),
    ("lfu", 1, 5): ((23, 10, 10, 0, 0), [12, 11]),
    ("static", 1, 0): ((0, 33, 0, 0, 33), [0, 0]),
    ("static", 1, 1): ((9, 24, 0, 0, 24), [5, 4]),
    ("static", 1, 2): ((15, 18, 0, 0, 18), [8, 7]),
    ("static", 1, 3): ((21, 12, 0, 0, 12), [12, 9]),
    ("static", 1, 4): ((28, 5, 0, 0, 5), [15, 13]),
    ("static", 1, 5): ((33, 0, 0, 0, 0), [17, 16]),
    ("lru", 2, 1): ((1, 26, 7, 5, 19), [1, 0]),
    ("lru", 2, 2): ((4, 23, 12, 8, 11), [2, 2]),
    ("lru", 2, 3): ((10, 17, 12, 6, 5), [5, 5]),
    ("lru", 2, 4): ((13, 14, 12, 4, 2), [6, 7]),
    ("lfu", 2, 1): ((1, 26, 7, 5, 19), [1, 0]),
    ("lfu", 2, 2): ((4, 23, 12, 8, 11), [2, 2]),
    ("lfu", 2, 3): ((10, 17, 12, 6, 5), [5, 5]),
    ("lfu", 2, 4): ((13, 14, 12, 4, 2), [6, 7]),
    ("static", 2, 1): ((7, 20, 0, 0, 20), [3, 4]),
    ("static", 2, 2): ((11, 16, 0, 0, 16), [5, 6]),
    ("static", 2, 3): ((16, 11, 0, 0, 11), [8, 8]),
    ("static", 2, 4): ((22, 5, 0, 0, 5), [11, 11]),
}
ACTIVATED = {1: 33, 2: 27}  # batch 2: steps {prefill of both}, then 3 decode steps; 27 activated


def _counts(summary) -> tuple:
    return tuple(int(summary[k]) for k in COUNTERS)


@pytest.mark.parametrize("key", sorted(GOLDEN), ids=lambda k: f"{k[0]}-b{k[1]}-k{k[2]}")
def test_reference_agrees_with_golden(trace, key):
    policy, batch, slots = key
    c = reference(trace, policy, slots, batch, init="frequency" if policy == "static" else "empty")
    want, hits = GOLDEN[key]
    assert tuple(int(c[k].sum()) for k in COUNTERS) == want
    assert c["hits"].tolist() == hits
    assert int(c["activated"].sum()) == ACTIVATED[batch]


@pytest.mark.parametrize("key", sorted(GOLDEN), ids=lambda k: f"{k[0]}-b{k[1]}-k{k[2]}")
def test_simulator_golden_counters(trace, key):
    """Preset (gpu-static brings frequency init) at a given cache size; both simulator paths."""
    policy, batch, slots = key
    want, hits = GOLDEN[key]
    timed = key in {("lru", 1, 2), ("lfu", 1, 3), ("static", 1, 2), ("lru", 2, 3)}
    for timing in ((False, True) if timed else (False,)):
        r = simulate(trace, SYSTEM_OF[policy], batch_size=batch, timing=timing,
                     overrides={"memory": {"cache_experts": str(slots)}}, profiling=WHOLE)
        assert _counts(r.summary) == want, timing
        assert r.per_layer["hits"].tolist() == hits
        s = r.summary
        assert s["activated"] == ACTIVATED[batch]
        assert s["gpu_experts"] == s["activated"] and s["cpu_experts"] == 0
        assert s["transfers"] == s["on_demand"] and s["bytes_h2d"] == s["on_demand"] * 768
        assert s["hit_rate"] == pytest.approx(want[0] / ACTIVATED[batch])
        assert s["on_demand"] == s["admitted"] + s["staged"]  # every GPU miss is admitted or staged


@pytest.mark.parametrize("policy, init, count", [
    ("lru", "frequency", None), ("lfu", "frequency", "tokens"), ("lfu", "empty", "activations"),
    ("lru", "random", None),
])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("slots", [2, 3, 4])
def test_variants_match_reference(trace, policy, init, count, batch, slots):
    """Frequency-initialised LRU/LFU and activation-counted LFU agree with the re-implementation.
    (Random init is checked through its initial contents: the same seed gives the same result.)"""
    over = {"memory": {"cache_experts": str(slots), "cache_init": init}}
    if policy == "lfu":
        over["cache"] = {"count": count}
    r = simulate(trace, SYSTEM_OF[policy], batch_size=batch, overrides=over, timing=False, seed=3, profiling=WHOLE)
    if init == "random":
        again = simulate(trace, SYSTEM_OF[policy], batch_size=batch, overrides=over, timing=False, seed=3,
                         profiling=WHOLE)
        assert r.to_json() == again.to_json()
        return
    c = reference(trace, policy, slots, batch, init=init, lfu_count=count or "tokens")
    for k in ("activated",) + COUNTERS:
        assert r.per_layer[k].tolist() == c[k].tolist(), k


def test_lru_two_slots_by_hand(trace):
    """gpu-lru, 2 slots per layer, empty caches, batch 1, worked out entry by entry (stamps: LRU order).

    layer 0 (cache after the step; a = admitted, e = evicted victim, s = staged):
      s0 0,1,3,2: 0 a, 1 a; 3 and 2: full, both entries activated -> s, s.   {0,1}   h0 m4 a2 e0 s2
      s1 4,0:     4: victim among not-activated {1} -> e1, a4; 0 hit.        {0,4}   h1 m1 a1 e1
      s2 4,2:     4 hit; 2: victim {0} -> e0, a2.                             {2,4}   h1 m1 a1 e1
      s3 3,1:     3: victims {2,4}, 4 touched at s2 before 2 -> e4, a3;
                  1: victims {2} -> e2, a1.                                   {1,3}   h0 m2 a2 e2
      s4 4,2,3:   (3 resident: hit) 4: victims {1} -> e1, a4; 2: {3,4} both
                  activated -> s; 3 hit.                                      {3,4}   h1 m2 a1 e1 s1
      s5 0,2:     0: victims {3,4}, 4 (admitted s4) older than 3 (hit s4 after)
                  -> e4, a0; 2: victims {3} -> e3, a2.                        {0,2}   h0 m2 a2 e2
      s6 2,3:     2 hit; 3: victims {0} -> e0, a3.                            {2,3}   h1 m1 a1 e1
      layer 0: hits 4, on-demand 13, admitted 10, evicted 8, staged 3
    layer 1:
      s0 2,3,4:   2 a, 3 a, 4 s.                                              {2,3}   h0 m3 a2 e0 s1
      s1 0,1:     0: victims {2,3}, 2 older -> e2, a0; 1: {3} -> e3, a1.      {0,1}   h0 m2 a2 e2
      s2 2,0:     (0 resident) 2: victims {1} -> e1, a2; 0 hit.               {0,2}   h1 m1 a1 e1
      s3 4,3:     4: victims {0,2}, 2 (admitted s2) older than 0 (hit after)
                  -> e2, a4; 3: {0} -> e0, a3.                                {3,4}   h0 m2 a2 e2
      s4 1,0,4:   (4 resident) 1: victims {3} -> e3, a1; 0: {1,4} both
                  activated -> s; 4 hit.                                      {1,4}   h1 m2 a1 e1 s1
      s5 3,1:     (1 resident) 3: victims {4} -> e4, a3; 1 hit.               {1,3}   h1 m1 a1 e1
      s6 4,3:     (3 resident) 4: victims {1} -> e1, a4; 3 hit.               {3,4}   h1 m1 a1 e1
      layer 1: hits 4, on-demand 12, admitted 10, evicted 8, staged 2
    total: hits 8, on-demand 25, admitted 20, evicted 16, staged 5 (= GOLDEN[("lru", 1, 2)]).
    """
    r = simulate(trace, "gpu-lru", overrides={"memory": {"cache_experts": "2"}}, timing=False, profiling=WHOLE)
    pl = r.per_layer
    assert pl["activated"].tolist() == [17, 16]
    assert pl["hits"].tolist() == [4, 4]
    assert pl["on_demand"].tolist() == [13, 12]
    assert pl["admitted"].tolist() == [10, 10]
    assert pl["evicted"].tolist() == [8, 8]
    assert pl["staged"].tolist() == [3, 2]
    assert _counts(r.summary) == (8, 25, 20, 16, 5) == GOLDEN[("lru", 1, 2)][0]
    assert r.summary["hit_rate"] == 8 / 33


def test_static_frequency_by_hand(trace):
    """gpu-static (frequency init), 2 slots: total workload per expert (ids 0..4) is
    layer 0 [4, 3, 5, 4, 4] -> {2, 0} (5, then the lowest id of the 4s);
    layer 1 [3, 4, 4, 5, 4] -> {3, 1}.
    Hits: layer 0: expert 0 activated in steps 0, 1, 5 and expert 2 in steps 0, 2, 4, 5, 6 -> 8;
    layer 1: expert 1 in steps 1, 4, 5 and expert 3 in steps 0, 3, 5, 6 -> 7.
    Nothing is admitted or evicted; every one of the 33 - 15 = 18 misses is staged."""
    r = simulate(trace, "gpu-static", overrides={"memory": {"cache_experts": "2"}}, timing=False, profiling=WHOLE)
    assert r.per_layer["hits"].tolist() == [8, 7]
    assert _counts(r.summary) == (15, 18, 0, 0, 18) == GOLDEN[("static", 1, 2)][0]
    assert r.config["system"]["memory"]["cache_init"] == "frequency"


def test_cpu_only_by_hand(trace):
    """cpu-only: no cache slots, every activated expert on the CPU, nothing moves over PCIe."""
    r = simulate(trace, "cpu-only", timing=False, profiling=WHOLE)
    s = r.summary
    assert (s["activated"], s["cpu_experts"], s["gpu_experts"], s["hits"]) == (33, 33, 0, 0)
    assert (s["on_demand"], s["admitted"], s["evicted"], s["staged"], s["transfers"]) == (0, 0, 0, 0, 0)
    assert s["cpu_tokens"] == 40 and s["gpu_tokens"] == 0  # 10 tokens x top-2 x 2 layers
    assert r.manifest["memory"]["cache_slots_per_layer"] == [0, 0]


def _llamacpp_checks(r):
    """Layer 0 on the CPU (17 activated, 20 tokens), layer 1 wholly resident on the GPU: its 16
    activated experts are all hits; no transfers at all."""
    pl = r.per_layer
    assert pl["cpu_experts"].tolist() == [17, 0]
    assert pl["gpu_experts"].tolist() == [0, 16]
    assert pl["hits"].tolist()[1] == 16
    assert pl["cpu_tokens"].tolist() == [20, 0] and pl["gpu_tokens"].tolist() == [0, 20]
    s = r.summary
    assert (s["on_demand"], s["admitted"], s["evicted"], s["staged"], s["transfers"]) == (0, 0, 0, 0, 0)


def test_llamacpp_budget_fits_one_layer(trace):
    """A budget of the fixed working set + 1.5 layers of experts: whole-layers gives the last layer
    all 5 experts and layer 0 none, and static-layers (cpu_layers = -1) runs layer 0 on the CPU."""
    m = trace.model
    # llamacpp has one layer of staging buffers (its op-offload copies) and no prefetch buffers; KV cache:
    # batch 1, the longest step reads 6 tokens
    kv = kv_cache_bytes(m, 6)
    fixed = m.bytes_of(m.non_expert_params) + kv + m.num_experts * m.expert_bytes
    budget = fixed + 5 * m.expert_bytes * 3 // 2
    r = simulate(trace, "llamacpp", timing=False, overrides={"memory": {"gpu_memory_gib": repr(budget / 2**30)}},
                 profiling=WHOLE)
    assert r.manifest["memory"]["budget_gib"] * 2**30 == budget
    assert r.manifest["memory"]["cache_slots_per_layer"] == [0, 5]
    _llamacpp_checks(r)
    assert r.per_layer["hits"].tolist() == [0, 16]
    # one byte less than a whole layer's experts beyond the fixed part: no GPU layer at all
    r0 = simulate(trace, "llamacpp", timing=False,
                  overrides={"memory": {"gpu_memory_gib": repr((fixed + 5 * m.expert_bytes - 1) / 2**30)}},
                  profiling=WHOLE)
    assert r0.manifest["memory"]["cache_slots_per_layer"] == [0, 0]
    assert r0.summary["cpu_experts"] == 33 and r0.summary["hits"] == 0


def test_llamacpp_explicit_cpu_layers(trace):
    r = simulate(trace, "llamacpp", timing=False, overrides={"placement": {"cpu_layers": "1"}}, profiling=WHOLE)
    _llamacpp_checks(r)
    # an explicit N fixes the layout: no cache for the CPU layer (so no hits there), the rest whole
    assert r.manifest["memory"]["cache_slots_per_layer"] == [0, 5]
    assert r.per_layer["hits"].tolist() == [0, 16]
    assert r.config["system"]["placement"]["cpu_layers"] == 1
    # and it must fit: one whole layer of experts does not fit a budget of the fixed part alone
    fixed = simulate(trace, "llamacpp", timing=False, overrides={"placement": {"cpu_layers": "2"}}, profiling=WHOLE)
    budget_gib = fixed.manifest["memory"]["used_gib"]
    with pytest.raises(ValueError, match=r"the placement needs 5 cached experts"):
        simulate(trace, "llamacpp", timing=False,
                 overrides={"placement": {"cpu_layers": "1"}, "memory": {"gpu_memory_gib": str(budget_gib)}},
                 profiling=WHOLE)


# ---- timed golden run ----------------------------------------------------------------------------



@pytest.fixture
def profile(tmp_path, trace):
    return round_number_profile(tmp_path / "simple.json", trace.model)


def _general_path(monkeypatch):
    """Make simulate() build its engine with shortcut=False (the general SimPy path everywhere)."""
    simulate_mod = importlib.import_module("dali_sim.sim.simulate")  # the package re-exports the function
    monkeypatch.setattr(simulate_mod, "SimEngine", functools.partial(SimEngine, shortcut=False))


def test_golden_makespan_by_hand(trace, profile, monkeypatch):
    """gpu-lru, 2 slots, batch 1 on the simple profile: dense 0.5 s, copy 2 s, GPU n s for n tokens.

    Per layer, after the dense part (t0 = layer start + 0.5): hits are present at t0, the i-th
    on-demand copy (touch order) lands at t0 + 2i (back to back on the link; no layer has more than
    2 staged experts, so the 2 staging buffers never hold a copy back). The GPU never idles while an
    expert is present, so it ends at max over experts j of (r_j + sum of the GPU times of experts
    arriving at or after r_j). With the hits/misses of test_lru_two_slots_by_hand:

      layer 0  s0  miss 0[2] 1[2] 3[1] 2[1]: r 2,4,6,8 -> max(2+6, 4+4, 6+2, 8+1) = 9
               s1  hit 0, miss 4: max(0+2, 2+1) = 3      s2  hit 4, miss 2: 3
               s3  miss 3, 1: max(2+2, 4+1) = 5           s4  hit 3, miss 4[2], 2: max(0+4, 2+3, 4+1) = 5
               s5  miss 0, 2: 5                           s6  hit 2, miss 3: 3
               sum 9+3+3+5+5+5+3 = 33
      layer 1  s0  miss 2[3] 3[2] 4[1]: max(2+6, 4+3, 6+1) = 8
               s1  miss 0, 1: 5      s2  hit 0, miss 2: 3      s3  miss 4, 3: 5
               s4  hit 4, miss 1[2], 0: max(0+4, 2+3, 4+1) = 5  s5  hit 1, miss 3: 3   s6  hit 3, miss 4: 3
               sum 8+5+3+5+5+3+3 = 32
    dense: 14 layer visits x 0.5 = 7.  makespan = 33 + 32 + 7 = 72 s.
    prefill steps 0 and 4: (0.5+9 + 0.5+8) + (0.5+5 + 0.5+5) = 18 + 11 = 29 s; decode 72 - 29 = 43 s.
    events = 14 dense parts + 33 expert computes + 25 copies = 72.
    busy: PCIe 25 x 2 = 50 s; GPU 7 s dense + 40 expert-token seconds = 47 s.
    """
    for general in (False, True):
        if general:
            _general_path(monkeypatch)
        r = simulate(trace, "gpu-lru", hardware=profile, overrides={"memory": {"cache_experts": "2"}}, profiling=WHOLE)
        s = r.summary
        assert _counts(s) == (8, 25, 20, 16, 5)
        assert s["makespan_s"] == 72.0
        assert s["events"] == 72
        assert s["prefill_s"] == 29.0 and s["decode_s"] == 43.0
        assert s["busy"] == {"gpu": 47 / 72, "cpu": 0.0, "pcie": 50 / 72, "host": 0.0}
        assert r.per_step["time_s"].tolist() == [18.0, 9.0, 7.0, 11.0, 11.0, 9.0, 7.0]
        assert r.per_layer["time_s"].tolist() == [33 + 3.5, 32 + 3.5]
        # per sequence: seq 0 TTFT 18 s (3 prompt tokens), decode 9+7+11 = 27 s for 3 tokens;
        # seq 1 TTFT 11 s (2 tokens), decode 9 + 7 = 16 s for 2 tokens
        ps = r.per_sequence
        assert ps["ttft_s"].tolist() == [18.0, 11.0]
        assert ps["decode_time_s"].tolist() == [27.0, 16.0]
        assert s["prefill_tokens_per_s"] == pytest.approx((3 / 18 + 2 / 11) / 2, rel=1e-12)
        assert s["decode_tokens_per_s"] == pytest.approx((3 / 27 + 2 / 16) / 2, rel=1e-12)


def test_golden_cpu_only_and_llamacpp_makespan(trace, profile):
    """cpu-only: every layer = 0.5 dense + 3 s per expert-token on the CPU: 7 + 3 x 40 = 127 s,
    events 14 + 33 = 47. llamacpp with layer 0 on the CPU: 7 + 3 x 20 (layer 0) + 1 x 20 (layer 1,
    all hits on the GPU) = 87 s, events 47, no copies."""
    r = simulate(trace, "cpu-only", hardware=profile, profiling=WHOLE)
    assert r.summary["makespan_s"] == 127.0 and r.summary["events"] == 47
    assert r.summary["busy"] == {"gpu": 7 / 127, "cpu": 120 / 127, "pcie": 0.0, "host": 0.0}
    r = simulate(trace, "llamacpp", hardware=profile, overrides={"placement": {"cpu_layers": "1"}}, profiling=WHOLE)
    assert r.summary["makespan_s"] == 87.0 and r.summary["events"] == 47
    assert r.summary["busy"]["pcie"] == 0.0


@pytest.mark.parametrize("staging", [1, 2])
def test_a_lane_that_waits_for_every_copy_still_runs_when_staging_buffers_are_short(trace, monkeypatch, staging):
    """An implementation whose grouped launch needs every expert's weights (fiddler's) with fewer staging
    buffers than a layer's staged experts (``gpu-static``: every miss is staged): what is present runs first
    and frees its buffer, the rest are then waited for together (this deadlocked the general path). Both
    paths give the same times (on the default profile: the round-number one has exact ties between a
    landing and a compute's end, which the two paths order differently)."""
    over = {"memory": {"cache_experts": "2", "staging_slots": str(staging)}, "system": {"implementation": "fiddler"}}
    direct = simulate(trace, "gpu-static", overrides=over, profiling=WHOLE).summary
    _general_path(monkeypatch)
    general = simulate(trace, "gpu-static", overrides=over, profiling=WHOLE).summary
    assert general["makespan_s"] == pytest.approx(direct["makespan_s"], rel=1e-12)
    assert _counts(general) == _counts(direct)
