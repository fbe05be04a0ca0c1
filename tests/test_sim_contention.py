"""Contention: lanes that slow each other while busy together, checked against timelines worked out
on paper, and the contention models' arithmetic.

The engine cases use the overlap trace and round-number profile of test_sim_overlap.py (GPU expert 1 s
per token, CPU expert 3 s per token, a copy 2 s, a dense part 0.5 s) with a measured slowdown table.
"""

from __future__ import annotations

import math

import pytest
import simpy
from conftest import OVERLAP_MODEL, round_number_profile
from test_sim_overlap import run_both, spans, split_system

from dali_sim.hardware.contention import MeasuredSlowdowns, NoContention, SharedHostBandwidth, lane_combinations
from dali_sim.sim.fluid import FluidLanes


# ---- the models' arithmetic -------------------------------------------------------------------------
def test_shared_bandwidth_shares_proportionally():
    m = SharedHostBandwidth(capacity=10.0)
    assert m.rates({"cpu": 4.0, "h2d": 6.0}) == {"cpu": 1.0, "h2d": 1.0}  # fits exactly
    assert m.rates({"cpu": 10.0, "h2d": 10.0}) == {"cpu": 0.5, "h2d": 0.5}
    # a GPU computing from its own memory draws nothing and is never slowed
    assert m.rates({"gpu": 0.0, "cpu": 15.0, "h2d": 5.0}) == {"gpu": 1.0, "cpu": 0.5, "h2d": 0.5}
    assert m.interferes({"cpu": 8.0, "h2d": 3.0}) and not m.interferes({"cpu": 8.0, "h2d": 2.0})
    with pytest.raises(ValueError, match="capacity"):
        SharedHostBandwidth(0.0)


def test_measured_slowdowns_by_combination():
    table = {"cpu+h2d": {"cpu": 2.0, "h2d": 1.25}, "cpu+gpu": {"cpu": 1.0, "gpu": 1.0}}
    m = MeasuredSlowdowns(table)
    assert m.rates({"cpu": 0.0, "h2d": 0.0}) == {"cpu": 0.5, "h2d": 0.8}
    assert m.rates({"cpu": 0.0}) == {"cpu": 1.0}
    assert not m.interferes({"cpu": 0.0, "gpu": 0.0}) and m.interferes({"cpu": 0.0, "gpu": 0.0, "h2d": 0.0})
    assert lane_combinations() == ["cpu+gpu", "gpu+h2d", "cpu+h2d", "cpu+gpu+h2d"]
    for bad, msg in (({"h2d+cpu": {"cpu": 1.0, "h2d": 1.0}}, "sorted order"),
                     ({"cpu+h2d": {"cpu": 1.0}}, "needs a slowdown for each"),
                     ({"cpu+h2d": {"cpu": 0.5, "h2d": 1.0}}, "finite number >= 1"),
                     ({"cpu+h2d": {"cpu": math.nan, "h2d": 1.0}}, "finite number >= 1")):
        with pytest.raises(ValueError, match=msg):
            MeasuredSlowdowns(bad)


def _finish_times(contention, jobs):
    """Run ``jobs`` [(start, lane, work, demand)] on FluidLanes; return {lane: finish time}."""
    env = simpy.Environment()
    lanes = FluidLanes(env, contention)
    done = {}

    def job(start, lane, work, demand):
        yield env.timeout(start)
        yield lanes.run(lane, work, demand)
        done[lane] = env.now

    for j in jobs:
        env.process(job(*j))
    env.run()
    return done, lanes


def test_fluid_lanes_hand_computed():
    """Capacity 10 B/s; a CPU activity of 1 s drawing 10 B/s alone, a copy of 1 s drawing 10 B/s starting
    at 0.5 s: the CPU runs alone until 0.5 (0.5 s of work left), then both at half speed; the CPU finishes
    at 0.5 + 0.5 / 0.5 = 1.5 with the copy half done, the copy then alone: 1.5 + 0.5 = 2.0."""
    done, lanes = _finish_times(SharedHostBandwidth(10.0), [(0.0, "cpu", 1.0, 10.0), (0.5, "h2d", 1.0, 10.0)])
    assert done == {"cpu": 1.5, "h2d": 2.0}
    assert lanes.slowed_s["cpu"] == pytest.approx(0.5) and lanes.slowed_s["h2d"] == pytest.approx(0.5)
    # the measured model: a copy slows a CPU expert 2x and is slowed 1.25x: the copy (1 s at 0.8) ends at
    # 1.25 with the CPU 0.625 done; the CPU alone then needs 0.375 more: 1.625
    done, _ = _finish_times(MeasuredSlowdowns({"cpu+h2d": {"cpu": 2.0, "h2d": 1.25}}),
                            [(0.0, "cpu", 1.0, 0.0), (0.0, "h2d", 1.0, 0.0)])
    assert done == {"h2d": 1.25, "cpu": 1.625}
    # without contention: plain timeouts
    done, _ = _finish_times(None, [(0.0, "cpu", 1.0, 10.0), (0.5, "h2d", 1.0, 10.0)])
    assert done == {"cpu": 1.0, "h2d": 1.5}
    done, _ = _finish_times(NoContention(), [(0.0, "cpu", 1.0, 10.0), (0.5, "h2d", 1.0, 10.0)])
    assert done == {"cpu": 1.0, "h2d": 1.5}


def test_fluid_lane_runs_one_activity_at_a_time():
    env = simpy.Environment()
    lanes = FluidLanes(env, NoContention())
    lanes.run("cpu", 1.0)
    with pytest.raises(AssertionError, match="already runs"):
        lanes.run("cpu", 1.0)


# ---- the engine with a measured slowdown table ---------------------------------------------------------
@pytest.fixture(scope="module")
def contended_profile(tmp_path_factory):
    """Round numbers, and while a copy runs both it and a CPU expert go at half speed (the GPU lane is
    never slowed)."""
    slow = {"cpu+h2d": {"cpu": 2.0, "h2d": 2.0}, "cpu+gpu+h2d": {"cpu": 2.0, "gpu": 1.0, "h2d": 2.0}}
    return round_number_profile(tmp_path_factory.mktemp("hw") / "contended.json", OVERLAP_MODEL, contention=slow)


CASE_CONTENDED = [
    # step 0 layer 0: dense 0-0.5; CPU E0 (6 s of work) and the copy of E1 (2 s) share at half speed: the
    # copy lands at 4.5 (CPU 2 done); copy E2 4.5-8.5 still at half speed (CPU 4 done), GPU E1 4.5-5.5;
    # after 8.5 the CPU is alone with the GPU (no slowdown): its last 2 s end at 10.5; GPU E2 8.5-9.5
    ("gpu", "dense L0", 0.0, 0.5), ("cpu", "L0 E0", 0.5, 10.5),
    ("pcie", "fetch L0 E1", 0.5, 4.5), ("pcie", "fetch L0 E2", 4.5, 8.5),
    ("gpu", "L0 E1", 4.5, 5.5), ("gpu", "L0 E2", 8.5, 9.5),
    # step 0 layer 1 (from 10.5): dense -11; CPU E0 (3 s) with copy E2 at half speed to 15 (CPU 2 done),
    # then with copy E1: the CPU's last 1 s takes 2 s (to 17), the copy has 1 s left alone: lands at 18;
    # GPU E2 (2 tokens) 15-17, E1 18-19
    ("gpu", "dense L1", 10.5, 11.0), ("cpu", "L1 E0", 11.0, 17.0),
    ("pcie", "fetch L1 E2", 11.0, 15.0), ("pcie", "fetch L1 E1", 15.0, 18.0),
    ("gpu", "L1 E2", 15.0, 17.0), ("gpu", "L1 E1", 18.0, 19.0),
    # step 1: no copies, CPU and GPU do not slow each other: as without contention
    ("gpu", "dense L0", 19.0, 19.5), ("gpu", "L0 E1", 19.5, 20.5), ("cpu", "L0 E0", 19.5, 22.5),
    ("gpu", "dense L1", 22.5, 23.0), ("gpu", "L1 E1", 23.0, 24.0), ("gpu", "L1 E2", 24.0, 25.0),
]


def test_copies_and_cpu_experts_slow_each_other(monkeypatch, overlap_trace, contended_profile):
    """Case C of test_sim_overlap.py (18 s without contention) with copies and CPU experts sharing host
    memory: 25 s. The direct path (step 1, where nothing interferes) and the event path agree."""
    r = run_both(monkeypatch, overlap_trace, split_system([0]), contended_profile)
    assert spans(r) == sorted(CASE_CONTENDED)
    assert r.summary["makespan_s"] == 25.0
    assert r.per_step["time_s"].tolist() == [19.0, 6.0]
    assert r.manifest["implementation"]["name"] == "dali-executor"


def test_no_slowdown_table_gives_the_uncontended_timeline(monkeypatch, overlap_trace, round_profile):
    """All factors 1: every layer takes the direct path and the times are case C's."""
    r = run_both(monkeypatch, overlap_trace, split_system([0]), round_profile)
    assert r.summary["makespan_s"] == 18.0
