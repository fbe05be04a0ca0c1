"""The executor's pieces: slot table, copy lane (priorities, delayed copies), CPU lane, routing, budget."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dali_exec.executor.copies import BACKGROUND, ON_DEMAND, CopyEngine  # noqa: E402
from dali_exec.executor.cpu_worker import CpuWorker  # noqa: E402
from dali_exec.executor.ffn import ExpertLayout  # noqa: E402
from dali_exec.executor.routing import LayerRouting  # noqa: E402
from dali_exec.executor.slots import SlotNotReady, SlotPool  # noqa: E402
from dali_exec.executor.timing import Timer, TurnLoop  # noqa: E402
from dali_sim.sim.engine import Activity  # noqa: E402

from conftest import tiny_model  # noqa: E402

CPU = torch.device("cpu")


def _pool(caps=(2, 1), prefetch=1, staging=1, numel=4):
    return SlotPool(np.array(caps), prefetch, staging, numel, torch.float32, CPU)


def test_slot_pool_allocates_exactly_the_plan_and_keeps_roles():
    pool = _pool()
    assert pool.nbytes == (2 + 1 + 1 + 1) * 4 * 4
    pool.admit(0, 5)
    pool.admit(0, 6)
    with pytest.raises(AssertionError, match="all 2 cache slots"):
        pool.admit(0, 7)  # a full layer never takes one more
    pool.evict(0, 5)
    pool.admit(0, 7)
    # a prefetched expert admitted by the cache keeps its buffer; a free cache slot becomes the buffer
    buf = pool.take_prefetch(1, 3)
    pool.adopt(1, 3, pool.pop_prefetched(1, 3))
    assert pool.cached(1, 3) is buf and len(pool.prefetch_free) == 1
    with pytest.raises(AssertionError, match="no free cache slot"):
        pool.adopt(1, 4, pool.take_prefetch(1, 4))
    pool.check()
    assert pool.resident()[0].nonzero()[0].tolist() == [6, 7]


def test_a_slot_outliving_its_pool_says_so():
    """A slot refers to its pool weakly (the pool holds its slots: no cycle keeps a run's slot table alive)."""
    pool = SlotPool(np.array([1]), 0, 1, 4, torch.float32, torch.device("cpu"), num_experts=8)
    slot = pool.slots[0]
    assert slot.pool is pool and slot.holds is None
    del pool
    with pytest.raises(RuntimeError, match="slot 0: its slot pool is gone"):
        slot.holds


def test_prefetch_buffers_are_found_by_layer_and_expert_and_counted():
    pool = _pool(prefetch=2)
    slot = pool.take_prefetch(1, 40)  # (an expert id beyond the table's width: it grows)
    assert pool.prefetch_row[1, 40] == slot.index and pool.n_prefetched == 1 and slot.holds == (1, 40)
    with pytest.raises(AssertionError, match="layer 1 expert 40 is already prefetched"):
        pool.take_prefetch(1, 40)
    for layer, expert in ((0, 40), (1, 3), (1, 99)):
        with pytest.raises(AssertionError, match=f"layer {layer} expert {expert} was not prefetched"):
            pool.pop_prefetched(layer, expert)
    pool.check()
    assert pool.pop_prefetched(1, 40) is slot and pool.prefetch_row[1, 40] == -1 and pool.n_prefetched == 0
    pool.release_prefetch(slot)
    pool.check()
    pool.prefetch_row[0, 1] = pool.prefetch_free[0]  # a buffer the count does not know of
    with pytest.raises(AssertionError, match="1 experts prefetched, 0 counted"):
        pool.check()


def test_staging_buffers_are_taken_as_consecutive_rows_and_returned_cleared():
    pool = SlotPool(np.array([1]), 0, 5, 4, torch.float32, torch.device("cpu"), num_experts=8)
    first = pool.staging_free
    assert first == list(range(1, 6)) and np.shares_memory(pool.hold_layer, pool.state)  # the rows of one array
    for n in (2, 4):  # two buffers (one-expert turns) and more
        rows = pool.take_staging_rows(n)
        assert rows.tolist() == first[:n] and pool.staging_free == first[n:]
        pool.hold_rows(rows, 0, np.arange(n))
        assert pool.hold_expert[rows].tolist() == list(range(n))
        pool.release_staging_rows(rows)
        assert pool.staging_free == first  # the same rows are the first free ones again
        assert (pool.hold_layer[rows] == -1).all() and (pool.hold_expert[rows] == -1).all()
        pool.check_layer(0)
    with pytest.raises(AssertionError, match="6 staging buffers asked, 5 of 5 free"):
        pool.take_staging_rows(6)
    a, b = pool.take_staging_rows(2), pool.take_staging_rows(1)
    # (a block is returned after the blocks taken after it)
    with pytest.raises(AssertionError, match=r"buffers \[1, 2\] returned, but the last ones taken are \[2, 3\]"):
        pool.release_staging_rows(a)
    with pytest.raises(AssertionError, match="2 free \\+ 0 used staging buffers"):
        pool.check_layer(0)
    pool.release_staging_rows(b)
    pool.release_staging_rows(a)
    slot = pool.take_staging(0, 3)
    assert slot.index == first[0] and pool.staging_free == first[1:] and slot.holds == (0, 3)
    pool.release_staging(slot)
    pool.check()


def test_slot_check_ready_refuses_a_copy_in_flight_and_the_wrong_expert():
    timer = Timer()
    engine = CopyEngine(None, timer, delay_s=0.2)
    try:
        pool = _pool()
        slot = pool.admit(0, 1)
        slot.ticket = engine.submit(slot.data, torch.ones(4), ON_DEMAND, Activity("fetch", 0, 0, 1))
        with pytest.raises(SlotNotReady, match="has not completed"):
            slot.check_ready(0, 1)
        slot.ticket.wait()
        slot.check_ready(0, 1)
        assert slot.data.tolist() == [1, 1, 1, 1]
        with pytest.raises(SlotNotReady, match="holds \\(0, 1\\)"):
            slot.check_ready(0, 2)
    finally:
        engine.close()


def test_copy_lane_runs_on_demand_before_queued_background_copies():
    timer = Timer()
    engine = CopyEngine(None, timer, delay_s=0.05)
    order = []
    try:
        dst = torch.zeros(6, 8)
        src = torch.arange(48, dtype=torch.float32).view(6, 8)
        tickets = [engine.submit(dst[0], src[0], BACKGROUND, Activity("prefetch", 0, 1, 0))]  # starts at once
        time.sleep(0.01)
        tickets += [engine.submit(dst[i], src[i], BACKGROUND, Activity("prefetch", 0, 1, i)) for i in (1, 2)]
        tickets += [engine.submit(dst[i], src[i], ON_DEMAND, Activity("fetch", 0, 0, i)) for i in (3, 4)]
        for t in tickets:
            t.wait()
        order = [iv.name for iv in timer.intervals()]
    finally:
        engine.close()
    assert order == ["prefetch L1 E0", "fetch L0 E3", "fetch L0 E4", "prefetch L1 E1", "prefetch L1 E2"]
    assert torch.equal(dst[:5], src[:5])


def test_a_later_copy_into_the_same_buffer_promotes_the_earlier_one():
    timer = Timer()
    engine = CopyEngine(None, timer, delay_s=0.05)
    try:
        dst = torch.zeros(3, 2)
        first = engine.submit(dst[0], torch.zeros(2), BACKGROUND, Activity("prefetch", 0, 1, 0))  # occupies the lane
        time.sleep(0.01)
        old = engine.submit(dst[1], torch.full((2,), 1.0), BACKGROUND, Activity("prefetch", 0, 1, 1))
        other = engine.submit(dst[2], torch.full((2,), 2.0), BACKGROUND, Activity("prefetch", 0, 1, 2))
        new = engine.submit(dst[1], torch.full((2,), 3.0), ON_DEMAND, Activity("fetch", 0, 1, 1), previous=old)
        for t in (first, old, other, new):
            t.wait()
        names = [iv.name for iv in timer.intervals()]
    finally:
        engine.close()
    assert names.index("prefetch L1 E1") < names.index("fetch L1 E1") < names.index("prefetch L1 E2")
    assert dst[1].tolist() == [3.0, 3.0]  # the later copy landed last


def test_on_demand_copies_of_the_lane_and_background_batches_land_with_one_interval_each():
    timer = Timer()
    engine = CopyEngine(None, timer)
    try:
        dst = torch.zeros(6, 8)
        src = torch.arange(2 * 5 * 8, dtype=torch.float32).view(2, 5, 8)
        inflight = np.zeros(6, np.int64)
        rows = np.array([0, 3, 5])
        t = engine.submit_many(dst, src, rows.tolist(), ([1, 1, 1], [4, 0, 2]), BACKGROUND,
                               ("prefetch", 0, [1, 1, 1], [4, 0, 2], None), rows=rows, inflight=inflight)
        t.wait()  # one layer: copied at once on the CPU device, landed together
        assert inflight.tolist() == [0] * 6 and t.landed == 3
        assert torch.equal(dst[[0, 3, 5]], src[1, [4, 0, 2]])
        assert engine.issue_now(dst, src, [1, 2], 0, [3, 1], 7) is None  # the CPU device: done now
        assert torch.equal(dst[[1, 2]], src[0, [3, 1]])
        start, end = engine.copy_one(dst[4], src[0, 0])
        assert end >= start and torch.equal(dst[4], src[0, 0])
        names = sorted(iv.name for iv in timer.intervals())
        assert names == ["fetch L0 E1", "fetch L0 E3", "prefetch L1 E0", "prefetch L1 E2", "prefetch L1 E4"]
        assert engine.copies == 6
    finally:
        engine.close()


def test_timer_summary_equals_the_resolved_intervals():
    timer = Timer()
    a = timer.mark()
    timer.add_group("gpu", 0, 1, np.array([3, 5]), np.array([2, 6]), a, a + 0.004)
    timer.add_copies("fetch", 0, 1, [3, 5, 6], a, a + 0.003)
    timer.add_activity("host", "host", 0, 1, a, a + 0.001)
    timer.add("cpu", Activity("expert", 0, 1, 2, tokens=1), a + 0.001, a + 0.002)
    # a loop of staging turns through one buffer: one series per track, one interval per turn (the stamp lists
    # filled after they are recorded, as the loop does)
    loop = TurnLoop(0, 1, [7, 9], [4, 1], 1)
    timer.add_turns(loop)
    loop.starts += [a + 0.005, a + 0.007]
    loop.ends += [a + 0.006, a + 0.008]
    loop.copy_starts.append(a + 0.0055)
    loop.copy_ends.append(a + 0.0065)
    busy, count, lazy = timer.summary()
    resolved = timer.intervals()
    assert count == len(resolved) == 10 and list(lazy) == resolved and len(lazy) == 10
    for track in ("gpu", "pcie", "host", "cpu"):
        assert busy[track] == pytest.approx(sum(iv.end - iv.start for iv in resolved if iv.track == track))
    assert [iv.args["tokens"] for iv in resolved if iv.track == "gpu"] == [2, 6, 4, 1]
    t = a - timer.t0  # the stamps in seconds since the timer's start
    turns = [(iv.name, iv.start, iv.end) for iv in resolved if iv.track == "gpu" and iv.args["group"] == 1]
    assert turns == [("L1 E7", pytest.approx(t + 0.005), pytest.approx(t + 0.006)),
                     ("L1 E9", pytest.approx(t + 0.007), pytest.approx(t + 0.008))]
    fetches = [(iv.name, iv.args["batch"], iv.start) for iv in resolved if iv.track == "pcie" and iv.start > t + 0.005]
    assert fetches == [("fetch L1 E9", 1, pytest.approx(t + 0.0055))]
    # once resolved, a run's intervals let go of its timer (whose stamps hold the copies' tickets, hence the
    # run's buffers: a validation keeping several replays' results ran out of memory)
    assert lazy._timer is None and lazy._raw == [] and list(lazy) == resolved


def test_timer_turns_that_fit_their_buffers_record_no_copy():
    """Turns no more than the buffers: each buffer's copy was issued before the loop (recorded with the layer's
    copies), so the loop's record has computes only; more turns add one fetch per later turn."""
    timer = Timer()
    a = timer.mark()
    for layer, experts, tokens, starts, ends, copies in (
            (2, [4, 6], [1, 3], [a, a + 0.002], [a + 0.001, a + 0.003], []),
            (3, [1, 2, 5], [2, 2, 2], [a, a + 0.01, a + 0.02], [a + 0.005, a + 0.015, a + 0.025],
             [(a + 0.006, a + 0.008)])):
        loop = TurnLoop(0, layer, experts, tokens, 2)
        loop.starts, loop.ends = starts, ends
        loop.copy_starts, loop.copy_ends = [c for c, _ in copies], [c for _, c in copies]
        timer.add_turns(loop)
    got = [(iv.track, iv.name) for iv in timer.intervals()]
    assert got == [("gpu", "L2 E4"), ("gpu", "L3 E1"), ("gpu", "L2 E6"), ("pcie", "fetch L3 E5"), ("gpu", "L3 E2"),
                   ("gpu", "L3 E5")]


def test_copy_errors_reach_the_waiter():
    engine = CopyEngine(None, Timer())
    try:
        with pytest.raises(ValueError, match="shapes/dtypes differ"):
            engine.submit(torch.zeros(2), torch.zeros(3), ON_DEMAND, Activity("fetch", 0, 0, 0))
    finally:
        engine.close()


def test_cpu_worker_uses_its_own_thread_count_concurrently():
    worker = CpuWorker(1)
    try:
        seen = worker.run(lambda: (torch.get_num_threads(), threading.current_thread().name))
        assert seen[0] == 1 and seen[1].startswith("dali-cpu")
        assert worker.run(lambda: threading.current_thread()) is not threading.main_thread()
    finally:
        worker.close()
    with pytest.raises(ValueError, match="cpu_threads"):
        CpuWorker(0)


def test_cpu_worker_jobs_return_raise_and_run_in_order():
    worker = CpuWorker(1)
    order = []
    try:
        jobs = [worker.submit(lambda i=i: order.append(i) or i * i) for i in range(5)]
        assert [j.result() for j in jobs] == [0, 1, 4, 9, 16] and order == [0, 1, 2, 3, 4]
        assert jobs[2].result() == 4  # again, without waiting twice
        failed = worker.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failed.result()
        assert worker.run(lambda a, b=0: a + b, 2, b=3) == 5  # the worker goes on after a failed job
    finally:
        worker.close()
    worker.close()  # (idempotent)
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(lambda: None)


def test_routing_groups_flat_positions_by_expert():
    ids = np.array([[2, 0], [0, 1], [2, 1]])
    w = np.array([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]], np.float32)
    r = LayerRouting.group(ids, w)
    assert r.experts.tolist() == [0, 1, 2]
    assert r.counts().tolist() == [2, 2, 2]
    assert r.matches(np.array([2, 0, 1]), np.array([2, 2, 2])) and not r.matches(np.array([0, 1]), np.array([2, 2]))
    assert r.positions[r.segment(0)].tolist() == [1, 2]  # token 0 rank 1, token 1 rank 0
    assert r.weights[r.segment(2)].tolist() == pytest.approx([0.7, 0.5])
    uniform = LayerRouting.group(ids, None)
    assert set(uniform.weights.tolist()) == {0.5}
    with pytest.raises(AssertionError, match="expert 3"):
        r.segment(3)


@pytest.mark.parametrize("family,ffn,expected", [("mixtral", 3, "SwiGLU (SiLU)"), ("gpt_oss", 3, "gpt-oss clamped GLU"),
                                                 ("switch_transformers", 2, "ReLU")])
def test_expert_layout_matches_the_spec_and_computes_the_ffn(family, ffn, expected):
    import dataclasses

    model = dataclasses.replace(tiny_model(), family=family, ffn_matrices=ffn, expert_bias=family == "gpt_oss")
    lay = ExpertLayout.of(model)
    assert lay.numel == model.expert_params and lay.activation == expected
    flat = torch.randn(lay.numel, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, model.hidden_size, generator=torch.Generator().manual_seed(1))
    w_up, w_down, b_up, b_down = lay.views(flat)
    h = x @ w_up.T + (b_up if b_up is not None else 0)
    if ffn == 3:
        gate, up = h[:, : lay.inter], h[:, lay.inter:]
        if family == "gpt_oss":
            gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
            h = (up + 1) * gate * torch.sigmoid(1.702 * gate)
        else:
            h = torch.nn.functional.silu(gate) * up
    else:
        h = torch.relu(h)
    want = h @ w_down.T + (b_down if b_down is not None else 0)
    torch.testing.assert_close(lay.forward(flat, x), want)


def test_stopwatch_hand_to_splits_one_span_at_one_reading(monkeypatch):
    """Adjacent segments share their boundary: the parts add up to the whole, each clock read once per boundary."""
    import dali_exec.executor.timing as timing
    from dali_exec.executor.timing import Stopwatch

    reads = {"wall": 0, "cpu": 0}

    class Clocks:  # each reading advances by 1 (wall) / 2 (cpu) seconds
        def perf_counter(self):
            reads["wall"] += 1
            return float(reads["wall"])

        def thread_time(self):
            reads["cpu"] += 1
            return 2.0 * reads["cpu"]

    monkeypatch.setattr(timing, "time", Clocks())
    a = Stopwatch().start()
    b = a.hand_to(Stopwatch())
    c = b.hand_to(Stopwatch())
    c.hand_to(a)
    a.stop()
    assert reads == {"wall": 5, "cpu": 5}  # start, three hand-overs, stop
    assert (a.wall, b.wall, c.wall) == (2.0, 1.0, 1.0) and (a.cpu, b.cpu, c.cpu) == (4.0, 2.0, 2.0)
    assert a.at == 5.0 and b.at == 3.0  # the wall reading of each one's last boundary
    d = Stopwatch().start()
    d.stop()
    assert reads == {"wall": 7, "cpu": 7} and d.wall == 1.0 and d.at == 7.0


def test_copy_engine_wakes_from_idle_and_releases_every_waiter():
    """The copy thread sleeps when it has nothing to do and a submission wakes it; every waiting thread (a ticket,
    a row's copies, the end) is released once what it waits for has landed; an idle engine closes."""
    engine = CopyEngine(None, Timer(), delay_s=0.02)
    try:
        for _ in range(3):  # idle between requests: each wakes the sleeping copy thread
            time.sleep(0.03)
            dst, src = torch.zeros(4), torch.arange(4.0)
            engine.submit(dst, src, BACKGROUND, Activity("prefetch", 0, 1, 0)).wait()
            assert torch.equal(dst, src)
        dst = torch.zeros(3, 2)
        inflight = np.zeros(3, np.int64)
        tickets = [engine.submit(dst[i], torch.full((2,), float(i + 1)), BACKGROUND, Activity("prefetch", 0, 1, i),
                                 row=i, inflight=inflight) for i in range(3)]
        assert inflight.tolist() == [1, 1, 1]
        seen = []
        waiters = [threading.Thread(target=lambda t=t: (t.wait(), seen.append(t.done))) for t in tickets]
        waiters += [threading.Thread(target=lambda: (engine.wait_rows(inflight, [2]), seen.append(inflight[2] == 0))),
                    threading.Thread(target=lambda: (engine.wait_any(tickets[1:]), seen.append(tickets[1].done))),
                    threading.Thread(target=lambda: (engine.drain(), seen.append(all(t.done for t in tickets))))]
        for w in waiters:
            w.start()
        for w in waiters:
            w.join(timeout=10)
        assert not any(w.is_alive() for w in waiters) and seen == [True] * 6
        assert inflight.tolist() == [0, 0, 0] and dst[:, 0].tolist() == [1.0, 2.0, 3.0]
    finally:
        engine.close()
    idle = CopyEngine(None, Timer())
    time.sleep(0.01)
    idle.close()  # wakes the sleeping copy thread, which ends
    assert not idle._thread.is_alive()
