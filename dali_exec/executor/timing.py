"""Clocks of a run: host wall clock everywhere, CUDA events for work queued on CUDA streams.

``Timer.mark(stream)`` returns a time stamp: a recorded CUDA event for a CUDA stream (its time is
known once the stream has passed it), else ``perf_counter()`` now. Intervals are stored as pairs of
stamps and resolved to seconds since the run's start only at the end (:meth:`Timer.intervals`), so
recording never waits for the device.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from dali_sim.sim.engine import TRACKS, Activity, Interval


class Timer:
    def __init__(self, cuda_device: torch.device | None = None):
        self.cuda = cuda_device
        self._lock = threading.Lock()
        self._raw: list[tuple[str, Activity, object, object]] = []
        self.start()

    def start(self) -> None:
        """Zero both clocks (after synchronising the device)."""
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
            self._base = torch.cuda.Event(enable_timing=True)
            self._base.record(torch.cuda.current_stream(self.cuda))
            torch.cuda.synchronize(self.cuda)
        self.t0 = time.perf_counter()
        with self._lock:
            self._raw.clear()

    def now(self) -> float:
        """Host seconds since :meth:`start`."""
        return time.perf_counter() - self.t0

    def mark(self, stream: "torch.cuda.Stream | None" = None):
        if stream is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            return ev
        return time.perf_counter()

    def add(self, track: str, what: Activity, start, end) -> None:
        if track not in TRACKS:
            raise ValueError(f"unknown track {track!r}")
        with self._lock:
            self._raw.append((track, what, start, end))

    def add_copy(self, ticket, i: int) -> None:
        """Copy ``i`` of a copy request (``CopyTicket``): its interval on the ``pcie`` track, named when the
        intervals are read (the copy thread does no more than this)."""
        with self._lock:
            self._raw.append(("pcie", (ticket, i), ticket.starts[i], ticket.ends[i]))

    def add_group(self, track: str, step: int, layer: int, experts: np.ndarray, tokens: np.ndarray, start,
                  end) -> None:
        """One grouped call computing ``experts`` (with ``tokens`` rows each) between two stamps. The
        timeline gets one interval per expert: the call's span divided in proportion to the rows, in
        the call's order (only the span is measured; the split is an attribution)."""
        if track not in TRACKS:
            raise ValueError(f"unknown track {track!r}")
        with self._lock:
            self._raw.append((track, (step, layer, experts, tokens), start, end))

    def seconds(self, stamp) -> float:
        if isinstance(stamp, float):
            return stamp - self.t0
        return self._base.elapsed_time(stamp) * 1e-3  # ms since the base event

    def intervals(self) -> list[Interval]:
        """Every recorded interval in seconds since the start (call after the device is synchronised)."""
        with self._lock:
            raw = list(self._raw)
        out = []
        for track, what, a, b in raw:
            a, b = self.seconds(a), self.seconds(b)
            if isinstance(what, Activity):
                out.append(Interval(track, what.name(), a, b, what.args()))
                continue
            if len(what) == 2:  # (copy request, index)
                act = what[0].activity(what[1])
                out.append(Interval(track, act.name(), a, b, act.args()))
                continue
            step, layer, experts, tokens = what
            share = np.asarray(tokens, float)
            cuts = a + (b - a) * np.concatenate([[0.0], np.cumsum(share)]) / max(share.sum(), 1.0)
            cuts[-1] = b
            for e, n, lo, hi in zip(np.asarray(experts).tolist(), np.asarray(tokens).tolist(), cuts[:-1].tolist(),
                                    cuts[1:].tolist()):
                act = Activity("expert", step, layer, e, tokens=n)
                out.append(Interval(track, act.name(), lo, hi, act.args() | {"group": len(experts)}))
        out.sort(key=lambda iv: (iv.start, iv.track))
        return out


class Stopwatch:
    """Wall-clock and thread-CPU seconds accumulated while running; stopped around work that is not
    being measured (computes, copies, waits). CPU time is what the measured code itself costs; wall
    time also counts the thread being descheduled or waiting for the GIL (on a busy machine: more)."""

    __slots__ = ("wall", "cpu", "_wall0", "_cpu0")

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self._wall0 = self._cpu0 = 0.0

    def start(self) -> "Stopwatch":
        self._wall0, self._cpu0 = time.perf_counter(), time.thread_time()
        return self

    def stop(self) -> None:
        self.wall += time.perf_counter() - self._wall0
        self.cpu += time.thread_time() - self._cpu0
