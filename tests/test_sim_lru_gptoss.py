"""gpu-lru on the shipped GPT-OSS-20B trace against an independent LRU computed from the raw rows.

At batch size 1 every step is one decode token, every activated expert has workload 1 and the touch
order of a (step, layer) is the row's rank order. The reference below keeps, per MoE layer, one
cache of K entries (an OrderedDict, oldest first) and applies the cache semantics: a hit is counted
against the contents at the start of the (step, layer); a resident expert is refreshed; a missing
one is admitted into a free slot, else it evicts the least recently used entry that is not
activated in this step, else (every entry activated) it is staged and not admitted.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from dali_sim.sim.simulate import simulate
from dali_sim.trace import TraceWriter, read_trace
from conftest import WHOLE

REPO = Path(__file__).resolve().parents[1]
GPT_OSS = REPO / "traces" / "gpt-oss-20b.parquet"
FIELDS = ("activated", "hits", "on_demand", "admitted", "evicted", "staged")


def reference_lru(trace, slots: int) -> dict[str, np.ndarray]:
    """Per-layer counters of per-layer LRU caches of ``slots`` entries, from the raw trace rows."""
    layers = sorted(set(trace.layer.tolist()))
    index = {b: i for i, b in enumerate(layers)}
    order = np.lexsort((trace.layer, trace.pos, trace.seq_id))  # tokens in (seq, pos) order, then layer
    experts = trace.experts[order].tolist()
    row_layer = [index[b] for b in trace.layer[order].tolist()]
    caches = [OrderedDict() for _ in layers]
    c = {k: np.zeros(len(layers), dtype=np.int64) for k in FIELDS}
    for li, row in zip(row_layer, experts):
        cache = caches[li]
        active = set(row)
        c["activated"][li] += len(row)
        c["hits"][li] += sum(e in cache for e in row)
        for e in row:  # touch order = rank order at batch 1
            if e in cache:
                cache.move_to_end(e)
                continue
            c["on_demand"][li] += 1
            if len(cache) >= slots:
                victim = next((x for x in cache if x not in active), None)  # oldest not activated
                if victim is None:
                    c["staged"][li] += 1
                    continue
                del cache[victim]
                c["evicted"][li] += 1
            cache[e] = True
            c["admitted"][li] += 1
    return c


@pytest.fixture(scope="module")
def gptoss():
    return read_trace(GPT_OSS)


@pytest.fixture(scope="module")
def gptoss_subset(tmp_path_factory, gptoss):
    """Sequences 0-3 of the shipped trace (716 decode tokens), written with TraceWriter."""
    t = gptoss
    keep = t.seq_id < 4
    path = tmp_path_factory.mktemp("gptoss") / "gpt-oss-20b-seq0-3.parquet"
    with TraceWriter(path, t.model, provenance={"source": str(GPT_OSS), "command": "tests/test_sim_lru_gptoss.py"}) as w:
        w.write(seq_id=t.seq_id[keep], phase=t.phase[keep], pos=t.pos[keep], layer=t.layer[keep],
                experts=t.experts[keep], weights=t.weights[keep])
    sub = read_trace(path)
    assert sub.num_sequences == 4 and len(sub) == 716 * 24
    return sub


def run_lru(trace, slots: int, timing: bool = False, gpu_memory_gib: float = 0.0):
    memory = {"cache_init": "empty", "cache_experts": str(slots)}
    if gpu_memory_gib:
        memory["gpu_memory_gib"] = str(gpu_memory_gib)
    return simulate(trace, "gpu-lru", batch_size=1, timing=timing, overrides={"memory": memory}, profiling=WHOLE)


def check(result, ref) -> None:
    for k in FIELDS:
        assert result.per_layer[k].tolist() == ref[k].tolist(), k
        assert result.summary[k] == int(ref[k].sum()), k
    s = result.summary
    assert s["gpu_experts"] == s["activated"] and s["cpu_experts"] == 0
    assert s["transfers"] == s["on_demand"]


def test_reference_sanity(gptoss_subset):
    """Properties any correct per-layer LRU has (so the reference itself can be trusted)."""
    refs = {k: reference_lru(gptoss_subset, k) for k in (1, 4, 16, 32)}
    assert int(refs[1]["activated"].sum()) == 716 * 24 * 4
    for k, c in refs.items():
        assert (c["on_demand"] == c["activated"] - c["hits"]).all()
        assert (c["on_demand"] == c["admitted"] + c["staged"]).all()
        assert (c["admitted"] - c["evicted"] <= k).all()
    # LRU is a stack algorithm once no expert is staged (K >= top-k): more slots never lose hits
    assert (refs[4]["hits"] <= refs[16]["hits"]).all() and (refs[16]["hits"] <= refs[32]["hits"]).all()
    assert refs[4]["staged"].sum() == 0
    # with all 32 experts cached the only misses are each layer's first use of each expert
    assert refs[32]["evicted"].sum() == 0
    # K = 1 < top-k = 4: at most one admission per (step, layer)
    assert (refs[1]["admitted"] <= 716).all()


@pytest.mark.parametrize("slots", [1, 4, 16])
def test_lru_subset_matches_reference(gptoss_subset, slots):
    check(run_lru(gptoss_subset, slots), reference_lru(gptoss_subset, slots))


def test_lru_subset_timed_path_matches_reference(gptoss_subset):
    """The SimPy path takes the same decisions (and produces times)."""
    r = run_lru(gptoss_subset, 4, timing=True)
    check(r, reference_lru(gptoss_subset, 4))
    assert r.summary["makespan_s"] > 0 and r.summary["decode_s"] == r.summary["makespan_s"]


def test_lru_full_trace_k4(gptoss):
    """The whole shipped trace (12 sequences, 2,763 tokens) at 4 slots per layer."""
    ref = reference_lru(gptoss, 4)
    assert int(ref["activated"].sum()) == 2763 * 24 * 4
    check(run_lru(gptoss, 4), ref)


@pytest.mark.slow
@pytest.mark.parametrize("slots", [1, 2, 8, 16, 32])
def test_lru_full_trace_more_sizes(gptoss, slots):
    """(32 slots x 24 layers of ~50 MB experts need more than the default 24 GiB: give 64.)"""
    ref = reference_lru(gptoss, slots)
    check(run_lru(gptoss, slots, gpu_memory_gib=64 if slots > 16 else 0.0), ref)
