"""Host-to-accelerator copies: one thread issues them one at a time, on-demand before background.

The link model of the simulator (docs/simulator.md): on-demand copies go before prefetches and cache
swaps that have not started; a started copy is never preempted. The copy thread keeps a priority
queue (priority, then submission order), takes the first request, issues it (on CUDA on the copy
stream, from pinned memory, ``non_blocking=True``, bracketed by CUDA events), waits for it to land,
marks its :class:`CopyTicket` done and takes the next. Issuing one copy at a time is what makes the
priority real: a copy queued on a CUDA stream could not be overtaken any more.

Without CUDA the copy is a host ``copy_`` in the same thread (torch releases the GIL), so the code
path is the same. ``delay_s`` (tests) holds every copy back that long before it is issued, to check
that nothing computes from a slot whose copy has not landed.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time

import torch

from dali_exec.executor.timing import Timer
from dali_sim.sim.engine import Activity

ON_DEMAND, BACKGROUND = 0, 1  # lower first, as in the simulator's PCIe resource


class CopyTicket:
    """One requested copy; ``done`` is set once the bytes are in the destination."""

    __slots__ = ("dst", "src", "priority", "seq", "what", "after", "taken", "done", "error", "start", "end")

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, priority: int, seq: int, what: Activity,
                 after: "torch.cuda.Event | None"):
        self.dst, self.src, self.priority, self.seq, self.what, self.after = dst, src, priority, seq, what, after
        self.taken = False
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.start = self.end = None

    def is_done(self) -> bool:
        return self.done.is_set()

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise RuntimeError(f"copy {self.what.name()} failed: {self.error}") from self.error


class CopyEngine:
    """The copy lane (the simulator's ``pcie`` track)."""

    def __init__(self, stream: "torch.cuda.Stream | None", timer: Timer, *, delay_s: float = 0.0,
                 device: torch.device | None = None):
        self.stream = stream
        self.timer = timer
        self.delay_s = delay_s
        self.device = device
        self._cond = threading.Condition()
        self._heap: list[tuple[int, int, CopyTicket]] = []
        self._seq = itertools.count()
        self._closed = False
        self._open = 0  # submitted and not done
        self.copies = 0
        self._thread = threading.Thread(target=self._loop, name="dali-copy", daemon=True)
        self._thread.start()

    def submit(self, dst: torch.Tensor, src: torch.Tensor, priority: int, what: Activity, *,
               after: "torch.cuda.Event | None" = None, previous: CopyTicket | None = None) -> CopyTicket:
        """Queue ``dst.copy_(src)``. ``after``: a CUDA event the copy must wait for (the last compute
        that read ``dst``). ``previous``: the last copy into ``dst``; if it has not started and has a
        lower priority it is promoted, so it still lands before this one."""
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"copy {what.name()}: shapes/dtypes differ ({tuple(src.shape)} {src.dtype} -> "
                             f"{tuple(dst.shape)} {dst.dtype})")
        with self._cond:
            if self._closed:
                raise RuntimeError("copy engine is closed")
            t = CopyTicket(dst, src, priority, next(self._seq), what, after)
            if previous is not None and not previous.taken and previous.priority > priority:
                previous.priority = priority
                heapq.heappush(self._heap, (priority, previous.seq, previous))
            heapq.heappush(self._heap, (priority, t.seq, t))
            self._open += 1
            self._cond.notify_all()
        return t

    def wait_any(self, tickets: list[CopyTicket]) -> None:
        """Block until at least one of ``tickets`` is done."""
        with self._cond:
            while not any(t.done.is_set() for t in tickets):
                self._cond.wait()
        for t in tickets:
            if t.done.is_set() and t.error is not None:
                t.wait()  # raises

    def _next(self) -> CopyTicket | None:
        with self._cond:
            while True:
                while self._heap:
                    _, _, t = heapq.heappop(self._heap)
                    if not t.taken:  # a promoted ticket is queued twice
                        t.taken = True
                        return t
                if self._closed:
                    return None
                self._cond.wait()

    def _loop(self) -> None:
        if self.stream is not None:
            torch.cuda.set_device(self.device)
        while (t := self._next()) is not None:
            try:
                if self.delay_s:
                    time.sleep(self.delay_s)
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        if t.after is not None:
                            self.stream.wait_event(t.after)
                        t.start = self.timer.mark(self.stream)
                        t.dst.copy_(t.src, non_blocking=True)
                        t.end = self.timer.mark(self.stream)
                    t.end.synchronize()
                else:
                    t.start = self.timer.mark()
                    t.dst.copy_(t.src)
                    t.end = self.timer.mark()
                self.timer.add("pcie", t.what, t.start, t.end)
                self.copies += 1
            except BaseException as exc:  # reported to whoever waits for the ticket
                t.error = exc
            with self._cond:
                t.done.set()
                self._open -= 1
                self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every submitted copy has landed."""
        with self._cond:
            while self._open:
                self._cond.wait()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
