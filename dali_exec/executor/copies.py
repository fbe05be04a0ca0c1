"""Host-to-accelerator copies: on-demand ones issued by the accelerator lane, background ones by a thread.

The link model of the simulator (docs/simulator.md): on-demand copies go before prefetches and cache
swaps that have not started; a started copy is never preempted.

* **On-demand** copies (a layer's fetches, its staging turns) are issued by the thread that computes, when
  their buffers are free (:meth:`CopyEngine.issue_now`, :meth:`CopyEngine.copy_one`): on CUDA queued on
  the copy stream from pinned memory (``non_blocking=True``, each bracketed by CUDA events, each after the
  event of the last compute that read its buffer), so a compute waits for them on its stream and the host
  never does; on the CPU device (no DMA engine) made at once. No hand-over to another thread per copy.
* **Background** copies (prefetches, swaps) go through one copy thread with a priority queue of requests
  (priority, then submission order): it takes the first, issues its copies one at a time (on CUDA on the
  copy stream, synchronising each before the next, so at most one is queued there), marks each landed
  (the slot rows' in-flight counts drop) and, between two copies, lets an on-demand request that has
  arrived go first, the rest resuming after it. Queueing on the copy stream is done under one lock, so a
  layer's on-demand copies are queued together, behind at most the one background copy that has started.
  On the CPU device a background request whose copies all come from one layer is one gather and scatter.

The hand-overs use C-level primitives only, as the CPU lane's worker does (``cpu_worker.py``): one
``threading.Lock`` guards the queue and the tickets' state; the copy thread, when it finds nothing to do,
sleeps on a ``queue.SimpleQueue`` that a submission rings only then (a busy copy thread is not signalled);
a thread that waits (for a ticket, a row's copy, the end) parks on a lock of its own, registered under the
engine's lock and released by the copy thread at the next landing (it then checks again). A
``threading.Condition`` runs Python code in ``threading`` for each ``notify_all`` and wait: per request on
the computing thread, with cold caches, several microseconds of its CPU.

``delay_s`` (tests) holds every copy back that long before it is issued, to check that nothing computes
from a slot whose copy has not landed.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time

import numpy as np
import torch

from dali_exec.executor.timing import Timer
from dali_sim.sim.engine import Activity

ON_DEMAND, BACKGROUND = 0, 1  # lower first, as in the simulator's PCIe resource

#: one call for a list of copies (one dispatch, the GIL released once), where torch has it
_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)


def copy_rows(dst_table: torch.Tensor, src_table: torch.Tensor, layer: int, rows, experts) -> None:
    """``dst_table[rows[i]].copy_(src_table[layer, experts[i]])`` for every i, on the CPU device: row by row,
    straight from the host store, in one ``torch._foreach_copy_`` where torch has it (one dispatch that
    releases the GIL once: the copy thread then hands the GIL back and forth with the computing thread once
    per request, not once per expert). A gather (``index_select``) and scatter (``index_copy_``) would
    first fill a temporary of all the rows: measured 2-6x slower for four 22 MB experts on the 2-core
    development VM (docs/executor.md, "Copies on the CPU device")."""
    src = src_table[layer]
    if _FOREACH_COPY is not None and len(rows) > 1:
        _FOREACH_COPY([dst_table[r] for r in rows], [src[e] for e in experts])
        return
    for row, expert in zip(rows, experts):
        dst_table[row].copy_(src[expert])


class CopyTicket:
    """One request: one copy, or several copies issued back to back at one priority (a layer's on-demand
    copies); ``done`` is set once all have landed, ``landed`` counts those that have."""

    __slots__ = ("dsts", "srcs", "src_table", "priority", "seq", "what", "after", "rows", "inflight", "taken",
                 "done", "error", "starts", "ends", "landed", "next", "engine")

    def __init__(self, dsts: list, srcs: list, priority: int, seq: int, what, after: list | None, *,
                 src_table: tuple | None = None, rows=None, inflight=None):
        self.dsts, self.srcs, self.src_table = dsts, srcs, src_table
        self.priority, self.seq, self.what, self.after = priority, seq, what, after
        self.rows, self.inflight = rows, inflight  # slot rows and the pool's per-row copies in flight
        self.taken = False
        self.done = False  # set (under the engine's lock) once every copy has landed
        self.engine: "CopyEngine | None" = None
        self.error: BaseException | None = None
        self.starts: list = []
        self.ends: list = []
        self.landed = 0
        self.next = 0  # the next copy to issue (a background request may be resumed after on-demand ones)

    @property
    def start(self):
        return self.starts[0] if self.starts else None

    @property
    def end(self):
        return self.ends[-1] if self.ends else None

    def is_done(self) -> bool:
        return self.done

    def activity(self, i: int) -> Activity:
        """What copy ``i`` was: ``what`` is an Activity (one copy) or (kind, step, layers, experts, others):
        per copy its (target) layer, expert and, for a swap, the expert it replaces."""
        if isinstance(self.what, Activity):
            return self.what
        kind, step, layers, experts, others = self.what
        return Activity(kind, step, int(layers[i]), int(experts[i]), other=-1 if others is None else int(others[i]))

    def wait(self) -> None:
        if not self.done:
            self.engine._wait_until(lambda: self.done, errors=False)
        if self.error is not None:
            raise RuntimeError(f"copy {self.activity(0).name()} failed: {self.error}") from self.error


class CopyEngine:
    """The copy lane (the simulator's ``pcie`` track)."""

    def __init__(self, stream: "torch.cuda.Stream | None", timer: Timer, *, delay_s: float = 0.0,
                 device: torch.device | None = None, home: "torch.cuda.Stream | None" = None):
        """``home`` (CUDA): the current stream of the thread that issues on-demand copies (:meth:`issue_now`,
        :meth:`copy_one`), made current again after them; by default that thread's current stream, asked each
        time."""
        self.stream = stream
        self.timer = timer
        self.delay_s = delay_s
        self.device = device
        self.home = home
        if stream is not None:  # (asked by index: torch then does not ask whether CUDA is available)
            self._index = device.index if device is not None and device.index is not None else \
                torch.cuda.current_device()
        #: guards the queue, the tickets' state (taken, priority, landed, done), the in-flight counts and _waiters
        self._lock = threading.Lock()
        self._bell: queue.SimpleQueue = queue.SimpleQueue()  # wakes the copy thread, rung only while it sleeps
        self._idle = False  # the copy thread found nothing to do and sleeps on _bell (under _lock)
        self._waiters: list = []  # locks held by waiting threads, released at the next landing (under _lock)
        #: held while copies are queued on the copy stream (by this thread or :meth:`issue_now`), so a
        #: layer's on-demand copies are queued together
        self._stream_lock = threading.Lock()
        self._heap: list[tuple[int, int, CopyTicket]] = []
        self._seq = itertools.count()
        self._closed = False
        self._open = 0  # submitted and not done
        self.copies = 0
        self.wakes = 0  # requests that woke the copy thread from its sleep (hand-overs: dali_sim's HANDOFF_KINDS)
        self.error: BaseException | None = None  # the first failed copy (every waiter raises it)
        self._thread = threading.Thread(target=self._loop, name="dali-copy", daemon=True)
        self._thread.start()

    def submit(self, dst: torch.Tensor, src: torch.Tensor, priority: int, what: Activity, *,
               after: "torch.cuda.Event | None" = None, previous: CopyTicket | None = None,
               row: int | None = None, inflight=None) -> CopyTicket:
        """Queue ``dst.copy_(src)``. ``after``: a CUDA event the copy must wait for (the last compute
        that read ``dst``). ``previous``: the last copy into ``dst``; if it has not started and has a
        lower priority it is promoted, so it still lands before this one. ``row``, ``inflight``: the slot
        row and the pool's per-row count of copies in flight (incremented now, decremented on landing)."""
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"copy {what.name()}: shapes/dtypes differ ({tuple(src.shape)} {src.dtype} -> "
                             f"{tuple(dst.shape)} {dst.dtype})")
        rows = None if row is None else [row]
        return self._queue([dst], [src], priority, what, None if after is None else [after], rows, inflight,
                           None, [previous] if previous is not None else [])

    def submit_many(self, dst_table: torch.Tensor, src_table: torch.Tensor, dst_index: list[int],
                    src_index: tuple[list[int], list[int]], priority: int, what: tuple, *, after: list | None = None,
                    previous: list | None = None, rows=None, inflight=None) -> CopyTicket:
        """Queue ``dst_table[dst_index[i]].copy_(src_table[layers[i], experts[i]])`` for every i (``src_index``:
        (layers, experts)), in this order, as one
        request (``what``: (kind, step, layers, experts, others) for the timeline; ``after`` and ``previous``
        per copy as in :meth:`submit`; the row views are made by the copy thread). On-demand copies are
        issued back to back; a background request yields to on-demand requests between its copies."""
        return self._queue(dst_index, src_index, priority, what, after, rows, inflight, (dst_table, src_table),
                           previous or [])

    def _queue(self, dsts, srcs, priority, what, after, rows, inflight, src_table, previous) -> CopyTicket:
        with self._lock:
            if self._closed:
                raise RuntimeError("copy engine is closed")
            t = CopyTicket(dsts, srcs, priority, next(self._seq), what, after, src_table=src_table, rows=rows,
                           inflight=inflight)
            t.engine = self
            for prev in previous:
                if not prev.taken and prev.priority > priority:
                    prev.priority = priority
                    heapq.heappush(self._heap, (priority, prev.seq, prev))
            if inflight is not None:
                for r in rows:  # (a few rows: cheaper than a fancy-indexed add with cold caches)
                    inflight[r] += 1
            heapq.heappush(self._heap, (priority, t.seq, t))
            self._open += 1
            self.wakes += self._idle
            self._wake_loop()
        return t

    def _wake_loop(self) -> None:
        """The copy thread, if it sleeps, is woken (under ``_lock``: it sets ``_idle`` under it before it sleeps,
        so no ring is lost and at most one is pending)."""
        if self._idle:
            self._idle = False
            self._bell.put(None)

    def _notify(self) -> None:
        """Every waiting thread checks its condition again (under ``_lock``)."""
        if self._waiters:
            for w in self._waiters:
                w.release()
            self._waiters.clear()

    def _wait_until(self, ready, errors: bool = True) -> None:
        """Block until ``ready()`` (checked under ``_lock``) or, with ``errors``, a copy has failed."""
        while True:
            with self._lock:
                if ready() or (errors and self.error is not None):
                    return
                w = threading.Lock()
                w.acquire()
                self._waiters.append(w)
            w.acquire()  # released by the copy thread at its next landing

    def issue_now(self, dst_table: torch.Tensor, src_table: torch.Tensor, rows: list[int], layer: int,
                  experts: list[int], step: int, *, after: list | None = None, previous: list | None = None,
                  pause=None, resume: bool = True) -> list | None:
        """On-demand copies ``dst_table[rows[i]].copy_(src_table[layer, experts[i]])`` issued by the calling
        thread, in this order, ahead of every background copy that has not started (nothing is queued:
        the accelerator lane issues them when their buffers are free, with no hand-over to the copy thread).

        On CUDA they are queued on the copy stream (``non_blocking`` from pinned memory), each after its
        ``after`` event (the last compute that read its row), and their end events are returned: a compute
        from a row waits for its event on the compute stream, the host never waits. On the CPU device
        (no DMA engine: the host copies) they are done now, in one gather and scatter when there are
        several (:func:`copy_rows`), and None is returned. ``previous``: background copies into these rows that may still be
        queued; they are promoted and waited for first, so copies into a row land in order. ``pause``:
        a stopwatch, stopped while the copies themselves run (they are not bookkeeping), and started again after
        them unless ``resume`` is false (the caller runs device work next, then starts it)."""
        for t in previous or ():
            if not t.done:
                with self._lock:
                    if not t.taken and t.priority > ON_DEMAND:
                        t.priority = ON_DEMAND
                        heapq.heappush(self._heap, (ON_DEMAND, t.seq, t))
                        self._wake_loop()
                t.wait()
        n = len(rows)
        self.copies += n
        if pause is not None:
            pause.stop()
        try:
            if self.stream is None:
                if self.delay_s:
                    time.sleep(self.delay_s * n)
                start = pause.at if pause is not None and not self.delay_s else self.timer.mark()  # (the same instant)
                copy_rows(dst_table, src_table, layer, rows, experts)
                self.timer.add_copies("fetch", step, layer, experts, start, self.timer.mark())
                return None
            ends = []
            with self._stream_lock:
                back = self._to_copy_stream()
                try:
                    for i in range(n):
                        if self.delay_s:
                            time.sleep(self.delay_s)
                        if after is not None and after[i] is not None:
                            self.stream.wait_event(after[i])
                        start = self.timer.mark(self.stream)
                        dst_table[rows[i]].copy_(src_table[layer, experts[i]], non_blocking=True)
                        end = self.timer.mark(self.stream)
                        self.timer.add_copies("fetch", step, layer, experts[i:i + 1], start, end)
                        ends.append(end)
                finally:
                    torch.cuda.set_stream(back)
            return ends
        finally:
            if pause is not None and resume:
                pause.start()

    def copy_one(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> tuple:
        """One on-demand copy issued by the calling thread (a staging turn's): as :meth:`issue_now` for a single
        copy into a buffer no background copy writes, recording nothing; returns its (start, end) stamps.
        On CUDA it is queued on the copy stream after the event ``after``."""
        self.copies += 1
        if self.stream is None:
            if self.delay_s:
                time.sleep(self.delay_s)
            start = self.timer.mark()
            dst.copy_(src)
            return start, self.timer.mark()
        with self._stream_lock:
            back = self._to_copy_stream()
            try:
                if self.delay_s:
                    time.sleep(self.delay_s)
                if after is not None:
                    self.stream.wait_event(after)
                start = self.timer.mark(self.stream)
                dst.copy_(src, non_blocking=True)
                return start, self.timer.mark(self.stream)
            finally:
                torch.cuda.set_stream(back)

    def _to_copy_stream(self) -> "torch.cuda.Stream":
        """CUDA: make the copy stream this thread's current one (copies go on the current stream); returns the
        stream to make current again. ``with torch.cuda.stream(s)`` does the same, but it asks twice whether
        CUDA is available, about 12 us a time (benchmarks/cuda_host_calls.py: 'stream context' against
        'set_stream pair'; on the H200 15.0 against 2.4 us)."""
        back = self.home if self.home is not None else torch.cuda.current_stream(self._index)
        torch.cuda.set_stream(self.stream)
        return back

    def wait_any(self, tickets: list[CopyTicket]) -> None:
        """Block until at least one of ``tickets`` is done."""
        self._wait_until(lambda: any(t.done for t in tickets))
        self._raise()

    def wait_rows(self, inflight, rows) -> None:
        """Block until a copy into one of ``rows`` (a few row indices) lands and leaves it with none in flight."""
        self._wait_until(lambda: not all(inflight[r] > 0 for r in rows))
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"a copy failed: {self.error}") from self.error

    def _next(self) -> CopyTicket | None:
        while True:
            with self._lock:
                while self._heap:
                    _, _, t = heapq.heappop(self._heap)
                    if not t.taken:  # a promoted ticket is queued twice
                        t.taken = True
                        return t
                if self._closed:
                    return None
                self._idle = True
            self._bell.get()  # rung by the next submission (or close)

    def _land(self, t: CopyTicket, i: int) -> None:
        self.timer.add_copy(t, i)
        with self._lock:
            if t.inflight is not None:
                t.inflight[t.rows[i]] -= 1
            t.landed += 1
            self._notify()

    def _preempted(self, t: CopyTicket) -> bool:
        """Between two copies of a background request: is a higher-priority request waiting? Then the
        rest of ``t`` goes back to the queue (in its place) and the waiting one goes first."""
        with self._lock:
            if not (self._heap and self._heap[0][0] < t.priority):
                return False
            t.taken = False
            heapq.heappush(self._heap, (t.priority, t.seq, t))
            return True

    def _loop(self) -> None:
        if self.stream is not None:  # (this thread queues nothing but copies)
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.stream)
        while (t := self._next()) is not None:
            try:
                n = len(t.dsts)
                batch = t.priority == ON_DEMAND  # issued back to back; background copies one at a time
                first = t.next
                if self._copy_at_once(t, first, n):
                    continue  # landed and done
                self._copy_each(t, first, n, batch)
                if t.next < n:
                    continue  # preempted: resumed later
                self.copies += n
            except BaseException as exc:  # reported to whoever waits for the ticket
                t.error = exc
                self.error = self.error or exc
            with self._lock:
                self._done(t)

    def _done(self, t: CopyTicket) -> None:
        """``t`` is done (under ``_lock``)."""
        t.done = True
        self._open -= 1
        self._notify()

    def _copy_at_once(self, t: CopyTicket, first: int, n: int) -> bool:
        """The CPU device: the rest of a background request whose copies all come from one layer of the host
        store, copied back to back (:func:`copy_rows`), landed together and the request done (one hand-over
        to the waiters), unless an on-demand request waits (then copy by copy, as on CUDA) or copies are
        delayed (tests)."""
        if self.stream is not None or self.delay_s or t.src_table is None or n - first < 2:
            return False
        layers, experts = t.srcs
        layer = layers[first]
        if layers[first:n].count(layer) != n - first:  # copies from another layer too
            return False
        with self._lock:
            if self._heap and self._heap[0][0] < t.priority:
                return False
        dst_table, src_table = t.src_table
        start = self.timer.mark()
        copy_rows(dst_table, src_table, layer, t.dsts[first:n], experts[first:n])
        end = self.timer.mark()
        t.starts.extend([start] * (n - first))
        t.ends.extend([end] * (n - first))
        t.next = n
        self.timer.add_copy_range(t, first, n)
        self.copies += n
        with self._lock:
            if t.inflight is not None:
                np.subtract.at(t.inflight, t.rows[first:n], 1)
            t.landed += n - first
            self._done(t)
        return True

    def _copy_each(self, t: CopyTicket, first: int, n: int, batch: bool) -> None:
        """Copies ``first``.. of a request one by one (a background one yields to on-demand requests between
        two copies)."""
        dsts, srcs = t.dsts, t.srcs
        if t.src_table is not None:  # (dst table, src table) and indices
            dst_table, src_table = t.src_table
            layers, experts = srcs
            dsts = [dst_table[i] for i in dsts[first:n]]
            srcs = [src_table[a, b] for a, b in zip(layers[first:n], experts[first:n])]
            dsts, srcs = [None] * first + dsts, [None] * first + srcs
        for i in range(first, n):
            if i > first and not batch and self._preempted(t):
                break
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.stream is not None:
                with self._stream_lock:  # (the copy stream is this thread's current one: _loop)
                    if t.after is not None and t.after[i] is not None:
                        self.stream.wait_event(t.after[i])
                    t.starts.append(self.timer.mark(self.stream))
                    dsts[i].copy_(srcs[i], non_blocking=True)
                    t.ends.append(self.timer.mark(self.stream))
                if not batch:
                    t.ends[i].synchronize()
            else:
                t.starts.append(self.timer.mark())
                dsts[i].copy_(srcs[i])
                t.ends.append(self.timer.mark())
            t.next = i + 1
            if not batch or self.stream is None:
                self._land(t, i)
        if batch and self.stream is not None:
            for i in range(first, n):  # ... and land one by one
                t.ends[i].synchronize()
                self._land(t, i)

    def drain(self) -> None:
        """Wait until every submitted copy has landed."""
        self._wait_until(lambda: not self._open, errors=False)
        self._raise()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake_loop()
        self._thread.join()
