"""Golden numbers of every system preset on tests/data/sim-golden.parquet (round-number profile).

The trace (rows in tests/data/make_sim_golden.py): 2 MoE layers, 5 experts, top-2; seq 0 = 3 prefill
+ 3 decode tokens, seq 1 = 2 prefill + 2 decode tokens. At batch size 1: 7 steps; touch order per
(step, layer), workloads in brackets where not all 1:

    step            0                   1      2      3      4                5      6
    layer 0   0,1,3,2 [2,2,1,1]        4,0    4,2    3,1    4,2,3 [2,1,1]    0,2    2,3
    layer 1   2,3,4   [3,2,1]          0,1    2,0    4,3    1,0,4 [2,1,1]    3,1    4,3

Profile (tests/conftest.py ``round_number_profile``): GPU expert 1 s per token, CPU expert 3 s per
token, one expert copy 2 s, dense part of a layer 0.5 s; a 24 GiB GPU, so a preset's uniform layout
holds all 5 experts of each layer unless ``memory.cache_experts`` says otherwise.

Presets that read lookahead columns (dali: ``residual``; mixtral-offloading: ``next-gate``; hybrimoe:
``next-gate``, ``gate2`` @2, ``gate3`` @3) run on :func:`write_lookahead_variant`: the same rows as the
golden trace plus hand-listed predicted logits (see :data:`RESIDUAL_TOP2`, :data:`NEXT_GATE_TOP2`).
With 2 MoE layers only layer 0's rows have a target (layer 1) for the offset-1 columns; layer 1's rows
and every row of ``gate2``/``gate3`` (targets layer 2 and 3 do not exist) are null, as the trace format
requires. Every other preset runs on the checked-in file itself.

Each preset is pinned in two variants: ``default`` (the preset as shipped) and ``small`` (a 2-slot
cache per layer via ``memory.cache_experts=2``; for the static-layers presets (llamacpp, llamacpp-best,
ktransformers), whose whole layers matched in memory would be 0 layers, ``placement.cpu_layers=1``;
cpu-only has no cache and only ``default``).

Every run evaluates the whole trace (``profiling=WHOLE``: no profiling split, the frequency choices see
the trace, as the hand derivations below assume); tests/test_profiling.py covers the split.

The pins were produced by running the code (they are regression pins), except the ones derived by
hand below: ktransformers-best and fiddler (both variants, batch 1), hybrimoe-best (default, batch 1),
the counts of mixtral-offloading (small, batch 1), hybrimoe against hybrimoe-best (default, batch 1),
and the ``default`` variant of the all-resident presets (47 s: 7 s of dense + 40 expert-token seconds
on the GPU; hybrimoe-best's schedule runs a few resident experts on the CPU and takes 43 s).
"""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest
from conftest import WHOLE, round_number_profile

from dali_sim.policies import resolve_system, system_names
from dali_sim.runtime.future import write_future
from dali_sim.sim.simulate import simulate
from dali_sim.trace import SequenceInfo, TraceWriter, read_trace
from dali_sim.trace.schema import PredictorInfo
from dali_sim.workload.builder import WorkloadConfig

DATA = Path(__file__).resolve().parent / "data"
GOLDEN_TRACE = DATA / "sim-golden.parquet"
KEYS = ("hits", "on_demand", "prefetch_issued", "prefetch_used", "swaps", "gpu_experts", "makespan_s")

# Predicted layer-1 top-2 (rank order) made at layer 0, per (seq_id, pos). The true layer-1 routing is
# (0,0) [2,3]  (0,1) [2,4]  (0,2) [3,2]  (0,3) [0,1]  (0,4) [2,0]  (0,5) [4,3]
# (1,0) [1,0]  (1,1) [1,4]  (1,2) [3,1]  (1,3) [4,3].
# residual: mostly right (one expert wrong at (0,2), (0,4), (1,2); (1,1) right set, swapped ranks)
RESIDUAL_TOP2 = {
    (0, 0): [2, 3], (0, 1): [2, 4], (0, 2): [3, 0], (0, 3): [0, 1], (0, 4): [2, 1], (0, 5): [4, 3],
    (1, 0): [1, 0], (1, 1): [4, 1], (1, 2): [3, 2], (1, 3): [4, 3],
}
# next-gate: less accurate
NEXT_GATE_TOP2 = {
    (0, 0): [2, 4], (0, 1): [2, 3], (0, 2): [3, 2], (0, 3): [1, 2], (0, 4): [0, 2], (0, 5): [4, 0],
    (1, 0): [1, 3], (1, 1): [1, 4], (1, 2): [3, 1], (1, 3): [0, 3],
}
PREDICTORS = (("residual", 1, RESIDUAL_TOP2), ("next-gate", 1, NEXT_GATE_TOP2), ("gate2", 2, None),
              ("gate3", 3, None))


def _logits(top2, num_experts: int) -> np.ndarray:
    """Logits whose top-2 is ``top2`` in order: 2.0 for rank 0, 1.0 for rank 1, 0.0 elsewhere."""
    v = np.zeros(num_experts, np.float32)
    v[top2[0]], v[top2[1]] = 2.0, 1.0
    return v


def write_lookahead_variant(path: Path) -> Path:
    """The golden trace's rows (from make_sim_golden.py) plus the hand-listed lookahead columns."""
    script = runpy.run_path(str(DATA / "make_sim_golden.py"))
    model, tokens, weights = script["GOLDEN"], script["TOKENS"], script["WEIGHTS"]
    E = model.num_experts
    null = np.full(E, np.nan, np.float32)
    infos = [PredictorInfo(name, offset, "hand-written (tests/test_preset_goldens.py)")
             for name, offset, _ in PREDICTORS]
    sequences = [SequenceInfo(0, "seq0", prompt_tokens=3, generated_tokens=3),
                 SequenceInfo(1, "seq1", prompt_tokens=2, generated_tokens=2)]
    with TraceWriter(path, model, provenance={"source": "hand-written", "command": "tests/test_preset_goldens.py"},
                     sequences=sequences, predictors=infos) as w:
        for seq_id, pos, phase, l0, l1 in tokens:
            for ordinal, experts in ((0, l0), (1, l1)):
                look = {}
                for name, offset, table in PREDICTORS:
                    has_target = table is not None and ordinal + offset < len(model.moe_layers)
                    look[name] = (_logits(table[seq_id, pos], E) if has_target else null)[None, :]
                w.write(seq_id=seq_id, phase=phase, pos=pos, layer=model.moe_layers[ordinal],
                        experts=np.array([experts]), weights=np.array([weights], np.float32), lookahead=look)
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("preset-goldens")
    plain = read_trace(GOLDEN_TRACE)
    look = read_trace(write_lookahead_variant(d / "sim-golden-lookahead.parquet"))
    return plain, look


@pytest.fixture
def profile(tmp_path, traces):
    return round_number_profile(tmp_path / "p.json", traces[0].model)


def needs_lookahead(name: str) -> bool:
    prefetch = resolve_system(name).prefetch
    return prefetch is not None and bool(prefetch.build().required_predictors())


SMALL = {"memory": {"cache_experts": "2"}}
#: the time bound ignores cache_experts; its small variant is a budget with room for 2 expert buffers beside
#: the 1776 bytes of dense weights and the KV cache (384 bytes at batch 1, 576 at batch 2): 4272 bytes
BOUND_SMALL = {"memory": {"gpu_memory_gib": repr(4272 / 2**30)}}
#: llama.cpp's and classic KTransformers' layer split: the small variant puts layer 0 on the CPU (2 slots
#: matched in memory would be 2 x 2 // 5 = 0 whole layers: every expert on the CPU, as cpu-only)
LAYER_SPLIT = {"placement": {"cpu_layers": "1"}}


def _small(name: str) -> dict:
    conf = resolve_system(name)
    if conf.time_bound:
        return BOUND_SMALL
    return LAYER_SPLIT if conf.placement.name == "static-layers" else SMALL


VARIANTS = {name: {"default": {}, **({} if name == "cpu-only" else {"small": _small(name)})} for name in system_names()}

# (preset, variant, batch) -> (hits, on_demand, prefetch_issued, prefetch_used, swaps, gpu_experts, makespan_s)
PINS = {
    ('dali-plus', 'default', 1): (33, 0, 0, 0, 0, 29, 43.0),
    ('dali-plus', 'default', 2): (27, 0, 0, 0, 0, 21, 36.0),
    ('dali-plus', 'small', 1): (10, 12, 10, 8, 4, 28, 69.0),
    ('dali-plus', 'small', 2): (11, 7, 8, 5, 2, 21, 45.0),
    # the oracle preset renamed oracle-heuristic (it reads the future but is not a bound: hybrimoe and
    # dali beat it elsewhere); the same policies, so the same numbers
    ('oracle-heuristic', 'default', 1): (33, 0, 0, 0, 0, 29, 43.0),
    ('oracle-heuristic', 'default', 2): (27, 0, 0, 0, 0, 21, 36.0),
    ('oracle-heuristic', 'small', 1): (16, 3, 9, 8, 0, 25, 51.5),  # belady's tie-break by later uses
    ('oracle-heuristic', 'small', 2): (12, 4, 7, 6, 0, 20, 39.0),
    # the time bound: makespan only (its counters do not apply). default: derived by hand in
    # tests/test_lower_bound.py (43 s, hybrimoe's time; 36 s at batch 2, dali's); small (2 expert buffers):
    # the copies the two buffers cannot avoid add 0.33 s at batch 1
    ('lower-bound', 'default', 1): (None,) * 6 + (43.0,),
    ('lower-bound', 'default', 2): (None,) * 6 + (36.0,),
    ('lower-bound', 'small', 1): (None,) * 6 + (43.33,),
    ('lower-bound', 'small', 2): (None,) * 6 + (36.0,),
    ('cpu-only', 'default', 1): (0, 0, 0, 0, 0, 0, 127.0),
    ('cpu-only', 'default', 2): (0, 0, 0, 0, 0, 0, 124.0),
    ('dali', 'default', 1): (33, 0, 0, 0, 0, 29, 43.0),
    ('dali', 'default', 2): (27, 0, 0, 0, 0, 21, 36.0),
    ('dali', 'small', 1): (10, 12, 10, 8, 4, 28, 69.0),
    ('dali', 'small', 2): (11, 7, 8, 5, 2, 21, 45.0),
    ('fiddler', 'default', 1): (33, 0, 0, 0, 0, 33, 47.0),
    ('fiddler', 'default', 2): (27, 0, 0, 0, 0, 27, 44.0),
    # fiddler small: ties (t_gpu + copy == t_cpu: 1 + 2 == 3 at one token) now go to the GPU, as in the
    # code (efeslab/fiddler), so every missing expert is copied (by hand: test_fiddler_small_batch1_by_hand);
    # was (15, 3, 0, 0, 0, 18, 61.0) and (11, 5, 0, 0, 0, 16, 53.0) when ties stayed on the CPU
    ('fiddler', 'small', 1): (15, 18, 0, 0, 0, 33, 61.0),
    ('fiddler', 'small', 2): (11, 16, 0, 0, 0, 27, 52.0),
    # fiddler-best differs from fiddler in its implementation only (pinned, overlapping lanes); a measured
    # profile times every system as dali's executor (implementation_for), so the pins are fiddler's
    ('fiddler-best', 'default', 1): (33, 0, 0, 0, 0, 33, 47.0),
    ('fiddler-best', 'default', 2): (27, 0, 0, 0, 0, 27, 44.0),
    ('fiddler-best', 'small', 1): (15, 18, 0, 0, 0, 33, 61.0),
    ('fiddler-best', 'small', 2): (11, 16, 0, 0, 0, 27, 52.0),
    ('gpu-lfu', 'default', 1): (23, 10, 0, 0, 0, 33, 56.0),
    ('gpu-lfu', 'default', 2): (17, 10, 0, 0, 0, 27, 48.0),
    ('gpu-lfu', 'small', 1): (8, 25, 0, 0, 0, 33, 72.0),
    ('gpu-lfu', 'small', 2): (4, 23, 0, 0, 0, 27, 60.0),
    ('gpu-lru', 'default', 1): (23, 10, 0, 0, 0, 33, 56.0),
    ('gpu-lru', 'default', 2): (17, 10, 0, 0, 0, 27, 48.0),
    ('gpu-lru', 'small', 1): (8, 25, 0, 0, 0, 33, 72.0),
    ('gpu-lru', 'small', 2): (4, 23, 0, 0, 0, 27, 60.0),
    ('gpu-static', 'default', 1): (33, 0, 0, 0, 0, 33, 47.0),
    ('gpu-static', 'default', 2): (27, 0, 0, 0, 0, 27, 44.0),
    ('gpu-static', 'small', 1): (15, 18, 0, 0, 0, 33, 61.0),
    ('gpu-static', 'small', 2): (11, 16, 0, 0, 0, 27, 52.0),
    # hybrimoe now runs the released code's HSS schedule (placement.mode=hss, was best) and its cache does
    # not evict in prefill (cache.prefill_evicts=false). default (all resident): HSS lets the CPU take the
    # tail of a layer when the GPU would end later (by hand in test_hybrimoe_default_batch1_by_hand): 47 -> 43 s
    # at batch 1 (was (33, 0, 0, 0, 0, 33, 47.0)), 44 -> 37 s at batch 2 (was (27, 0, 0, 0, 0, 27, 44.0)).
    # small: HSS sends ties to the GPU, so in batch-1 decode a missing expert beside a cached one
    # (GPU max(1, 0 + 2) + 1 = 3 s vs CPU 3 s) is copied where `best` kept it on the CPU (fewer copies on
    # ties): on_demand 6 -> 10 at batch 1, 6 -> 8 at batch 2; at step 0 layer 1 (prefill) the prefetched
    # expert 2 is used from its buffer instead of evicting expert 1; hits 16 -> 13 at batch 1.
    # Were (16, 6, 2, 2, 0, 24, 54.0) and (11, 6, 1, 1, 0, 18, 41.0).
    # That preset is now hybrimoe-best (the same numbers); hybrimoe is the released code's reading
    # (test_hybrimoe_paper_runs_multi_token_steps_on_the_gpu): the HSS schedule only for one-token steps, so
    # the prefill steps 0 and 4 (and every batch-2 step but the last decode ones, which hold 2 tokens) run all
    # on the GPU: default = the all-resident all-GPU time, 47 s and 44 s (by hand in test_all_resident_default_by_hand).
    # small: lowest-ids start {0, 1}, eviction in prefill, prefetch with any gain (min_gain 0): regression pins.
    ('hybrimoe', 'default', 1): (33, 0, 0, 0, 0, 33, 47.0),
    ('hybrimoe', 'default', 2): (27, 0, 0, 0, 0, 27, 44.0),
    ('hybrimoe', 'small', 1): (11, 15, 4, 3, 0, 29, 60.0),
    ('hybrimoe', 'small', 2): (9, 15, 2, 2, 0, 26, 52.5),
    ('hybrimoe-best', 'default', 1): (33, 0, 0, 0, 0, 29, 43.0),
    ('hybrimoe-best', 'default', 2): (27, 0, 0, 0, 0, 21, 37.0),
    ('hybrimoe-best', 'small', 1): (13, 10, 2, 2, 0, 24, 52.5),
    ('hybrimoe-best', 'small', 2): (11, 8, 1, 1, 0, 20, 41.0),
    # ktransformers is now the DALI paper's reading: whole layers matched in memory, the static-layers split
    # of llamacpp (the same plans; its small variant is llamacpp's, cpu_layers=1, because 2 slots matched in
    # memory are 2 x 2 // 5 = 0 whole layers); the per-layer preset it was is ktransformers-best (the same
    # numbers as before: the frequency sets {0, 2} and {1, 3}, test_ktransformers_small_batch1_by_hand)
    ('ktransformers', 'default', 1): (33, 0, 0, 0, 0, 33, 47.0),
    ('ktransformers', 'default', 2): (27, 0, 0, 0, 0, 27, 44.0),
    ('ktransformers', 'small', 1): (16, 0, 0, 0, 0, 16, 87.0),
    ('ktransformers', 'small', 2): (14, 0, 0, 0, 0, 14, 84.0),
    ('ktransformers-best', 'default', 1): (33, 0, 0, 0, 0, 33, 47.0),
    ('ktransformers-best', 'default', 2): (27, 0, 0, 0, 0, 27, 44.0),
    ('ktransformers-best', 'small', 1): (15, 0, 0, 0, 0, 15, 77.0),
    ('ktransformers-best', 'small', 2): (11, 0, 0, 0, 0, 11, 70.0),
    ('llamacpp', 'default', 1): (33, 0, 0, 0, 0, 33, 47.0),
    ('llamacpp', 'default', 2): (27, 0, 0, 0, 0, 27, 44.0),
    ('llamacpp', 'small', 1): (16, 0, 0, 0, 0, 16, 87.0),
    ('llamacpp', 'small', 2): (14, 0, 0, 0, 0, 14, 84.0),
    # llamacpp-best differs in its implementation only (pinned host weights): llamacpp's pins here
    ('llamacpp-best', 'default', 1): (33, 0, 0, 0, 0, 33, 47.0),
    ('llamacpp-best', 'default', 2): (27, 0, 0, 0, 0, 27, 44.0),
    ('llamacpp-best', 'small', 1): (16, 0, 0, 0, 0, 16, 87.0),
    ('llamacpp-best', 'small', 2): (14, 0, 0, 0, 0, 14, 84.0),
    # mixtral-offloading is now its released code (no prefetch, the highest ids resident at the start: with 5
    # slots all of them, so default = the all-resident time, 47 / 44 s); small by hand for the counts in
    # test_mixtral_offloading_small_batch1_by_hand. The preset with the tech report's prefetch it was is
    # mixtral-offloading-best (the same numbers as before)
    ('mixtral-offloading', 'default', 1): (33, 0, 0, 0, 0, 33, 47.0),
    ('mixtral-offloading', 'default', 2): (27, 0, 0, 0, 0, 27, 44.0),
    ('mixtral-offloading', 'small', 1): (11, 22, 0, 0, 0, 33, 68.0),
    ('mixtral-offloading', 'small', 2): (9, 18, 0, 0, 0, 27, 54.0),
    ('mixtral-offloading-best', 'default', 1): (23, 6, 4, 4, 0, 33, 55.0),
    ('mixtral-offloading-best', 'default', 2): (17, 6, 4, 4, 0, 27, 47.5),
    ('mixtral-offloading-best', 'small', 1): (8, 17, 9, 8, 0, 33, 73.5),
    ('mixtral-offloading-best', 'small', 2): (4, 15, 8, 8, 0, 27, 58.0),
    # moe-lightning is now the DALI paper's reading (whole layers matched in memory, the rest streamed):
    # default holds both layers whole (the all-resident time); small (2 slots = 0 whole layers) streams
    # everything: exactly the numbers of the former wg = 0 preset's default, (0, 17, 35, 16, 0, 33, 109.0)
    # and (0, 13, 20, 14, 0, 27, 72.5). moe-lightning-best keeps each layer's most frequent experts
    # (static, the sets of ktransformers-best: 15 hits at batch 1) and streams the others
    # link-budget (ours): HybriMoE's schedule with the link-budget cache. default (all resident): no outsider
    # to swap in, nothing to fetch, so hybrimoe-best's schedule and time (43 s, 37 s; derived by hand there);
    # small: regression pins (the profile's most frequent experts to start, swaps paid from idle link time)
    ('link-budget', 'default', 1): (33, 0, 0, 0, 0, 29, 43.0),
    ('link-budget', 'default', 2): (27, 0, 0, 0, 0, 21, 37.0),
    ('link-budget', 'small', 1): (14, 13, 0, 0, 0, 27, 54.0),
    ('link-budget', 'small', 2): (11, 9, 0, 0, 0, 20, 41.0),
    ('moe-lightning', 'default', 1): (33, 0, 0, 0, 0, 33, 47.0),
    ('moe-lightning', 'default', 2): (27, 0, 0, 0, 0, 27, 44.0),
    ('moe-lightning', 'small', 1): (0, 17, 35, 16, 0, 33, 109.0),
    ('moe-lightning', 'small', 2): (0, 13, 20, 14, 0, 27, 72.5),
    ('moe-lightning-best', 'default', 1): (33, 0, 0, 0, 0, 33, 47.0),
    ('moe-lightning-best', 'default', 2): (27, 0, 0, 0, 0, 27, 44.0),
    ('moe-lightning-best', 'small', 1): (15, 9, 21, 9, 0, 33, 67.0),
    ('moe-lightning-best', 'small', 2): (11, 8, 12, 8, 0, 27, 54.5),
}


def test_lookahead_variant_has_the_golden_routing(traces):
    plain, look = traces
    assert look.model == plain.model
    for col in ("seq_id", "pos", "layer", "phase", "experts"):
        assert np.array_equal(getattr(look, col), getattr(plain, col)), col
    assert sorted(look.meta.predictors) == ["gate2", "gate3", "next-gate", "residual"]


def test_every_preset_is_pinned():
    want = {(name, v, b) for name in system_names() for v in VARIANTS[name] for b in (1, 2)}
    assert want == set(PINS), f"unpinned: {sorted(want - set(PINS))}; stale: {sorted(set(PINS) - want)}"


@pytest.mark.parametrize("key", sorted(PINS), ids=lambda k: f"{k[0]}-{k[1]}-b{k[2]}")
def test_preset_golden(traces, profile, key, tmp_path):
    name, variant, batch = key
    trace = traces[1] if needs_lookahead(name) else traces[0]
    future = None  # next-use times for presets with a Belady cache, written where the test may write
    if resolve_system(name).needs_future:
        future = write_future(trace, WorkloadConfig(batch), tmp_path / "next-uses.parquet", share=0.0)
    r = simulate(trace, name, hardware=profile, batch_size=batch, overrides=VARIANTS[name][variant], future=future,
                 profiling=WHOLE)
    s = r.summary
    *ints, makespan = PINS[key]
    if resolve_system(name).time_bound:
        assert s["makespan_s"] == pytest.approx(makespan, rel=1e-9)
        assert all(np.isnan(s[k]) for k in KEYS[:-1])
        return
    assert tuple(int(s[k]) for k in KEYS[:-1]) == tuple(ints)
    assert s["makespan_s"] == pytest.approx(makespan, rel=1e-9)
    # the no-timing replay makes the same decisions
    counted = simulate(trace, name, hardware=profile, batch_size=batch, overrides=VARIANTS[name][variant],
                       timing=False, future=future, profiling=WHOLE).summary
    assert tuple(int(counted[k]) for k in KEYS[:-1]) == tuple(ints)


def test_presets_without_lookahead_agree_on_both_traces(traces, profile):
    """The lookahead variant differs from the golden trace only in its predictor columns."""
    for name in ("gpu-lru", "fiddler"):
        a = simulate(traces[0], name, hardware=profile, overrides=SMALL, profiling=WHOLE).summary
        b = simulate(traces[1], name, hardware=profile, overrides=SMALL, profiling=WHOLE).summary
        assert [a[k] for k in KEYS] == [b[k] for k in KEYS]


def test_ktransformers_small_batch1_by_hand(traces, profile):
    """ktransformers-best, 2 slots, batch 1: static cache of the most frequent experts (frequency init;
    totals layer 0 [4,3,5,4,4] -> {2, 0} (ties at 4 by lower id), layer 1 [3,4,4,5,4] -> {3, 1}).
    resident-gpu: a resident expert runs on the GPU, every other on the CPU; nothing is copied.
    Hits = GPU experts: layer 0: e0 at steps 0,1,5 and e2 at 0,2,4,5,6 -> 8; layer 1: e1 at 1,4,5 and
    e3 at 0,3,5,6 -> 7; 15 in all; on_demand 0.
    Per layer: 0.5 dense, then GPU (1 s/token) and CPU (3 s/token) in parallel: max(GPU sum, CPU sum).
      layer 0: s0 GPU 0[2]+2[1]=3, CPU 1[2]+3[1]=9 -> 9;  s1 GPU 0 1, CPU 4 3 -> 3;  s2 GPU 2 1, CPU 4 3 -> 3
               s3 CPU 3,1 -> 6;  s4 GPU 2 1, CPU 4[2]+3 = 9 -> 9;  s5 GPU 0,2 -> 2;  s6 GPU 2 1, CPU 3 3 -> 3
               sum 35
      layer 1: s0 GPU 3[2] 2, CPU 2[3]+4[1] = 12 -> 12;  s1 GPU 1 1, CPU 0 3 -> 3;  s2 CPU 2,0 -> 6
               s3 GPU 3 1, CPU 4 3 -> 3;  s4 GPU 1[2] 2, CPU 0,4 6 -> 6;  s5 GPU 3,1 -> 2;  s6 -> 3
               sum 35
    makespan = 14 x 0.5 + 35 + 35 = 77 s."""
    r = simulate(traces[0], "ktransformers-best", hardware=profile, overrides=SMALL, profiling=WHOLE)
    assert r.per_layer["hits"].tolist() == [8, 7]
    assert PINS[("ktransformers-best", "small", 1)] == (15, 0, 0, 0, 0, 15, 77.0)
    assert tuple(r.summary[k] for k in KEYS) == (15, 0, 0, 0, 0, 15, 77.0)


def test_fiddler_small_batch1_by_hand(traces, profile):
    """fiddler, 2 slots, batch 1: the same static sets as ktransformers ({0,2} and {1,3}). A missing
    expert of workload n goes to the GPU iff n + 2 <= 3n (GPU + copy no more than CPU; ties to the GPU,
    as Fiddler's code), i.e. always (n >= 1): every miss is copied on demand and staged (static never
    admits): 33 activations - 15 hits = 18 copies, 33 GPU experts.
    Per layer after the 0.5 s dense part: hits present at once, copies back to back (2 s each, touch
    order); the GPU runs the hits, then each copied expert once it has landed.
      layer 0: s0 hits 0[2],2[1] (3), copies 1[2] at 2 and 3[1] at 4: 3+2 = 5, max(5, 4)+1 = 6
               s1 hit 0 (1), copy 4 at 2: 3;  s2 hit 2, copy 4: 3;  s3 copies 3 at 2, 1 at 4: 3, 5
               s4 hit 2 (1), copies 4[2] at 2, 3 at 4: 4, 5;  s5 hits 0,2: 2;  s6 hit 2, copy 3: 3
               sum 6+3+3+5+5+2+3 = 27
      layer 1: s0 hit 3[2] (2), copies 2[3] at 2, 4 at 4: 5, 6;  s1 hit 1, copy 0: 3
               s2 copies 2 at 2, 0 at 4: 3, 5;  s3 hit 3, copy 4: 3;  s4 hit 1[2] (2), copies 0 at 2, 4 at 4:
               3, 5;  s5 hits 3,1: 2;  s6 hit 3, copy 4: 3;  sum 6+3+5+3+5+2+3 = 27
    makespan = 14 x 0.5 + 27 + 27 = 61 s (the same as with ties on the CPU, where 3 copies were made:
    at one token the CPU's 3 s equal the GPU's copy + compute)."""
    r = simulate(traces[0], "fiddler", hardware=profile, overrides=SMALL, profiling=WHOLE)
    s = r.summary
    assert (s["staged"], s["admitted"], s["evicted"]) == (18, 0, 0)
    assert PINS[("fiddler", "small", 1)] == (15, 18, 0, 0, 0, 33, 61.0)
    assert tuple(s[k] for k in KEYS) == (15, 18, 0, 0, 0, 33, 61.0)
    assert r.per_step["time_s"].tolist() == [13.0, 7.0, 9.0, 9.0, 11.0, 5.0, 7.0]


def test_hybrimoe_default_batch1_by_hand(traces, profile):
    """hybrimoe-best, default memory (all 5 experts of both layers resident), batch 1. HSS lists the cached
    experts by descending load; the GPU takes the head, the CPU the tail, whichever ends no later (the
    GPU on ties). Decode (two 1-token experts): GPU 1 <= CPU 3, GPU 2 <= CPU 3: both on the GPU (2 s).
      step 0 layer 0, loads 0[2],1[2],3[1],2[1]: GPU 0 (2) <= CPU 2 (3); GPU 1 (4) > CPU 3: the CPU takes
        2 (3); GPU 1 (4) <= CPU 3 (6); GPU 3 (5) <= CPU (3 + 3 = 6): GPU 5, CPU 3 -> 5 (6 on the GPU alone)
      step 0 layer 1, 2[3],3[2],4[1]: GPU 2 (3) <= CPU 4 (3); GPU 3 (5) > 3: the CPU takes 4;
        GPU 3 (5) <= CPU 3 + 6: -> 5 (6 alone)
      step 4 layer 0, 4[2],2,3: GPU 4 (2) <= 3; GPU 2 (3) <= 3; GPU 3 (4) > 3: CPU -> 3 (4 alone);
        layer 1, 1[2],0,4: the same, 3 (4 alone)
    Against all-GPU (47 s): 4 s saved, 4 resident experts on the CPU: 43 s, 29 GPU experts, 33 hits."""
    r = simulate(traces[1], "hybrimoe-best", hardware=profile, profiling=WHOLE)
    assert r.manifest["memory"]["cache_slots_per_layer"] == [5, 5]
    assert PINS[("hybrimoe-best", "default", 1)] == (33, 0, 0, 0, 0, 29, 43.0)
    assert tuple(r.summary[k] for k in KEYS) == (33, 0, 0, 0, 0, 29, 43.0)
    assert r.summary["cpu_experts"] == 4


@pytest.mark.parametrize("name", ["ktransformers", "ktransformers-best", "fiddler", "hybrimoe", "mixtral-offloading",
                                  "moe-lightning"])
def test_all_resident_default_by_hand(traces, profile, name):
    """Default memory: the 24 GiB budget holds all 5 experts of both layers (the initial contents fill
    them: frequency, lowest or highest ids alike), so every activated expert is a GPU hit: 33 at batch 1;
    hybrimoe (the released code's reading) runs its two prefill steps (multi-token) all on the GPU and
    its decode steps' two 1-token experts on the GPU too (1 s + 1 s <= 3 s on the CPU). Time: 14 dense parts x 0.5 s +
    40 expert-token pairs (10 tokens x top-2 x 2 layers) x 1 s on the GPU = 47 s."""
    r = simulate(traces[1] if needs_lookahead(name) else traces[0], name, hardware=profile, profiling=WHOLE)
    assert r.manifest["memory"]["cache_slots_per_layer"] == [5, 5]
    assert PINS[(name, "default", 1)] == (33, 0, 0, 0, 0, 33, 47.0)
    assert tuple(r.summary[k] for k in KEYS) == (33, 0, 0, 0, 0, 33, 47.0)


def test_hybrimoe_paper_runs_multi_token_steps_on_the_gpu(traces, profile):
    """The released code's HSS only for one-token steps: at batch 1 the golden trace's multi-token steps are
    the prefills 0 and 4, where hybrimoe-best's HSS put 4 resident experts on the CPU (by hand in
    test_hybrimoe_default_batch1_by_hand); the paper reading runs them on the GPU: 4 more GPU experts, and
    those steps take their all-GPU times (6 + 6 s at step 0, 4 + 4 s at step 4, plus 1 s of dense parts)."""
    best = simulate(traces[1], "hybrimoe-best", hardware=profile, profiling=WHOLE)
    paper = simulate(traces[1], "hybrimoe", hardware=profile, profiling=WHOLE)
    assert paper.summary["gpu_experts"] - best.summary["gpu_experts"] == 4 and paper.summary["cpu_experts"] == 0
    assert paper.per_step["time_s"].tolist()[0] == 13.0 and paper.per_step["time_s"].tolist()[4] == 9.0
    assert best.per_step["time_s"].tolist()[0] == 11.0 and best.per_step["time_s"].tolist()[4] == 7.0
    decode = paper.per_step["phase"] == "decode"
    assert paper.per_step["time_s"][decode].tolist() == best.per_step["time_s"][decode].tolist()


def test_mixtral_offloading_small_batch1_by_hand(traces, profile):
    """mixtral-offloading as released, 2 slots, batch 1: LRU starting with the highest ids {3, 4} (initial
    entries older than any touch, the lower id older), always admitting, a victim only among entries not
    activated in the step. Per (step, layer): start -> hits, (miss: victim) -> end.
      layer 0: s0 {3,4} 0,1,3,2: hit 3; 0 evicts 4; 1 and 2 staged (3 and 0 are in use) -> {3,0}
               s1 4,0: hit 0; 4 evicts 3 -> {0,4};  s2 4,2: hit 4; 2 evicts 0 -> {4,2}
               s3 3,1: 3 evicts 4 (touched before 2 in s2), 1 evicts 2 -> {3,1};  s4 4,2,3: hit 3; 4 evicts 1;
               2 staged -> {3,4};  s5 0,2: 0 evicts 4 (touched before 3 in s4), 2 evicts 3 -> {0,2}
               s6 2,3: hit 2; 3 evicts 0: hits 5, copies 12
      layer 1: s0 {3,4} 2,3,4: hits 3, 4; 2 staged;  s1 0,1: 0 evicts 3, 1 evicts 4 -> {0,1}
               s2 2,0: hit 0; 2 evicts 1;  s3 4,3: 4 evicts 2, 3 evicts 0 -> {4,3}
               s4 1,0,4: hit 4; 1 evicts 3; 0 staged -> {4,1};  s5 3,1: hit 1; 3 evicts 4
               s6 4,3: hit 3; 4 evicts 1: hits 6, copies 10
    In all 11 hits and 22 copies (no prefetch: the released code has none), 5 of them staged (layer 0: 1, 2
    at s0 and 2 at s4; layer 1: 2 at s0 and 0 at s4), every expert on the GPU."""
    r = simulate(traces[0], "mixtral-offloading", hardware=profile, overrides=SMALL, profiling=WHOLE)
    assert r.per_layer["hits"].tolist() == [5, 6] and r.per_layer["on_demand"].tolist() == [12, 10]
    assert tuple(r.summary[k] for k in KEYS[:-1]) == PINS[("mixtral-offloading", "small", 1)][:-1]
    assert r.summary["staged"] == 5
