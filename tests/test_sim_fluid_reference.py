"""FluidLanes against the scheduler it replaced: the same finish times, slowdowns and order of events.

:class:`ReferenceLanes` is the earlier scheduler, kept here as the reference: a SimPy process that
waits on ``timer | wake`` (a wake-up event per activity start, a condition and a hop per round).
:class:`~dali_sim.sim.fluid.FluidLanes` computes the same thing with one live timer re-armed when an
activity starts, two events per activity. Both run on random activity sets (activities that start
when others end, ties, zero works) under both contention models and with unit rates, and inside the
engine on synthetic traces whose cache ratios send most layers down the event-by-event path (``dali``,
``hybrimoe``): every result must be equal, bit for bit. The last test checks the new scheduler's
precondition on every event the engine schedules.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import simpy
from conftest import round_number_profile

from dali_sim.hardware.contention import MeasuredSlowdowns, SharedHostBandwidth
from dali_sim.hardware.profile import DEFAULT_HARDWARE
from dali_sim.sim import engine as engine_module
from dali_sim.sim.fluid import _EPS, _LANE_ORDER, FluidLanes, _Job
from dali_sim.sim.simulate import simulate
from dali_sim.trace.reader import read_meta
from dali_sim.trace.synth import SynthConfig, synthesize
from dali_sim.workload.profiling import ProfileSpec


class ReferenceLanes(FluidLanes):
    """The process-based scheduler (``FluidLanes`` before the single-timer rewrite), verbatim in its
    rules; ``slowest`` records the lowest rate any activity ran at (to check contention was exercised)."""

    slowest: list[float] = []

    def __init__(self, env, contention, max_demand=None):  # (always the full rate arithmetic)
        self.env, self.contention = env, contention
        self.jobs: dict[str, _Job] = {}
        self._t = 0.0
        self._wake = env.event()
        self._running = False
        self.slowed_s = dict.fromkeys(_LANE_ORDER, 0.0)

    def run(self, lane, work, demand=0.0):
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
            self.env.process(self._loop())
        elif not self._wake.triggered:
            self._wake.succeed()
        return job.done

    def _rerate(self):
        rates = self.contention.rates({j.lane: j.demand for j in self.jobs.values()})
        for j in self.jobs.values():
            j.rate = rates[j.lane]
        ReferenceLanes.slowest.append(min(rates.values()))

    def _loop(self):
        env = self.env
        while self.jobs:
            first = min(self.jobs.values(), key=lambda j: (j.left / j.rate, _LANE_ORDER[j.lane]))
            timer = env.timeout(max(0.0, first.left / first.rate))
            yield timer | self._wake
            if self._wake.triggered:
                self._wake = env.event()
            self._sync()
            done = [j for j in self.jobs.values() if j.left <= _EPS * j.work or (j is first and timer.processed)]
            for j in sorted(done, key=lambda j: _LANE_ORDER[j.lane]):
                del self.jobs[j.lane]
                j.done.succeed()
            if done and self.jobs:
                self._rerate()
        self._running = False


CONTENTION = {
    "bandwidth": SharedHostBandwidth(10.0),
    "measured": MeasuredSlowdowns({"cpu+h2d": {"cpu": 2.0, "h2d": 1.25}, "gpu+h2d": {"gpu": 1.0, "h2d": 1.5},
                                   "cpu+gpu": {"cpu": 1.1, "gpu": 1.3},
                                   "cpu+gpu+h2d": {"cpu": 2.5, "gpu": 1.2, "h2d": 1.75}}),
}


def _activity_log(lanes_class, contention, seed: int, max_demand=None):
    """Three processes, one per lane, each running 30 activities (works on a coarse grid, zero ones too);
    before one, a process may wait for another lane's running activity to end, so activities start when
    others end (ties). As in the engine, nothing is scheduled ahead of now but the lanes' own timers
    (the scheduler relies on it). Returns every (time, lane, index) in the order the processes saw
    their activities end, the lanes' slowed seconds and the lanes."""
    rng = np.random.default_rng(seed)
    env = simpy.Environment()
    lanes = lanes_class(env, contention, max_demand)
    log = []
    latest: dict[str, simpy.Event] = {}
    names = ("gpu", "cpu", "h2d")

    def worker(lane):
        for i in range(30):
            other = names[int(rng.integers(3))]
            if other != lane and other in latest and rng.random() < 0.6:
                yield latest[other]
            if rng.random() < 0.2:
                yield env.timeout(0)
            work = float(rng.choice([0.1, 0.25, 0.5, 1.0, 0.7, 1e-3, 0.0]))
            latest[lane] = done = lanes.run(lane, work, float(rng.choice([0.0, 4.0, 8.0])))
            yield done
            log.append((env.now, lane, i))

    for lane in names:
        env.process(worker(lane))
    env.run()
    return log, lanes.slowed_s, lanes


@pytest.mark.parametrize("model", sorted(CONTENTION))
@pytest.mark.parametrize("seed", range(10))
def test_same_activities_as_the_process_scheduler(model, seed):
    ReferenceLanes.slowest = []
    want, want_slowed, _ = _activity_log(ReferenceLanes, CONTENTION[model], seed)
    got, got_slowed, lanes = _activity_log(FluidLanes, CONTENTION[model], seed)
    assert not lanes.unit
    assert got == want
    assert got_slowed == want_slowed
    assert min(ReferenceLanes.slowest) < 1.0  # the lanes did slow each other


@pytest.mark.parametrize("seed", range(10))
def test_unit_rates_when_the_model_cannot_slow_these_demands(seed):
    """Demands of at most 8 B/s on three lanes never exceed 30 B/s: the lanes skip the rates, with the same
    times as the full arithmetic; an activity drawing more than announced is an error."""
    roomy, bound = SharedHostBandwidth(30.0), {"gpu": 8.0, "cpu": 8.0, "h2d": 8.0}
    ReferenceLanes.slowest = []
    want, want_slowed, _ = _activity_log(ReferenceLanes, roomy, seed)
    got, got_slowed, lanes = _activity_log(FluidLanes, roomy, seed, bound)
    assert lanes.unit and max(ReferenceLanes.slowest) == 1.0
    assert got == want
    assert got_slowed == want_slowed
    assert not FluidLanes(simpy.Environment(), SharedHostBandwidth(20.0), bound).unit  # 24 B/s could exceed 20
    with pytest.raises(AssertionError, match="above"):
        FluidLanes(simpy.Environment(), roomy, bound).run("cpu", 1.0, 9.0)


@pytest.fixture(scope="module")
def olmoe_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("fluid") / "olmoe.parquet"
    synthesize(SynthConfig(model="olmoe-1b-7b", sequences=8, prompt_len=4, gen_len=4, seed=5,
                           lookahead=("residual=0.9", "next-gate=0.75", "gate2=0.6@2", "gate3=0.5@3")),
               path, progress=False)
    return path


@pytest.fixture(scope="module")
def hardware(olmoe_trace, tmp_path_factory):
    """The default profile (shared host bandwidth: here never exceeded, every rate 1) and a measured one of
    round numbers (many activities end at the same time) whose copies and CPU experts slow each other."""
    slow = {"cpu+h2d": {"cpu": 2.0, "h2d": 1.5}, "cpu+gpu+h2d": {"cpu": 2.0, "gpu": 1.25, "h2d": 1.5}}
    path = tmp_path_factory.mktemp("hw") / "contended.json"
    return {"default": DEFAULT_HARDWARE,
            "contended": round_number_profile(path, read_meta(olmoe_trace).model, contention=slow)}


def _run(trace, system, ratio, timeline, hardware):
    return simulate(trace, system, batch_size=4, profiling=ProfileSpec(share=0.0), timeline=timeline,
                    hardware=hardware, overrides={"memory": {"cache_ratio": ratio}})


@pytest.mark.parametrize("profile", ["default", "contended"])
@pytest.mark.parametrize(("system", "ratio", "timeline"), [("dali", "0.2", True), ("dali", "0.4", False),
                                                           ("hybrimoe", "0.2", False), ("hybrimoe", "0.4", True)])
def test_engine_results_equal_the_process_scheduler(monkeypatch, olmoe_trace, hardware, profile, system, ratio,
                                                    timeline):
    """At cache ratios 0.2 and 0.4 the layers' copies meet prefetches and CPU experts (the event-by-event
    path): summaries, per-layer, per-step and per-sequence tables and the timeline equal those of the
    process scheduler."""
    got = _run(olmoe_trace, system, ratio, timeline, hardware[profile])
    ReferenceLanes.slowest = []
    monkeypatch.setattr(engine_module, "FluidLanes", ReferenceLanes)
    want = _run(olmoe_trace, system, ratio, timeline, hardware[profile])
    assert len(ReferenceLanes.slowest) > 100  # many activities on the event-by-event path
    if profile == "contended" and system == "dali":  # (hybrimoe's copies do not meet CPU experts here)
        assert min(ReferenceLanes.slowest) < 1.0
    assert got.summary == want.summary
    for table in ("per_layer", "per_step", "per_sequence"):
        pd.testing.assert_frame_equal(getattr(got, table), getattr(want, table), check_exact=True)
    assert [(i.track, i.name, i.start, i.end) for i in got.intervals] == \
        [(i.track, i.name, i.start, i.end) for i in want.intervals]


@pytest.mark.parametrize(("system", "profile"), [("dali", "default"), ("dali", "contended"), ("hybrimoe", "default"),
                                               ("hybrimoe", "contended"), ("gpu-lru", "default"),
                                               ("ktransformers", "default")])
def test_engine_schedules_nothing_but_lane_timers_ahead_while_activities_run(monkeypatch, olmoe_trace, hardware,
                                                                             profile, system):
    """The scheduler's precondition (FluidLanes' docstring), checked on every event the engine schedules
    (cases whose layers take the event-by-event path)."""
    lanes_of_run: list[FluidLanes] = []
    arming = [False]
    seen = {"future": 0, "other": 0}
    original_init, original_arm, original_schedule = FluidLanes.__init__, FluidLanes._arm, simpy.Environment.schedule

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        lanes_of_run.append(self)

    def arm(self):
        arming[0] = True
        try:
            original_arm(self)
        finally:
            arming[0] = False

    def schedule(self, event, priority=simpy.events.NORMAL, delay=0):
        if delay > 0 and lanes_of_run and lanes_of_run[-1].jobs:
            seen["future"] += 1
            seen["other"] += not arming[0]
        return original_schedule(self, event, priority, delay)

    monkeypatch.setattr(FluidLanes, "__init__", init)
    monkeypatch.setattr(FluidLanes, "_arm", arm)
    monkeypatch.setattr(simpy.Environment, "schedule", schedule)
    _run(olmoe_trace, system, "0.2", False, hardware[profile])
    assert seen["future"] > 0 and seen["other"] == 0
