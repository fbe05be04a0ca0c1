"""Rate-shared lanes in SimPy: each lane runs one activity at a time, at a rate set by contention.

An activity has *work*: the seconds it takes alone. While it runs, it progresses at the rate the
:class:`~dali_sim.hardware.contention.Contention` model gives its lane for the current set of busy
lanes; rates are constant between events (an activity starting or ending), so the simulation stays
coarse: a timer and an end event per activity (:class:`FluidLanes`).

Without contention (``contention=None``) an activity is a plain ``env.timeout(work)``. With a model that
cannot slow the lanes at the largest demands the engine announces, every rate stays 1 and the lanes skip
the rates (*unit rates*, the same arithmetic).
"""

from __future__ import annotations

from typing import Mapping

import simpy

from dali_sim.hardware.contention import Contention

_LANE_ORDER = {"gpu": 0, "cpu": 1, "h2d": 2}
_EPS = 1e-12  # relative work left below which an activity counts as finished (rounding of rate x time)


class _Job:
    __slots__ = ("lane", "order", "work", "left", "demand", "rate", "done")

    def __init__(self, lane: str, work: float, demand: float, done: simpy.Event):
        self.lane, self.work, self.left, self.demand, self.rate, self.done = lane, work, work, demand, 1.0, done
        self.order = _LANE_ORDER[lane]


class FluidLanes:
    """Activities on the lanes ``gpu``, ``cpu`` and ``h2d`` of one engine.

    Scheduling: one live timer, at the earliest end of a running activity at the current rates. Starting
    an activity brings every activity's work left up to now, sets the rates anew and re-arms the timer
    (the timer it replaces fires later and is ignored); the timer's callback ends what has finished (in
    lane order), sets the rates anew and arms the next one. No process, no wake-up event: two SimPy events
    per activity (its timer, its end).

    This gives the times and the order of events of a scheduler process waiting on ``timer | wake-up``
    (the form before; tests/test_sim_fluid_reference.py keeps it as the reference) provided nothing but
    the lanes' own timers is scheduled ahead of now while activities run, as in the engine: its layers
    wait only for activities, resources and each other, and a layer computed directly (one timeout)
    runs only while the lanes are idle. The timer's end then comes first at its time, so ending
    activities in its callback instead of a round later puts nothing else in between."""

    def __init__(self, env: simpy.Environment, contention: Contention | None,
                 max_demand: Mapping[str, float] | None = None):
        """``max_demand``: the largest demand any activity on each lane will draw, if known. When the model
        cannot slow lanes busy with these demands, every rate is 1 for the whole run: the lanes then skip
        the rates (the same arithmetic: ``x * 1.0`` and ``x / 1.0`` are ``x``); an activity drawing more
        is an error."""
        self.env = env
        self.contention = contention
        self.max_demand = dict(max_demand) if max_demand is not None else None
        #: every rate is 1 whatever runs (the model cannot slow these lanes)
        self.unit = contention is not None and max_demand is not None and not contention.interferes(max_demand)
        self.jobs: dict[str, _Job] = {}
        self._t = 0.0
        self._timer: simpy.Event | None = None  # the live timer
        self._timer_at = 0.0  # when it fires
        self._first: _Job | None = None  # the activity it is for
        self._rates: dict[tuple, dict[str, float]] = {}  # contention rates by the busy lanes' (lane, demand)
        self.slowed_s = dict.fromkeys(_LANE_ORDER, 0.0)  # extra seconds activities took because of contention

    def run(self, lane: str, work: float, demand: float = 0.0) -> simpy.Event:
        """Start an activity of ``work`` seconds (alone) on ``lane``, drawing ``demand`` bytes/s of host
        memory alone; the event fires when it is done. ``lane`` must be idle."""
        if lane in self.jobs:
            raise AssertionError(f"lane {lane} already runs an activity")
        if self.contention is None or work <= 0:
            return self.env.timeout(max(work, 0.0))
        job = _Job(lane, work, demand, self.env.event())
        if self.unit:
            if demand > self.max_demand.get(lane, 0.0):
                raise AssertionError(f"lane {lane}: an activity draws {demand} B/s, above the {self.max_demand} "
                                     "the lanes were set up for")
            self._sync_unit()
            self.jobs[lane] = job
        else:
            self._sync()
            self.jobs[lane] = job
            self._rerate()
        self._arm()
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
        now = self.env.now
        dt = now - self._t
        if dt > 0:
            slowed = self.slowed_s
            for j in self.jobs.values():
                j.left -= dt * j.rate
                slowed[j.lane] += dt * (1.0 - j.rate)
        self._t = now

    def _sync_unit(self) -> None:
        """:meth:`_sync` with every rate 1 (nothing is slowed)."""
        now = self.env.now
        dt = now - self._t
        if dt > 0:
            for j in self.jobs.values():
                j.left -= dt
        self._t = now

    def _rerate(self) -> None:
        jobs = self.jobs.values()
        key = tuple([(j.lane, j.demand) for j in jobs])
        rates = self._rates.get(key)
        if rates is None:
            rates = self._rates[key] = self.contention.rates({j.lane: j.demand for j in jobs})
        for j in jobs:
            j.rate = rates[j.lane]

    def _arm(self) -> None:
        """The live timer: the earliest end at the current rates (ties to the lane order). A timer already
        armed for the same activity at the same time stays (nothing else is scheduled ahead of now while
        activities run, so which of two equal timers fires makes no difference)."""
        first, first_end = None, 0.0
        for j in self.jobs.values():
            end = j.left / j.rate
            if first is None or end < first_end or (end == first_end and j.order < first.order):
                first, first_end = j, end
        delay = max(0.0, first_end)
        env = self.env
        at = env.now + delay
        if first is self._first and self._timer is not None and at == self._timer_at:
            return
        self._first, self._timer_at = first, at
        self._timer = timer = env.timeout(delay)
        timer.callbacks.append(self._round)

    def _round(self, timer: simpy.Event) -> None:
        """The live timer fired: what has finished ends (in lane order), rates are set anew, the next
        timer is armed. A replaced timer does nothing."""
        if timer is not self._timer:
            return
        unit = self.unit
        if unit:
            self._sync_unit()
        else:
            self._sync()
        first = self._first
        jobs = self.jobs
        done = [j for j in jobs.values() if j is first or j.left <= _EPS * j.work]
        if len(done) > 1:
            done.sort(key=lambda j: j.order)
        for j in done:
            del jobs[j.lane]
            j.done.succeed()
        self._timer = None
        if jobs:
            if not unit:
                self._rerate()
            self._arm()


__all__ = ["FluidLanes"]
