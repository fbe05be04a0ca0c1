"""The compiled per-layer loops (numba) give exactly what their NumPy code gives: the same values, dtypes
and orders, on random layers (dali_exec/executor/kernels.py, the online workload's segment rule and
dali-greedy's one-loop placement)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")
pytest.importorskip("torch")

from dali_exec.executor import kernels as K  # noqa: E402
from dali_exec.executor.grouped import GroupIndex  # noqa: E402
from dali_exec.executor.routing import LayerRouting  # noqa: E402
from dali_sim.models.presets import get_model  # noqa: E402
from dali_sim.policies import placement_dali as PD  # noqa: E402
from dali_sim.runtime.plan_kernel import TALLY_LEN  # noqa: E402
from dali_sim.workload import online  # noqa: E402

if K.compiled("group_routing") is None:  # (DALI_NUMBA=0: nothing compiled to compare with the NumPy code)
    pytest.skip("the compiled loops are off (DALI_NUMBA=0)", allow_module_level=True)

RNG_TRIALS = 150


def _layer(rng, *, counted: bool, order: bool):
    T, k = int(rng.integers(1, 30)), int(rng.integers(1, 5))
    E = int(rng.integers(k, 24))
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    w = rng.random((T, k)).astype(np.float32)
    mask = rng.random(T) > 0.3 if counted else None
    perm = np.argsort(ids.reshape(-1), kind="stable") if order else None
    return ids, w, mask, perm


def _same(a, b):
    assert a.dtype == b.dtype and np.array_equal(a, b), (a, b)


def test_routing_grouped_by_the_kernel_equals_the_numpy_code():
    rng = np.random.default_rng(0)
    for trial in range(RNG_TRIALS):
        ids, w, mask, perm = _layer(rng, counted=trial % 2 == 1, order=trial % 3 == 0)
        ids = ids.astype((np.int64, np.int16, np.int32, np.int16)[trial % 4])  # the ids as a trace (int16) or a model gives them
        a = LayerRouting.group(ids, w, counted=mask, order=perm)
        b = LayerRouting._group_numpy(*ids.shape, ids.reshape(-1).astype(np.int64), w, mask, perm)
        for field in ("experts", "ptr", "positions", "weights"):
            _same(getattr(a, field), getattr(b, field))
        assert (a.counted is None) == (b.counted is None)
        if a.counted is not None:
            _same(a.counted, b.counted)
        _same(a.counts(), b.counts())


def test_the_kernel_refuses_what_the_numpy_code_refuses():
    ids = np.array([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="permutation"):
        LayerRouting.group(ids, None, order=np.array([0, 0, 1, 2]))
    with pytest.raises(ValueError, match="sort the flat positions"):
        LayerRouting.group(ids, None, order=np.array([3, 2, 1, 0]))
    with pytest.raises(ValueError, match=">= 0"):
        LayerRouting.group(np.array([[0, -1]]), None)


def test_matches_partition_and_group_indices_equal_the_numpy_code(monkeypatch):
    rng = np.random.default_rng(1)
    for trial in range(RNG_TRIALS):
        ids, w, mask, _ = _layer(rng, counted=trial % 2 == 1, order=False)
        r = LayerRouting.group(ids, w, counted=mask)
        own = r.counts()
        experts, counts = r.experts[own > 0], own[own > 0]
        p = rng.permutation(len(experts))
        assert K.compiled("matches")(r.experts, own, experts[p], counts[p])
        if len(experts):
            bad = counts[p].copy()
            bad[0] += 1
            assert not K.compiled("matches")(r.experts, own, experts[p], bad)
        seg = np.sort(rng.choice(len(r.experts), int(rng.integers(1, len(r.experts) + 1)), replace=False))
        rows = rng.choice(40, len(seg), replace=False).astype(np.int64)
        a, b = _compiled_and_numpy_groups(monkeypatch, r, seg, rows)
        assert a.lo == b.lo
        _same(a.token_rows(r.top_k), b.pairs // r.top_k)
        _same(a.row_of_pairs(), np.repeat(b.rows - b.lo, b.counts))


def _compiled_and_numpy_groups(monkeypatch, r, seg, rows):
    """GroupIndex.build with the compiled kernel and with the NumPy code: (compiled, numpy), their arrays equal."""
    a = GroupIndex.build(r, seg, rows)
    with monkeypatch.context() as m:
        m.setattr(K, "compiled", lambda name: None)
        b = GroupIndex.build(r, seg, rows)
    for field in ("pairs", "weights", "rows", "experts", "counts", "table_counts", "offs"):
        _same(getattr(a, field), getattr(b, field))
    return a, b


def test_group_indices_with_a_repeated_row_equal_the_numpy_code(monkeypatch):
    """A repeated row (an error the readiness check reports): the same indices as the NumPy code's stable sort."""
    rng = np.random.default_rng(2)
    tried = 0
    for _ in range(RNG_TRIALS):
        ids, w, _, _ = _layer(rng, counted=False, order=False)
        r = LayerRouting.group(ids, w)
        if len(r.experts) < 2:
            continue
        seg = np.sort(rng.choice(len(r.experts), int(rng.integers(2, len(r.experts) + 1)), replace=False))
        rows = rng.choice(40, len(seg), replace=False).astype(np.int64)
        rows[int(rng.integers(1, len(seg)))] = rows[0]
        a, b = _compiled_and_numpy_groups(monkeypatch, r, seg, rows)
        tried += 1
    assert tried > RNG_TRIALS // 2


def test_partition_splits_a_layer_as_the_array_code(monkeypatch):
    from types import SimpleNamespace

    import torch

    from dali_exec.executor.runtime import _ROUTE_LOOSE, OffloadRuntime, _AccelLane
    from dali_exec.executor.slots import SlotPool
    from dali_exec.executor.workspace import RouteWorkspace
    from dali_sim.runtime.controller import CPU, FETCH, HIT, PREFETCHED
    rng = np.random.default_rng(2)
    entries = K.Entries("route_partition", _ROUTE_LOOSE)  # (shared: the plans' arrays contiguous or strided)

    def strided(a):  # the same values in a view with a step (read by its strides)
        return np.repeat(a, 2)[::2]

    def pool_of(experts, source):  # the hits cached, the prefetched ones in their buffers (some copies in flight)
        pool = SlotPool(np.array([30]), 30, 0, 4, torch.float32, torch.device("cpu"), num_experts=30)
        pool.admit_many(0, experts[source == HIT].astype(np.int64))
        for j, e in enumerate(experts[source == PREFETCHED].tolist()):
            pool.inflight[pool.take_prefetch(0, e).index] = j % 3 == 1
        return pool
    adoptions = declines = 0
    for trial in range(RNG_TRIALS):
        ids, w, mask, _ = _layer(rng, counted=trial % 2 == 1, order=False)
        r = LayerRouting.group(ids, w, counted=mask)
        own = r.counts()
        touch = rng.permutation(int((own > 0).sum()))
        experts = r.experts[own > 0][touch]
        source = rng.choice([HIT, FETCH, CPU, PREFETCHED], len(experts)).astype(np.int8)
        pool = pool_of(experts, source)
        plan = SimpleNamespace(layer=0, step=0, experts=experts.astype(np.int16), counts=own[own > 0][touch].astype(
            np.int32), source=source, admitted=rng.random(len(experts)) < 0.5, answer=None)
        if trial % 3 == 2:
            plan.experts, plan.counts, plan.source, plan.admitted = map(
                strided, (plan.experts, plan.counts, plan.source, plan.admitted))
        runtime = SimpleNamespace(pool=pool, _route_ws=RouteWorkspace(), _first_in_route=False, _first=None,
                                  _route_entries=entries)
        flag = trial % 4 == 1
        got = OffloadRuntime._partition(runtime, plan, r, flag)
        with monkeypatch.context() as m:
            m.setattr(K, "compiled", lambda name: None)
            want = OffloadRuntime._partition(runtime, plan, r, flag)
        splits = [(got, want)]
        if mask is None and not flag:  # the replay's call: evictions, grouping, split, adoptions and admissions
            plan.evicted = rng.choice(np.setdiff1d(np.arange(30), experts), 3, replace=False).tolist()
            if trial % 2:  # (a compiled plan's: the victims read from its answer, between its tally and what follows)
                plan.answer = np.array([-1] * (TALLY_LEN + 1) + plan.evicted + [-1, -1], np.int64)
            twin = pool_of(experts, source)
            pool.admit_many(0, np.array(plan.evicted, np.int64))
            twin.admit_many(0, np.array(plan.evicted, np.int64))
            routed, cpu_seg, split, admitted = OffloadRuntime._route(runtime, plan, ids, w)
            for field in ("experts", "ptr", "positions", "weights"):
                _same(getattr(routed, field), getattr(r, field))
            _same(routed.counts(), r.counts())
            assert admitted is not None  # (room for all)
            # the same table, free lists and lane as evict_many and _AccelLane.of's own adoptions and admit_many
            twin.evict_many(0, np.array(plan.evicted, np.int64))
            lane, order, hits, ready, fetched = split
            unset = lane.copy()  # (as _partition leaves them: the rows of the prefetched and fetched ones unknown)
            unset[2, (lane[4] == K.PREFETCHED_KIND) | (lane[4] == K.FETCHED)] = -1
            mine = _AccelLane.of(plan, pool, lane, order, hits, ready, fetched, admitted=admitted)
            theirs = _AccelLane.of(plan, twin, unset.copy(), order, hits, ready, fetched)
            _same(mine.rows, theirs.rows)
            assert mine.freed == theirs.freed and mine.prefetched_in_flight == theirs.prefetched_in_flight
            for a, b in ((pool.row_of, twin.row_of), (pool.prefetch_row, twin.prefetch_row),
                         (pool.hold_layer, twin.hold_layer), (pool.hold_expert, twin.hold_expert)):
                _same(a, b)
            assert pool.n_cached == twin.n_cached and pool.n_prefetched == twin.n_prefetched
            assert list(pool.cache_free[0]) == list(twin.cache_free[0])
            assert list(pool.prefetch_free) == list(twin.prefetch_free)
            adoptions += len(pool.prefetch_free) - 30 + int((source == PREFETCHED).sum())
            declines += len(mine.freed)
            splits.append(((cpu_seg, (unset, order, hits, ready, fetched)), want))
        for got, want in splits:
            _same(got[0], want[0])
            for a, b in zip(got[1], want[1]):
                if isinstance(a, np.ndarray):
                    _same(a, b)
                else:
                    assert a == b
    assert adoptions and declines  # (both kinds were compared)


def test_rank_order_is_the_stable_descending_sort():
    rng = np.random.default_rng(3)
    for _ in range(RNG_TRIALS):
        T, k = int(rng.integers(1, 12)), int(rng.integers(1, 9))
        ids = rng.integers(0, 64, (T, k))
        w = np.round(rng.random((T, k)), 1).astype(np.float32)  # ties
        rows = np.sort(rng.choice(T, int(rng.integers(1, T + 1)), replace=False))
        want = np.take_along_axis(ids, np.argsort(-w, axis=1, kind="stable"), 1)
        _same(K.compiled("rank_order")(ids, w, np.zeros(0, np.int64)), want)
        _same(K.compiled("rank_order")(ids, w, rows), want[rows])


def test_online_segment_rule_equals_the_numpy_code():
    wl = online.OnlineWorkload(get_model("mixtral-8x7b"))
    rng = np.random.default_rng(4)
    kernel = online._segment_kernel()
    for _ in range(RNG_TRIALS):
        T = int(rng.integers(1, 20))
        ids = np.stack([rng.choice(8, 2, replace=False) for _ in range(T)]).astype(np.int64)
        ok, experts, cnt, best, counts, ranks = kernel(ids, 8)
        assert ok
        want = wl._segment(ids, np.bincount(ids.reshape(-1), minlength=8))
        for a, b in zip((experts, cnt, best), want):
            _same(a, b)
        _same(counts, np.bincount(ids.reshape(-1), minlength=8))
        dense = np.full(8, 2, np.int64)
        dense[want[0]] = want[2]
        _same(ranks, dense)
    assert not kernel(np.array([[0, 9]]), 8)[0]


def test_dali_greedy_in_one_loop_decides_as_algorithm_1():
    kernel = PD._compiled_place()
    rng = np.random.default_rng(5)
    for trial in range(1000):
        E, n = 32, int(rng.integers(1, 20))
        experts = rng.choice(E, n, replace=False).astype(np.int16)
        counts = rng.integers(1, 6, n).astype(np.int32)
        resident, pending = rng.random(E) < 0.4, rng.random(E) < 0.2
        lut_g, lut_c = np.round(rng.random(10) * 4, 1), np.round(rng.random(10) * 4, 1)  # ties in |t_gpu - t_cpu|
        xfer, overlap, pending_resident = float(np.round(rng.random() * 3, 1)), trial % 2 == 0, trial % 5 != 0
        present = resident[experts] | (pending[experts] if pending_resident else False)
        t_gpu = np.where(present, lut_g[counts],
                         np.maximum(xfer, lut_g[counts]) if overlap else xfer + lut_g[counts])
        want = PD.greedy_assign(t_gpu, lut_c[counts], workload=counts, ids=experts)
        got = kernel(experts, counts, resident, pending, lut_g, lut_c, xfer, overlap, pending_resident)
        _same(got, want)


@pytest.mark.parametrize("system", ["dali", "gpu-lru", "ktransformers"])
def test_a_replay_without_numba_computes_and_counts_the_same(system, tmp_path, monkeypatch):
    """Where numba is missing (DALI_NUMBA=0, or a bare GPU machine) every loop above takes its NumPy code:
    the same outputs bit for bit and the same counts."""
    import torch

    from dali_exec.executor import ExecOptions, ReplayOptions, execute
    from dali_sim.sim.counters import COUNTERS
    from dali_sim.trace import read_trace
    from dali_sim.trace.synth import SynthConfig, synthesize

    path = tmp_path / "t.parquet"
    synthesize(SynthConfig(model="mixtral-8x7b", sequences=4, prompt_len=5, gen_len=5, seed=2,
                           lookahead=("residual=0.9",)), path)
    trace = read_trace(path)
    opts, run = ReplayOptions(layers=3, scale=1 / 64, dtype="fp32"), ExecOptions(device="cpu", cpu_threads=1,
                                                                                  accel_threads=1)

    def replay():
        outs = []
        result = execute(trace, system, opts, run, batch_size=3, on_layer=lambda r: outs.append(r.output.clone()))
        return result, outs

    compiled, out_c = replay()
    monkeypatch.setattr(K, "compiled", lambda name: None)
    monkeypatch.setattr(online, "_segment_kernel", lambda: None)
    monkeypatch.setattr(PD, "_compiled_place", lambda: None)
    plain, out_p = replay()
    assert {k: compiled.summary[k] for k in COUNTERS} == {k: plain.summary[k] for k in COUNTERS}
    assert len(out_c) == len(out_p) and all(torch.equal(a, b) for a, b in zip(out_c, out_p))


def _pool_state(pool):
    return (pool.row_of.copy(), pool.hold_layer.copy(), pool.hold_expert.copy(), list(pool.n_cached),
            [list(f) for f in pool.cache_free])


def test_evictions_admissions_and_swaps_in_one_loop_leave_the_table_as_the_array_code(monkeypatch):
    """``SlotPool.admit_many`` / ``evict_many`` / ``swap_many`` (compiled loops) against their NumPy code, on
    random sequences of them (including experts beyond the table's width), and the same refusals."""
    import torch

    from dali_exec.executor.slots import SlotPool

    def pools():
        return [SlotPool(np.array([6, 4]), 1, 1, 4, torch.float32, torch.device("cpu"), num_experts=8)
                for _ in range(2)]

    rng = np.random.default_rng(3)
    compiled_fn = K.compiled
    for trial in range(40):
        fast, plain = pools()
        for _ in range(12):
            layer = int(rng.integers(0, 2))
            cached = np.flatnonzero(fast.row_of[layer] >= 0)
            if len(cached) and rng.random() < 0.3:
                op, experts = "evict_many", rng.choice(cached, int(rng.integers(1, len(cached) + 1)), replace=False)
            elif len(cached) and rng.random() < 0.4:
                m = int(rng.integers(1, len(cached) + 1))
                outs = rng.choice(cached, m, replace=False).tolist()
                ins = rng.choice(np.setdiff1d(np.arange(12), cached), m, replace=False).tolist()
                got = fast.swap_many(layer, ins, outs)
                monkeypatch.setattr(K, "compiled", lambda name: None)
                _same(got, plain.swap_many(layer, ins, outs))
                monkeypatch.setattr(K, "compiled", compiled_fn)
                for a, b in zip(_pool_state(fast), _pool_state(plain)):
                    assert (a == b) if isinstance(a, list) else np.array_equal(a, b)
                continue
            else:
                free = len(fast.cache_free[layer])
                pool_ids = np.setdiff1d(np.arange(12), cached)  # ids up to 11: beyond the initial width 8
                if not free:
                    continue
                op, experts = "admit_many", rng.choice(pool_ids, int(rng.integers(1, free + 1)), replace=False)
            got = getattr(fast, op)(layer, experts)
            monkeypatch.setattr(K, "compiled", lambda name: None)
            want = getattr(plain, op)(layer, experts)
            monkeypatch.setattr(K, "compiled", compiled_fn)
            if op == "admit_many":
                _same(got, want)
            for a, b in zip(_pool_state(fast), _pool_state(plain)):
                assert (a == b) if isinstance(a, list) else np.array_equal(a, b)
    for use_kernel in (True, False):
        monkeypatch.setattr(K, "compiled", compiled_fn if use_kernel else (lambda name: None))
        pool = pools()[0]
        pool.admit_many(0, np.array([2, 5]))
        before = _pool_state(pool)
        with pytest.raises(AssertionError, match="layer 0 expert 5 is already cached"):
            pool.admit_many(0, np.array([1, 5]))
        with pytest.raises(AssertionError, match="layer 0 expert 3 is not in the slot table's cache"):
            pool.evict_many(0, np.array([2, 3]))
        with pytest.raises(AssertionError, match="all 4 cache slots are taken"):
            pool.admit_many(1, np.arange(5))
        with pytest.raises(AssertionError, match="layer 0 expert 3 is not in the slot table's cache"):
            pool.swap_many(0, [7], [3])
        with pytest.raises(AssertionError, match="layer 0 expert 2 is already cached"):
            pool.swap_many(0, [2], [5])
        for a, b in zip(_pool_state(pool), before):  # a refused change changes nothing
            assert (a == b) if isinstance(a, list) else np.array_equal(a, b)


@pytest.mark.parametrize("numba_on", [True, False])
def test_a_routing_that_is_not_the_plans_is_refused_by_both_calls(numba_on, monkeypatch):
    from types import SimpleNamespace

    import torch

    from dali_exec.executor.runtime import _ROUTE_LOOSE, OffloadRuntime, _AccelLane
    from dali_exec.executor.slots import SlotPool
    from dali_exec.executor.workspace import RouteWorkspace
    from dali_sim.runtime.controller import CPU, FETCH, HIT, PREFETCHED

    if not numba_on:
        monkeypatch.setattr(K, "compiled", lambda name: None)
    ids, w = np.array([[1, 4], [4, 2]]), np.full((2, 2), 0.5, np.float32)
    runtime = SimpleNamespace(pool=SlotPool(np.array([4]), 0, 0, 4, torch.float32, torch.device("cpu"), num_experts=8),
                              _route_ws=RouteWorkspace(), _first_in_route=False, _first=None,
                              _route_entries=K.Entries("route_partition", _ROUTE_LOOSE))
    runtime._partition = lambda *args: OffloadRuntime._partition(runtime, *args)

    def plan(experts, counts, source):
        return SimpleNamespace(layer=0, step=3, experts=np.array(experts, np.int16), counts=np.array(counts, np.int32),
                               source=np.array(source, np.int8), admitted=np.zeros(len(experts), bool), evicted=[],
                               answer=None)

    ok = plan([4, 1, 2], [2, 1, 1], [CPU] * 3)
    routed, cpu_seg, _, _ = OffloadRuntime._route(runtime, ok, ids, w)
    assert routed.experts.tolist() == [1, 2, 4] and cpu_seg.tolist() == [0, 1, 2]
    for bad in (plan([4, 1, 2], [1, 1, 1], [CPU] * 3), plan([4, 1], [2, 1], [CPU] * 2)):
        with pytest.raises(ValueError, match=r"step 3 layer 0: the routing's experts \[1, 2, 4\] with \[1, 1, 2\] "
                                             "tokens differ from the plan's"):
            OffloadRuntime._route(runtime, bad, ids, w)
        with pytest.raises(ValueError, match="differ from the plan's"):
            OffloadRuntime._partition(runtime, bad, LayerRouting.group(ids, w), False)
    with pytest.raises(AssertionError, match="layer 0 expert 4 is not in the slot table's cache"):
        OffloadRuntime._route(runtime, plan([4, 1, 2], [2, 1, 1], [HIT, CPU, CPU]), ids, w)
    with pytest.raises(ValueError, match="expert ids must be >= 0"):
        OffloadRuntime._route(runtime, ok, np.array([[1, -4], [4, 2]]), w)
    gone = plan([4, 1, 2], [2, 1, 1], [CPU] * 3)
    gone.evicted = [6]
    with pytest.raises(AssertionError, match="layer 0 expert 6 is not in the slot table's cache"):
        OffloadRuntime._route(runtime, gone, ids, w)
    # admissions the compiled call cannot make are left to SlotPool.admit_many, which refuses them
    five = plan([4, 1, 2], [2, 1, 1], [FETCH] * 3)
    five.admitted[:] = True
    runtime.pool.admit_many(0, np.array([5, 6]))
    _, _, split, admitted = OffloadRuntime._route(runtime, five, ids, w)
    assert not admitted and (runtime.pool.row_of[0] >= 0).sum() == 2
    with pytest.raises(AssertionError, match="layer 0: all 4 cache slots are taken"):
        _AccelLane.of(five, runtime.pool, *split)
    # and so are adoptions: a prefetched expert without a buffer, or none of the layer's cache rows free to exchange
    pool = SlotPool(np.array([1]), 2, 0, 4, torch.float32, torch.device("cpu"), num_experts=8)
    runtime.pool = pool
    pool.take_prefetch(0, 4)
    pre = plan([4, 1, 2], [2, 1, 1], [PREFETCHED, PREFETCHED, CPU])
    pre.admitted[:] = True
    _, _, split, admitted = OffloadRuntime._route(runtime, pre, ids, w)
    assert admitted is None and pool.prefetch_row[0, 4] >= 0  # (nothing taken)
    with pytest.raises(AssertionError, match="layer 0 expert 1 was not prefetched"):
        _AccelLane.of(pre, pool, *split)
    pool = runtime.pool = SlotPool(np.array([1]), 2, 0, 4, torch.float32, torch.device("cpu"), num_experts=8)
    for e in (4, 1):
        pool.take_prefetch(0, e)
    _, _, split, admitted = OffloadRuntime._route(runtime, pre, ids, w)
    assert admitted is None and (pool.prefetch_row[0, [1, 4]] >= 0).all() and (pool.row_of[0] < 0).all()
    with pytest.raises(AssertionError, match="layer 0: no free cache slot to exchange for a prefetch buffer"):
        _AccelLane.of(pre, pool, *split)
    pre.admitted[1] = False  # (one admitted: its buffer exchanged for the one free cache row, the other declined)
    pool = runtime.pool = SlotPool(np.array([1]), 2, 0, 4, torch.float32, torch.device("cpu"), num_experts=8)
    rows = [pool.take_prefetch(0, e).index for e in (4, 1)]
    _, _, split, admitted = OffloadRuntime._route(runtime, pre, ids, w)
    assert admitted is None if not numba_on else (admitted[0] == 1 and len(admitted[1]) == 1)
    lane = _AccelLane.of(pre, pool, *split, admitted=admitted)
    assert pool.row_of[0, 4] == rows[0] and list(pool.prefetch_free) == [0] and pool.n_prefetched == 0
    assert lane.rows[lane.freed[0]] == rows[1] and pool.n_cached == [1]


def test_entries_read_loose_arrays_by_their_strides_and_type_each_dtype_once():
    """An entry point reads its arguments as the types it was compiled for, without checking them: a strided array
    read as a contiguous one would give rows 0, 5, 1 instead of 0, 1, 2 (a wrong False). Loose arguments are
    compiled as read-only arrays of any layout, so one entry per dtype reads contiguous, strided, one-element
    and read-only arrays alike; a new dtype gets its own."""
    entries = K.Entries("rows_ready", (0, 1))
    hold_layer, hold_expert, inflight = np.zeros(8, np.int64), np.arange(8, dtype=np.int64), np.zeros(8, np.int64)
    base = np.array([0, 5, 1, 6, 2, 7], np.int64)
    frozen = base[::2].copy()
    frozen.flags.writeable = False
    fns = set()
    for rows in (base[::2][:1], base[::2].copy(), base[::2], frozen, base[::2].astype(np.int32)):
        experts = rows[::-1].copy()[::-1]  # (the same values, in a view with a negative step)
        args = (rows, experts, 0, hold_layer, hold_expert, inflight)
        fn = entries.get((rows.dtype, experts.dtype), args)
        fns.add(fn)
        assert fn(*args) is True and K._rows_ready(*args) is True
        wrong = (rows, experts + 1, 0, hold_layer, hold_expert, inflight)
        assert fn(*wrong) is False
    assert len(fns) == 2 and len(entries._by_key) == 2  # int64, int32
