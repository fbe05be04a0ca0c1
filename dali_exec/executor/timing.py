"""Clocks of a run: host wall clock everywhere, CUDA events for work queued on CUDA streams.

``Timer.mark(stream)`` returns a time stamp: a recorded CUDA event for a CUDA stream (its time is
known once the stream has passed it), else ``perf_counter()`` now. Intervals are stored as pairs of
stamps and resolved to seconds since the run's start only at the end (:meth:`Timer.intervals`), so
recording never waits for the device.

A CUDA event is created on the device at its first record, which costs about as much host time again as
the record (benchmarks/cuda_host_calls.py on the H200: 5.8 us a new event recorded, 2.7 us one made
before). So :meth:`Timer.start` makes the run's events ahead (``ahead``: the driver's estimate of its
stamps), each recorded once; a stamp takes one of them and only when they run out makes a new one. Each
event is a stamp once: a run's intervals keep their stamps until they are read.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Sequence
from contextlib import contextmanager

import numpy as np
import torch

from dali_sim.sim.engine import TRACKS, Activity, Interval


#: at most this many events made ahead by :meth:`Timer.start` (about 0.4 s of host time on the H200)
MAX_AHEAD = 1 << 16


def stamps_ahead(visits: int, experts_per_visit: int) -> int:
    """An estimate of a run's CUDA stamps for :meth:`Timer.start`: two per expert computed or copied a layer
    visit (a compute's or copy's start and end; a group shares its pair), and a few for the dense part."""
    return min(MAX_AHEAD, max(0, visits) * (2 * max(0, experts_per_visit) + 8))


class Timer:
    def __init__(self, cuda_device: torch.device | None = None, *, event=None):
        """``event`` (tests): the CUDA event class, ``torch.cuda.Event`` by default."""
        self.cuda = cuda_device
        self._event = event if event is not None else torch.cuda.Event
        self._stock: list = []  # events made ahead (recorded once), taken by mark()
        self._lock = threading.Lock()
        self._raw: list[tuple[str, Activity, object, object]] = []
        self.start()

    def start(self, ahead: int = 0) -> None:
        """Zero both clocks (after synchronising the device); on CUDA first make ``ahead`` events for the run's
        stamps (:func:`stamps_ahead`; at most :data:`MAX_AHEAD`), so that a stamp costs one record."""
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
            stream = torch.cuda.current_stream(self.cuda)
            self._make_ahead(min(ahead, MAX_AHEAD), stream)
            self._base = self._event(enable_timing=True)
            self._base.record(stream)
            torch.cuda.synchronize(self.cuda)
        self.t0 = time.perf_counter()
        with self._lock:
            self._raw.clear()

    def clear(self) -> None:
        """Drop the recorded stamps and the events made ahead: a finished run's records hold its copies' tickets,
        hence its slot buffers (a result's unread intervals keep their own copy: :class:`LazyIntervals`)."""
        with self._lock:
            self._raw.clear()
        self._stock.clear()

    def _make_ahead(self, n: int, stream) -> None:
        """At least ``n`` unused events in stock, the new ones recorded once on ``stream`` (which creates them)."""
        make, stock = self._event, self._stock
        for _ in range(n - len(stock)):
            ev = make(enable_timing=True)
            ev.record(stream)
            stock.append(ev)

    def now(self) -> float:
        """Host seconds since :meth:`start`."""
        return time.perf_counter() - self.t0

    def mark(self, stream: "torch.cuda.Stream | None" = None):
        if stream is not None:
            try:
                ev = self._stock.pop()  # (atomic: the copy thread stamps too)
            except IndexError:
                ev = self._event(enable_timing=True)
            ev.record(stream)
            return ev
        return time.perf_counter()

    def add(self, track: str, what: Activity, start, end) -> None:
        if track not in TRACKS:
            raise ValueError(f"unknown track {track!r}")
        with self._lock:
            self._raw.append((track, what, start, end))

    def add_activity(self, track: str, kind: str, step: int, layer: int, start, end) -> None:
        """:meth:`add` of ``Activity(kind, step, layer)``, made when the intervals are read."""
        with self._lock:
            self._raw.append((track, (kind, step, layer), start, end))

    def add_copy(self, ticket, i: int) -> None:
        """Copy ``i`` of a copy request (``CopyTicket``): its interval on the ``pcie`` track, named when the
        intervals are read (the copy thread does no more than this)."""
        with self._lock:
            self._raw.append(("pcie", (ticket, i), ticket.starts[i], ticket.ends[i]))

    def add_copy_range(self, ticket, first: int, n: int) -> None:
        """:meth:`add_copy` of copies ``first`` .. ``n - 1`` of a request, under one lock."""
        with self._lock:
            self._raw.extend(("pcie", (ticket, i), ticket.starts[i], ticket.ends[i]) for i in range(first, n))

    def add_copies(self, kind: str, step: int, layer: int, experts: list[int], start, end) -> None:
        """Copies of ``experts`` (of ``layer``) made by one call between two stamps (the CPU device's batched
        on-demand copies): one ``pcie`` interval each, the span divided equally (an attribution)."""
        with self._lock:
            self._raw.append(("pcie", (kind, step, layer, experts), start, end))

    def add_turns(self, loop: "TurnLoop") -> None:
        """A layer's loop of one-expert staging turns (:class:`TurnLoop`), recorded as it starts: its stamp lists
        may still be filled (by the loop) until the intervals are read."""
        with self._lock:
            self._raw.append((None, loop, None, None))

    def add_group(self, track: str, step: int, layer: int, experts: np.ndarray, tokens: np.ndarray, start,
                  end) -> None:
        """One grouped call computing ``experts`` (with ``tokens`` rows each) between two stamps. The
        timeline gets one interval per expert: the call's span divided in proportion to the rows, in
        the call's order (only the span is measured; the split is an attribution)."""
        if track not in TRACKS:
            raise ValueError(f"unknown track {track!r}")
        with self._lock:
            self._raw.append((track, (step, layer, experts, tokens), start, end))

    def add_group_open(self, track: str, step: int, layer: int, experts, tokens) -> list:
        """:meth:`add_group` made before the call: the record, whose items 2 and 3 the caller sets to the call's
        (start, end) stamps as it takes them (before the intervals are read)."""
        if track not in TRACKS:
            raise ValueError(f"unknown track {track!r}")
        rec = [track, (step, layer, experts, tokens), None, None]
        with self._lock:
            self._raw.append(rec)
        return rec

    def seconds(self, stamp, origin: tuple | None = None) -> float:
        """A stamp in seconds since the start (``origin``: the (host time, base event) of another start)."""
        t0, base = origin if origin is not None else (self.t0, getattr(self, "_base", None))
        if isinstance(stamp, float):
            return stamp - t0
        return base.elapsed_time(stamp) * 1e-3  # ms since the base event

    def intervals(self) -> list[Interval]:
        """Every recorded interval in seconds since the start (call after the device is synchronised)."""
        return self._resolve(self._snapshot())

    def _snapshot(self) -> list:
        with self._lock:
            return list(self._raw)

    def summary(self) -> tuple[dict[str, float], int, "LazyIntervals"]:
        """(busy seconds per track, number of intervals, the intervals to be resolved when first read): what a
        run's result needs, without building an interval per expert unless someone reads them (a timeline);
        call after the device is synchronised."""
        raw = self._snapshot()
        busy = dict.fromkeys(TRACKS, 0.0)
        count = 0
        seconds = self.seconds
        for track, what, a, b in raw:
            if isinstance(what, TurnLoop):
                for track, experts, _, starts, ends in what.series():
                    busy[track] += sum(seconds(e) - seconds(s) for s, e in zip(starts, ends))
                    count += len(experts)
                continue
            busy[track] += seconds(b) - seconds(a)  # a group's or a batch's intervals split its span exactly
            count += 1 if isinstance(what, Activity) or len(what) < 4 else len(what[-1] if isinstance(what[0], str)
                                                                            else what[2])
        return busy, count, LazyIntervals(self, raw, (self.t0, getattr(self, "_base", None)))

    def _resolve(self, raw: list, origin: tuple | None = None) -> list[Interval]:
        out = []
        seconds = self.seconds
        for track, what, a, b in raw:
            if isinstance(what, TurnLoop):
                out += what.intervals(lambda stamp: seconds(stamp, origin))
                continue
            a, b = seconds(a, origin), seconds(b, origin)
            if isinstance(what, Activity):
                out.append(Interval(track, what.name(), a, b, what.args()))
                continue
            if len(what) == 3:  # (kind, step, layer)
                act = Activity(*what)
                out.append(Interval(track, act.name(), a, b, act.args()))
                continue
            if len(what) == 2:  # (copy request, index)
                act = what[0].activity(what[1])
                out.append(Interval(track, act.name(), a, b, act.args()))
                continue
            if isinstance(what[0], str):  # (kind, step, layer, experts): copies made by one call
                kind, step, layer, experts = what
                cuts = np.linspace(a, b, len(experts) + 1).tolist()
                for e, lo, hi in zip(experts, cuts[:-1], cuts[1:]):
                    act = Activity(kind, step, layer, int(e))
                    out.append(Interval(track, act.name(), lo, hi, act.args() | {"batch": len(experts)}))
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


class TurnLoop:
    """A layer's loop of one-expert staging turns cycling through ``halves`` buffers, as the timeline records it
    (:meth:`Timer.add_turns`: one entry for both tracks, as each object a visit keeps to the end costs the visit's
    later allocations fresh memory): ``starts[i]`` .. ``ends[i]`` the compute of ``experts[i]`` (a grouped call of
    that one expert with ``tokens[i]`` rows, on ``gpu``, as :meth:`Timer.add_group` records it), and
    ``copy_starts[i]`` .. ``copy_ends[i]`` the copy of ``experts[halves + i]`` (a ``pcie`` fetch of one expert, as
    :meth:`Timer.add_copies` records a single copy) into the buffer turn i computed from; the loop fills the four
    lists."""

    __slots__ = ("step", "layer", "experts", "tokens", "halves", "starts", "ends", "copy_starts", "copy_ends")

    def __init__(self, step: int, layer: int, experts: list[int], tokens: list[int], halves: int):
        self.step, self.layer, self.experts, self.tokens, self.halves = step, layer, experts, tokens, halves
        self.starts, self.ends, self.copy_starts, self.copy_ends = [], [], [], []

    def series(self):
        """(track, experts, tokens or None, starts, ends) of each track with intervals."""
        out = [("gpu", self.experts, self.tokens, self.starts, self.ends)]
        if len(self.experts) > self.halves:
            out.append(("pcie", self.experts[self.halves:], None, self.copy_starts, self.copy_ends))
        return out

    def intervals(self, seconds) -> list[Interval]:
        out = []
        for track, experts, tokens, starts, ends in self.series():
            for i, e in enumerate(experts):
                a, b = seconds(starts[i]), seconds(ends[i])
                if tokens is None:
                    act = Activity("fetch", self.step, self.layer, int(e))
                    out.append(Interval(track, act.name(), a, b, act.args() | {"batch": 1}))
                else:
                    act = Activity("expert", self.step, self.layer, int(e), tokens=int(tokens[i]))
                    out.append(Interval(track, act.name(), a, b, act.args() | {"group": 1}))
        return out


class LazyIntervals(Sequence):
    """A run's intervals (:meth:`Timer.intervals`), resolved from the recorded stamps when first read."""

    def __init__(self, timer: Timer, raw: list, origin: tuple):
        self._timer, self._raw, self._origin, self._items = timer, raw, origin, None  # origin: the run's start

    def _get(self) -> list[Interval]:
        if self._items is None:
            self._items = self._timer._resolve(self._raw, self._origin)
            self._raw, self._timer = [], None  # the stamps' copy tickets and the timer hold the run's buffers
        return self._items

    def __len__(self) -> int:
        return len(self._get())

    def __getitem__(self, i):
        return self._get()[i]

    def __iter__(self):
        return iter(self._get())

    def __eq__(self, other) -> bool:
        return list(self._get()) == list(other)

    def __repr__(self) -> str:
        return repr(self._get())


@contextmanager
def paused_gc():
    """Python's cyclic garbage collector paused while a run's loop lasts (and restored after).

    A loop of layer visits allocates enough small objects (plans, views, index arrays) to start a collection
    about once per visit, and now and then a full one that walks every object of the process (a
    transformers model: half a million, about 80 ms here): pauses of the host in the middle of a layer,
    several times the work being scheduled. The loop makes no reference cycles of its own; what cycles
    exist are collected once the collector is back."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class LayerSeconds:
    """Per-layer sums of stopwatch readings (wall clock and thread CPU) in Python floats: added to once or
    more per layer visit, read as arrays once at the end."""

    __slots__ = ("wall", "cpu")

    def __init__(self, num_layers: int):
        self.wall = [0.0] * num_layers
        self.cpu = [0.0] * num_layers

    def add(self, layer: int, sw: "Stopwatch") -> None:
        self.wall[layer] += sw.wall
        self.cpu[layer] += sw.cpu

    def sum_at(self, layer: int, other: "LayerSeconds") -> tuple[float, float]:
        """(wall, thread CPU) seconds of ``layer`` so far, this one's and ``other``'s together."""
        return self.wall[layer] + other.wall[layer], self.cpu[layer] + other.cpu[layer]

    def add_wall(self, layer: int, seconds: float) -> None:
        self.wall[layer] += seconds

    def array(self) -> np.ndarray:
        """(2, L): wall clock, thread CPU."""
        return np.array([self.wall, self.cpu])


class Stopwatch:
    """Wall-clock and thread-CPU seconds accumulated while running; stopped around work that is not
    being measured (computes, copies, waits). CPU time is what the measured code itself costs; wall
    time also counts the thread being descheduled or waiting for the GIL (on a busy machine: more).
    ``at``: the wall-clock reading (``perf_counter``, the host stamps' clock) of its last start, stop or
    hand-over, for a caller that stamps the same instant (a timeline interval) without another reading."""

    __slots__ = ("wall", "cpu", "at", "_cpu0")

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.at = self._cpu0 = 0.0

    def start(self) -> "Stopwatch":
        self.at, self._cpu0 = time.perf_counter(), time.thread_time()
        return self

    def stop(self) -> None:
        wall = time.perf_counter()
        self.wall += wall - self.at
        self.cpu += time.thread_time() - self._cpu0
        self.at = wall

    def hand_to(self, other: "Stopwatch") -> "Stopwatch":
        """Stop this one and start ``other`` at the same instant, from one reading of each clock (the thread-CPU
        clock is a system call: adjacent segments share their boundary). Returns ``other``."""
        wall, cpu = time.perf_counter(), time.thread_time()
        self.wall += wall - self.at
        self.cpu += cpu - self._cpu0
        self.at = other.at = wall
        other._cpu0 = cpu
        return other
