"""Rate-shared lanes in SimPy: each lane runs one activity at a time, at a rate set by contention.

An activity has *work*: the seconds it takes alone. While it runs, it progresses at the rate the
:class:`~dali_sim.hardware.contention.Contention` model gives its lane for the current set of busy
lanes; rates are constant between events (an activity starting or ending), so the simulation stays
coarse: one event per activity start and end, plus one wake-up of the scheduler per change.

Without contention (``contention=None`` or a model that never interferes for the lanes at hand) an
activity is a plain ``env.timeout(work)``, so results are bit-for-bit those of the model without it.
"""

from __future__ import annotations

from typing import Mapping

import simpy

from dali_sim.hardware.contention import Contention

_LANE_ORDER = {"gpu": 0, "cpu": 1, "h2d": 2}
_EPS = 1e-12  # relative work left below which an activity counts as finished (rounding of rate x time)


class _Job:
    __slots__ = ("lane", "work", "left", "demand", "rate", "done")

    def __init__(self, lane: str, work: float, demand: float, done: simpy.Event):
        self.lane, self.work, self.left, self.demand, self.rate, self.done = lane, work, work, demand, 1.0, done


class FluidLanes:
    """Activities on the lanes ``gpu``, ``cpu`` and ``h2d`` of one engine.

    The scheduler is a chain of SimPy events with callbacks, not a process: each round arms a timer (the
    next activity to finish at the current rates) and a *hop* event that the first of the timer and the
    wake-up (an activity starting) to be processed schedules; the round's work runs when the hop is
    processed. These are the events a process waiting on ``timer | wake`` would schedule, in the same
    order, so every other event keeps its place in SimPy's queue (same times, same ties), without the
    cost of a process and a condition per round."""

    def __init__(self, env: simpy.Environment, contention: Contention | None):
        self.env = env
        self.contention = contention
        self.jobs: dict[str, _Job] = {}
        self._t = 0.0
        self._wake = env.event()
        self._wake_hooked = False  # the current wake-up has the scheduler's callback
        self._timer: simpy.Event | None = None
        self._hop: simpy.Event | None = None
        self._first: _Job | None = None
        self._running = False
        self._rates: dict[tuple, dict[str, float]] = {}  # contention rates by the busy lanes' (lane, demand)
        self.slowed_s = dict.fromkeys(_LANE_ORDER, 0.0)  # extra seconds activities took because of contention

    def run(self, lane: str, work: float, demand: float = 0.0) -> simpy.Event:
        """Start an activity of ``work`` seconds (alone) on ``lane``, drawing ``demand`` bytes/s of host
        memory alone; the event fires when it is done. ``lane`` must be idle."""
        if lane in self.jobs:
            raise AssertionError(f"lane {lane} already runs an activity")
        if self.contention is None or work <= 0:
            return self.env.timeout(max(work, 0.0))
        self._sync()
        job = _Job(lane, work, demand, self.env.event())
        self.jobs[lane] = job
        self._rerate()
        if not self._running:
            self._running = True
            start = simpy.Event(self.env)  # as a process's start: urgent, at once
            start._ok, start._value = True, None
            start.callbacks.append(self._round)
            self.env.schedule(start, simpy.events.URGENT)
        elif not self._wake.triggered:
            self._wake.succeed()
        return job.done

    def would_interfere(self, busy: Mapping[str, float]) -> bool:
        """Could lanes with these (maximum) demands slow each other, together with what runs now?"""
        if self.contention is None:
            return False
        merged = {j.lane: j.demand for j in self.jobs.values()}
        for lane, d in busy.items():
            merged[lane] = max(d, merged.get(lane, 0.0))
        return self.contention.interferes(merged)

    @property
    def idle(self) -> bool:
        return not self.jobs

    def _sync(self) -> None:
        dt = self.env.now - self._t
        if dt > 0:
            for j in self.jobs.values():
                j.left -= dt * j.rate
                self.slowed_s[j.lane] += dt * (1.0 - j.rate)
        self._t = self.env.now

    def _rerate(self) -> None:
        key = tuple((j.lane, j.demand) for j in self.jobs.values())
        rates = self._rates.get(key)
        if rates is None:
            rates = self._rates[key] = self.contention.rates({j.lane: j.demand for j in self.jobs.values()})
        for j in self.jobs.values():
            j.rate = rates[j.lane]

    def _fire(self, event: simpy.Event) -> None:
        """The timer or the wake-up of the current round was processed: the round's hop is scheduled
        (once; a stale timer or wake-up of an earlier round does nothing)."""
        if (event is self._timer or event is self._wake) and not self._hop.triggered:
            self._hop.succeed()

    def _arm(self) -> None:
        """Wait for the next activity to finish at the current rates, or for a new one to start."""
        env = self.env
        first = None
        for j in self.jobs.values():  # the earliest end; ties to the lane order
            if first is None or (j.left / j.rate, _LANE_ORDER[j.lane]) < (first.left / first.rate,
                                                                          _LANE_ORDER[first.lane]):
                first = j
        self._first = first
        self._timer = timer = env.timeout(max(0.0, first.left / first.rate))
        self._hop = hop = simpy.Event(env)
        hop.callbacks.append(self._round)
        timer.callbacks.append(self._fire)
        if self._wake.callbacks is None:
            self._fire(self._wake)
        elif not self._wake_hooked:
            self._wake.callbacks.append(self._fire)
            self._wake_hooked = True

    def _round(self, _event: simpy.Event) -> None:
        """One round of the scheduler: activities that finished end (in lane order), rates are set anew
        and the next round is armed."""
        if self._timer is not None:  # not the first round
            if self._wake.triggered:
                self._wake = self.env.event()
                self._wake_hooked = False
            self._sync()
            first, timer_done = self._first, self._timer.callbacks is None
            done = [j for j in self.jobs.values() if j.left <= _EPS * j.work or (j is first and timer_done)]
            for j in sorted(done, key=lambda j: _LANE_ORDER[j.lane]):
                del self.jobs[j.lane]
                j.done.succeed()
            if done and self.jobs:
                self._rerate()
        if self.jobs:
            self._arm()
        else:
            self._running = False
            self._timer = None


__all__ = ["FluidLanes"]
