"""The runtime's preallocated workspaces (dali_exec/executor/workspace.py) change nothing: a replay that writes
its routing split and group indices into them computes, counts and records exactly what the NumPy code (no
workspace, new arrays everywhere) does, for every preset; what the route's compiled call writes beyond the
split (token rows, staging turns' slices) is what the arrays give; the buffers grow when a layer needs more."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("numba")
torch = pytest.importorskip("torch")

from dali_exec.executor import ExecOptions, ReplayOptions, execute  # noqa: E402
from dali_exec.executor import kernels as K  # noqa: E402
from dali_exec.executor.devices import Devices  # noqa: E402
from dali_exec.executor.grouped import GroupIndex  # noqa: E402
from dali_exec.executor.routing import LayerRouting  # noqa: E402
from dali_exec.executor.runtime import _ROUTE_LOOSE, OffloadRuntime, _device_indices  # noqa: E402
from dali_exec.executor.slots import SlotPool  # noqa: E402
from dali_exec.executor.store import HostExpertStore  # noqa: E402
from dali_exec.executor.workspace import GroupWorkspace, RouteWorkspace  # noqa: E402
from dali_sim.models.presets import get_model  # noqa: E402
from dali_sim.models.scaled import scale_model  # noqa: E402
from dali_sim.policies import placement_dali as PD  # noqa: E402
from dali_sim.policies import system_names  # noqa: E402
from dali_sim.runtime.controller import CPU, FETCH, HIT, PREFETCHED  # noqa: E402
from dali_sim.sim.counters import COUNTERS  # noqa: E402
from dali_sim.trace import read_trace  # noqa: E402
from dali_sim.trace.synth import SynthConfig, synthesize  # noqa: E402
from dali_sim.workload import online  # noqa: E402

RUN = ExecOptions(device="cpu", cpu_threads=1, accel_threads=1)
#: systems whose groups depend on when a background prefetch lands (a landed one joins the first group)
PREFETCHING = {"dali", "dali-plus", "hybrimoe", "hybrimoe-best", "mixtral-offloading", "mixtral-offloading-best",
               "moe-lightning", "moe-lightning-best", "oracle-heuristic", "link-budget"}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """A Mixtral-shaped trace (prefill + decode, top-2 of 8) and a Qwen3-shaped one (decode, top-8 of 128:
    many staged experts, single staging turns)."""
    tmp = tmp_path_factory.mktemp("ws")
    look = ("residual=0.9", "next-gate=0.7", "gate2=0.6@2", "gate3=0.5@3")
    synthesize(SynthConfig(model="mixtral-8x7b", sequences=3, prompt_len=6, gen_len=6, seed=5, lookahead=look),
               tmp / "mix.parquet")
    synthesize(SynthConfig(model="qwen3-30b-a3b", sequences=8, prompt_len=0, gen_len=4, seed=1, lookahead=look),
               tmp / "qwen.parquet")
    return {"mix": (read_trace(tmp / "mix.parquet"), ReplayOptions(layers=4, scale=1 / 64, dtype="fp32"), 2),
            "qwen": (read_trace(tmp / "qwen.parquet"),
                     ReplayOptions(layers=3, scale=1 / 32, dtype="fp32", precision="bf16"), 6)}


def _replay(trace, system, opts, batch):
    outs = []
    result = execute(trace, system, opts, RUN, batch_size=batch, on_layer=lambda r: outs.append(r.output.clone()))
    intervals = sorted((iv.track, iv.name, tuple(sorted((k, str(v)) for k, v in iv.args.items())))
                       for iv in result.intervals)
    return result, outs, intervals


@pytest.mark.parametrize("shape", ["mix", "qwen"])
@pytest.mark.parametrize("system", [s for s in system_names() if s != "lower-bound"])
def test_a_replay_through_the_workspaces_equals_the_numpy_code(traces, shape, system, monkeypatch):
    """Outputs bit for bit, counters, grouped calls and every interval's track, name and arguments (a group's
    size aside where a prefetch's landing time decides it)."""
    trace, opts, batch = traces[shape]
    result, outs, intervals = _replay(trace, system, opts, batch)
    with monkeypatch.context() as m:
        m.setattr(K, "compiled", lambda name: None)
        m.setattr(online, "_segment_kernel", lambda: None)
        m.setattr(PD, "_compiled_place", lambda: None)
        plain, plain_outs, plain_intervals = _replay(trace, system, opts, batch)
    assert len(outs) == len(plain_outs) and all(torch.equal(a, b) for a, b in zip(outs, plain_outs))
    assert {k: result.summary[k] for k in COUNTERS} == {k: plain.summary[k] for k in COUNTERS}
    if system in PREFETCHING:
        def strip(ivs):
            return sorted((t, n, tuple(a for a in args if a[0] != "group")) for t, n, args in ivs)
        intervals, plain_intervals = strip(intervals), strip(plain_intervals)
    else:
        assert result.summary["executor"]["grouped_calls"] == plain.summary["executor"]["grouped_calls"]
    assert intervals == plain_intervals


def _runtime(capacity=30, experts=30, staging=0, prefetch=0):
    pool = SlotPool(np.array([capacity]), prefetch, staging, 4, torch.float32, torch.device("cpu"), num_experts=experts)
    return SimpleNamespace(pool=pool, _route_ws=RouteWorkspace(), _ws_routing=None,
                           _group_ws=GroupWorkspace(len(pool.slots), torch.device("cpu")), _first_in_route=True,
                           _first=None, _route_entries=K.Entries("route_partition", _ROUTE_LOOSE))


def test_the_route_call_writes_token_rows_and_staging_slices_as_the_arrays_give():
    if K.compiled("route_partition") is None:
        pytest.skip("the route call is compiled code (numba)")
    rng = np.random.default_rng(7)
    staged_groups = prefetched_groups = staged_heads = singles = settled_heads = held_heads = 0
    for trial in range(60):
        T, k, E = int(rng.integers(1, 30)), int(rng.integers(1, 5)), 24
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
        w = rng.random((T, k)).astype(np.float32)
        r = LayerRouting.group(ids, w)
        touch = rng.permutation(len(r.experts))
        experts = r.experts[touch]
        # a third of the trials stage every accelerator expert: with a staging buffer for each, the route call gives
        # them the first free ones and writes their group
        staged_only = trial % 3 == 0
        kinds = [FETCH, CPU] if staged_only else [HIT, FETCH, CPU] + [PREFETCHED] * (trial % 3 == 1)
        source = rng.choice(kinds, len(experts)).astype(np.int8)
        runtime = _runtime(staging=int(rng.integers(0, 30 if staged_only else 8)), prefetch=len(experts))
        pool = runtime.pool
        pool.admit_many(0, experts[source == HIT].astype(np.int64))
        for e in experts[source == PREFETCHED].tolist():  # (landed: the group is written with their buffers' rows)
            pool.take_prefetch(0, e)
        admitted = (source == FETCH) & (rng.random(len(experts)) < (0 if staged_only else 0.5))
        plan = SimpleNamespace(layer=0, step=0, experts=experts.astype(np.int16), counts=r.counts()[touch],
                               source=source, admitted=admitted, evicted=[])
        buffers = pool.prefetch_row[0].copy()
        routed, _, split, _ = OffloadRuntime._route(runtime, plan, ids, w)
        assert runtime._ws_routing is routed
        wi = runtime._route_ws.wi
        n = T * k
        assert np.array_equal(wi[K.W_TOKENS, :n], routed.positions // k)
        lane, order, hits, ready, fetched = split
        staged = order[ready + fetched:]
        seg = lane[1, staged]
        assert np.array_equal(wi[K.W_TURNS:K.W_TURNS + 2, :len(staged)],
                              np.stack([lane[3, staged], r.ptr[seg + 1] - r.ptr[seg]]))
        # the staged experts' pairs in staging order: positions, tokens, weights (the turns' gather and scatter)
        sel = np.concatenate([np.arange(r.ptr[s], r.ptr[s + 1]) for s in seg] + [np.zeros(0, np.int64)])
        q = len(sel)
        assert np.array_equal(wi[K.W_TURNS + 2, :q], r.positions[sel])
        assert np.array_equal(wi[K.W_TURNS + 3, :q], r.positions[sel] // k)
        assert np.array_equal(runtime._route_ws.wf[1, :q], r.weights[sel])
        assert [a.tolist() for a in runtime._route_ws.turn_arrays(q)] == \
            [r.positions[sel].tolist(), (r.positions[sel] // k).tolist(), r.weights[sel].tolist()]
        # the first group (hits, prefetched experts in their buffers and admitted fetches), written when it has two
        # experts or more; else, with only staged experts and a buffer for each, theirs, in the first free buffers,
        # which hold them
        pre = order[:ready][lane[4, order[:ready]] == K.PREFETCHED_KIND]
        assert len(pre) == ready - hits
        assert np.array_equal(lane[2, pre], buffers[lane[3, pre]]) and (lane[2, pre] >= 0).all()
        assert (pool.prefetch_row[0, lane[3, pre]] == -1).all()  # (taken from their buffers)
        first = order[:ready + fetched]
        staged_group = not len(first) and 0 < len(staged) <= pool.num_staging
        staged_groups += staged_group
        # the staging schedule's start (_accelerator_lane's rule): the first turns' experts hold the first free
        # staging buffers, the rest none; the lane's first copies (fetched and those, ascending) listed
        S, ns = pool.num_staging, len(staged)
        if ns and S < 1:
            assert runtime._copies == -1 and (pool.hold_layer[pool.staging_rows] == -1).all()
        else:
            per_turn = ns if ns <= S else max(1, S // 2)
            head = staged[:per_turn * (1 if ns <= S or S < 2 else 2)]
            rows = pool.staging_first + np.arange(len(head))
            held = lane[3, head]  # (one-expert turns: each buffer's last turn's expert; the loop copies the others)
            if per_turn == 1:
                held = lane[3, staged[[ns - 1] if len(head) == 1 else [(ns - 1) & ~1, (ns - 2) | 1]]]
                singles += ns > 2
            assert np.array_equal(lane[2, head], rows)
            # the CPU device's lane is settled ahead of its device work (nothing in flight here) unless its staged
            # experts take turns of several: then the first turns' buffers are held, else none is
            settled = not ns or per_turn in (1, ns)
            assert runtime._settled == settled
            if settled:
                assert (pool.hold_layer[pool.staging_rows] == -1).all()
                settled_heads += 0 < len(head)
            else:
                assert np.array_equal(pool.hold_expert[rows], held) and (pool.hold_layer[rows] == 0).all()
                assert (pool.hold_layer[pool.staging_rows[len(head):]] == -1).all()
                held_heads += 1
            copies = np.sort(np.concatenate([order[ready:ready + fetched], head]))
            assert runtime._copies == len(copies)
            assert np.array_equal(wi[K.W_COPIES:K.W_COPIES + 3, :len(copies)],
                                  np.stack([copies, lane[2, copies], lane[3, copies]]))
            staged_heads += 0 < len(head) < ns
        if staged_group:
            first = staged
        if len(first) < 2 and not staged_group:
            assert runtime._first is None
            continue
        gi = GroupIndex.build(r, lane[1, first], lane[2, first], (0, *runtime.pool.state))
        pairs, lo, span, g, is_staged = runtime._first
        prefetched_groups += len(pre) > 0
        gws = runtime._group_ws
        assert (pairs, lo, span, g) == (len(gi.pairs), gi.lo, len(gi.table_counts), len(first))
        assert gi.rows_ready != staged_group  # (the staged ones' buffers, given to a settled lane, are not held)
        assert is_staged == staged_group
        assert np.array_equal(gws.ints[:, :pairs], np.stack([gi.pairs, gi.pairs // k, gi.row_of_pairs()]))
        assert np.array_equal(gws.w[:pairs], gi.weights) and np.array_equal(gws.offs[:span], gi.offs)
        assert np.array_equal(gws.small[:, :g], np.stack([gi.rows, gi.experts, gi.counts]))
        assert np.array_equal(gws.table_counts[:span], gi.table_counts)
    assert staged_groups >= 3 and prefetched_groups >= 3 and staged_heads >= 3 and singles >= 3
    assert settled_heads >= 3 and held_heads >= 3


def test_the_route_call_writes_the_first_group_only_when_its_rows_are_ready():
    if K.compiled("route_partition") is None:
        pytest.skip("the route call is compiled code (numba)")
    ids = np.array([[0, 1], [1, 2]])
    w = np.full((2, 2), 0.5, np.float32)
    r = LayerRouting.group(ids, w)
    for busy, prefetched in ((False, False), (True, False), (False, True), (True, True)):
        runtime = _runtime(prefetch=1)
        pool = runtime.pool
        pool.admit_many(0, np.array([0, 2] if prefetched else [0, 1, 2]))
        row = pool.take_prefetch(0, 1).index if prefetched else pool.row_of[0, 1]
        if busy:  # a copy into one of the rows still in flight (a prefetch, or a swap): not written; the compute-time
            pool.inflight[row] = 1  # group checks
        source = np.array([HIT, PREFETCHED if prefetched else HIT, HIT], np.int8)
        plan = SimpleNamespace(layer=0, step=0, experts=np.array([0, 1, 2], np.int16), counts=r.counts(),
                               source=source, admitted=np.zeros(3, bool), evicted=[])
        OffloadRuntime._route(runtime, plan, ids, w)
        assert (runtime._first is None) == busy
        assert busy or runtime._group_ws.small[0, :3].tolist() == sorted([pool.row_of[0, 0], row, pool.row_of[0, 2]])
        runtime._first_in_route = False  # (on CUDA: never)
        OffloadRuntime._route(runtime, plan, ids, w)
        assert runtime._first is None


def test_the_route_workspace_grows_and_rewraps_its_tensors():
    ws = RouteWorkspace(torch.device("cpu"), pairs=4)
    assert ws.wi.shape == (K.W_ROWS, 10) and ws.tensors[0].shape == (10,)
    assert sorted(ws._turn_views) == [0, 1, 2, 3, 4]  # the staged pairs' views of every length made at set-up
    small = ws.wi
    assert ws.fit(4, 3).wi is small  # room already
    ws.fit(40, 0)
    assert ws.wi.shape[1] == 82 and ws.wf.shape == (2, 82)
    # a model's experts per layer: the rows longer than that (the route call's scratch, a slot per expert id)
    assert RouteWorkspace(torch.device("cpu"), pairs=4, experts=128).wi.shape[1] > 128
    pos, tok, w, tpos, ttok, tw = ws.tensors
    ws.wi[K.W_ORDER, 5], ws.wi[K.W_TOKENS, 6], ws.wf[0, 7] = 11, 12, 0.5
    ws.wi[K.W_TURNS + 2, 1], ws.wi[K.W_TURNS + 3, 2], ws.wf[1, 3] = 13, 14, 0.25
    assert pos[5] == 11 and tok[6] == 12 and w[7, 0] == 0.5  # views of the new buffers
    assert tpos[1] == 13 and ttok[2] == 14 and tw[3, 0] == 0.25
    turns = ws.turn_views(4)
    assert ws.turn_views(4) is turns and [v.shape[0] for v in turns] == [4, 4, 4] and turns[2][3, 0] == 0.25
    views = ws.views(8)
    assert ws.views(8) is views and [v.shape[0] for v in views] == [8, 8, 8]  # made once per length
    assert views[0][5] == 11 and views[2][7, 0] == 0.5  # of the buffers
    experts, ptr, per, order, wf, cpu, lane, lane_order = ws.layer_views(3, 8, 2, 3, 3)
    assert ws.layer_views(3, 8, 2, 3, 3)[0] is experts and ws.layer_views(4, 8, 2, 3, 3)[0] is not experts
    assert [len(a) for a in (experts, ptr, per, order, wf)] == [3, 4, 3, 8, 8] and order[5] == 11 and wf[7] == 0.5
    assert lane.shape == (5, 3) and len(cpu) == 2 and len(lane_order) == 3
    lane[2, 1] = 7  # the runtime writes slot rows into the lane's views: into the buffers
    assert ws.wi[K.W_LANE + 2, 1] == 7
    assert ws.fit(0, 100).wi.shape[1] == 200  # evictions need room too
    assert ws.views(8)[0] is not views[0] and ws.layer_views(3, 8, 2, 3, 3)[0] is not experts  # re-made for the new buffers
    assert ws.views(8)[0].data_ptr() == ws.tensors[0].data_ptr()
    assert RouteWorkspace(torch.device("meta")).tensors is None  # not the CPU device: no tensors


def test_a_group_in_the_workspace_equals_group_index_and_grows():
    """The accelerator lane's group (the runtime's ``_group``) against ``GroupIndex`` and the index tensors
    made from it, on a routing larger than the workspace (it grows), with biases (pair rows) and without."""
    if K.compiled("group_index_into") is None:
        pytest.skip("the group workspace is written by compiled code (numba)")
    rng = np.random.default_rng(3)
    model = scale_model(get_model("mixtral-8x7b"), 1 / 64)
    store = HostExpertStore.random(model, torch.float32, 0)
    devices = Devices.create("cpu", "fp32")
    rt = OffloadRuntime(store, devices, np.array([8] * model.num_moe_layers), 2, 2, cpu_threads=1)
    try:
        assert rt._group_ws.ints.shape[1] == len(rt.pool.slots)  # (room for the slot table's rows at least)
        for trial in range(40):
            T, k = int(rng.integers(1, 40)), 2
            ids = np.stack([rng.choice(8, k, replace=False) for _ in range(T)])
            r = LayerRouting.group(ids, rng.random((T, k)).astype(np.float32))
            seg = np.sort(rng.choice(len(r.experts), int(rng.integers(1, len(r.experts) + 1)), replace=False))
            rows = rng.choice(len(rt.pool.slots), len(seg), replace=False).astype(np.int64)
            rt.pool.hold_layer[rows], rt.pool.hold_expert[rows] = 0, r.experts[seg]
            plan = SimpleNamespace(layer=0, step=0)
            g_rows, lo, table_counts, tensors, experts, counts = rt._group(plan, r, seg, rows)
            gi = GroupIndex.build(r, seg, rows)
            assert rt._group_ws.ints.shape[1] >= len(r.positions)
            assert np.array_equal(g_rows, gi.rows) and lo == gi.lo and np.array_equal(table_counts, gi.table_counts)
            assert experts == gi.experts.tolist() and counts == gi.counts.tolist()
            for bias in (False, True):
                want = _device_indices(gi.pairs, gi.pairs // k, gi.offs, gi.row_of_pairs, gi.weights,
                                       None, torch.float32, bias)
                rt.layout = SimpleNamespace(bias=bias)
                got = rt._group(plan, r, seg, rows)[3]
                for a, b in zip(got, want):
                    assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
            rt.pool.hold_layer[rows] = -1
            with pytest.raises(AssertionError, match="holds None"):  # the rows are checked
                rt._group(plan, r, seg, rows)
    finally:
        rt.close()


def test_group_workspace_without_tensors_off_the_cpu():
    ws = GroupWorkspace(6, torch.device("meta"), pairs=3)
    assert ws.tensors is None and ws.ints.shape == (3, 6) and ws.small.shape == (3, 6)


def test_a_visit_reads_the_thread_cpu_clock_a_few_times(traces, monkeypatch):
    """The stopwatches' segments per layer visit: the decision hands over to the layer's start; without swaps the
    visit's bookkeeping ends with the accelerator lane; on the CPU device the first copies, the groups and
    one-expert staging turns run in one pause, to the layer's end (the lane settled ahead of them), with the route
    call's first group or without (the NumPy code builds every group before the copies too)."""
    import time as _time

    import dali_exec.executor.timing as timing

    reads = [0]

    class Clocks:
        perf_counter = staticmethod(_time.perf_counter)

        @staticmethod
        def thread_time():
            reads[0] += 1
            return _time.thread_time()

    monkeypatch.setattr(timing, "time", Clocks())
    trace, opts, batch = traces["qwen"]

    def per_visit(system):
        reads[0] = 0
        result = execute(trace, system, opts, RUN, batch_size=batch)
        return reads[0] / result.summary["overhead"]["layer_visits"]

    # cpu-only: the decision's start, its hand-over to start_layer, start_layer's end, run_experts' start and end;
    # gpu-lru and llamacpp the same: their lanes settled ahead, run_experts' end is the pause for the copies
    assert per_visit("cpu-only") == 5
    assert per_visit("gpu-lru") == 5 and per_visit("llamacpp") == 5
    with monkeypatch.context() as m:
        m.setattr(K, "compiled", lambda name: None)
        assert per_visit("gpu-lru") == 5


def test_views_up_to_a_visits_pairs_are_made_at_set_up_and_again_after_growth():
    """Given a visit's pairs, the CPU device's group views of every length up to them and of every span exist before
    any group is built (a group of those lengths makes none); longer groups' views are made at first use; a workspace
    that grows makes them again for its new buffers. Without pairs, or off the CPU device, none are made."""
    ws = GroupWorkspace(6, torch.device("cpu"), pairs=10)
    made = {n: ws._views[n] for n in range(11)}
    spans = {s: ws._offs_views[s] for s in range(7)}
    for n in range(11):
        for s in range(7):
            v = ws.views(n, s)
            assert v[:4] == made[n] and v[4] is spans[s] and [t.shape[0] for t in v] == [n] * 4 + [s]
    assert len(ws._views) == 11
    assert ws.views(15, 2)[0].shape[0] == 15 and len(ws._views) == 12  # (room for 20: longer ones at first use)
    ws.fit(30)
    assert ws.ints.shape[1] == 60 and set(ws._views) == set(range(11)) and set(ws._offs_views) == set(range(7))
    assert ws._views[10][0].data_ptr() == ws.tensors[0].data_ptr() and made[10][0].data_ptr() != ws.tensors[0].data_ptr()
    assert GroupWorkspace(6, torch.device("cpu"))._views == {}
    assert GroupWorkspace(6, torch.device("meta"), pairs=10)._views == {}
