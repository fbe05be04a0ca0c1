"""The engine's overlap rules, checked against timelines worked out on paper.

Trace (the `overlap_trace` fixture of conftest.py): one sequence, 2 MoE layers, 3 experts, top-2.

    pos 0 prefill: layer 0 [0, 1]   layer 1 [2, 0]
    pos 1 prefill: layer 0 [0, 2]   layer 1 [2, 1]
    pos 2 decode:  layer 0 [1, 0]   layer 1 [1, 2]

Batch 1: step 0 = the 2-token prefill, step 1 = the decode token. Touch order and workloads:

    step 0  layer 0: 0 [2], 1 [1], 2 [1]     (0 has two tokens; 1 and 2 tie at rank 1 -> id)
            layer 1: 2 [2], 0 [1], 1 [1]
    step 1  layer 0: 1, 0                    layer 1: 1, 2

Hardware: a measured profile of round numbers: dense part of a layer 0.5 s (GPU), GPU expert
1 s per token, CPU expert 3 s per token, one expert's copy 2 s. All times are exact binary
fractions, so the timelines are compared with ``==``.

Rules (docs of dali_sim/sim/engine.py): per layer the dense part runs first; then on-demand copies
start in touch order, back to back on the link; the GPU computes, in touch order, the first expert
whose weights are present, else waits for the next arrival; a staged copy needs a free staging
buffer, held until that expert's GPU compute ends; the CPU lane runs its experts back to back from
the end of the dense part; the next layer starts when both lanes are done.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import simpy
from conftest import OVERLAP_MODEL, WHOLE

from dali_sim.policies.base import PlacementPolicy
from dali_sim.policies.systems import PolicyChoice, resolve_system
from dali_sim.sim.engine import SimEngine
from dali_sim.sim.simulate import simulate

MODEL = OVERLAP_MODEL


@pytest.fixture(scope="module")
def profile(round_profile):
    return round_profile


# ---- a placement that splits a layer between the lanes (no preset does) ----------------------------
class CpuSetPlacement(PlacementPolicy):
    """Experts in ``cpu`` run on the CPU, the others on the GPU (fetched when not resident)."""

    name = "test-cpu-set"

    def __init__(self, cpu):
        super().__init__()
        self.cpu = set(cpu)

    def place(self, view):
        return np.array([int(e) not in self.cpu for e in view.experts], dtype=bool)


@dataclass(frozen=True)
class FactoryChoice(PolicyChoice):
    """A PolicyChoice that builds from a factory, so the test policy needs no registry entry."""

    factory: Callable | None = None

    def build(self):
        return self.factory()


def split_system(cpu_experts, slots: int = 2):
    base = resolve_system("gpu-lru", {"memory": {"cache_experts": str(slots)}})
    choice = FactoryChoice("placement", CpuSetPlacement.name, base.placement.config,
                           functools.partial(CpuSetPlacement, cpu_experts))
    return dataclasses.replace(base, name="split", placement=choice)


# ---- helpers -------------------------------------------------------------------------------------
def spans(result):
    """Sorted (track, name, start, end) of the recorded intervals."""
    return sorted((iv.track, iv.name, iv.start, iv.end) for iv in result.intervals)


def run_both(monkeypatch, trace, system, profile, overrides=None):
    """The same run through the direct path (default) and the general SimPy path (shortcut=False).

    Checks that both give identical intervals, counters and times, and that the default run really
    took the direct path: it processes fewer SimPy events (counted by wrapping
    ``simpy.Environment.step``, which ``Environment.run`` calls once per event). Returns the default run.
    """
    mod = importlib.import_module("dali_sim.sim.simulate")  # the package re-exports the function
    steps = {"n": 0}
    original = simpy.Environment.step

    def counting_step(self):
        steps["n"] += 1
        return original(self)

    monkeypatch.setattr(simpy.Environment, "step", counting_step)
    fast = simulate(trace, system, hardware=profile, overrides=overrides, timeline=True, profiling=WHOLE)
    fast_steps, steps["n"] = steps["n"], 0
    monkeypatch.setattr(mod, "SimEngine", functools.partial(SimEngine, shortcut=False))
    slow = simulate(trace, system, hardware=profile, overrides=overrides, timeline=True, profiling=WHOLE)
    slow_steps = steps["n"]
    monkeypatch.undo()
    assert fast_steps < slow_steps, (fast_steps, slow_steps)
    assert spans(fast) == spans(slow)
    key = lambda iv: (iv.track, iv.start, iv.name)
    assert [iv.args for iv in sorted(fast.intervals, key=key)] == [iv.args for iv in sorted(slow.intervals, key=key)]
    assert fast.to_json() == slow.to_json()
    assert fast.per_layer.equals(slow.per_layer)
    assert fast.per_step.equals(slow.per_step)
    return fast


# ---- case A: copies overlap computes ---------------------------------------------------------------
CASE_A = [
    # step 0, layer 0: all three fetched; 0 and 1 admitted (2 free slots), 2 staged (both entries active)
    ("gpu", "dense L0", 0.0, 0.5),
    ("pcie", "fetch L0 E0", 0.5, 2.5), ("pcie", "fetch L0 E1", 2.5, 4.5), ("pcie", "fetch L0 E2", 4.5, 6.5),
    ("gpu", "L0 E0", 2.5, 4.5),   # 2 tokens; the copy of E1 runs meanwhile
    ("gpu", "L0 E1", 4.5, 5.5),   # landed at 4.5
    ("gpu", "L0 E2", 6.5, 7.5),   # GPU waits 5.5 -> 6.5
    # step 0, layer 1 (starts 7.5): 2 and 0 admitted, 1 staged
    ("gpu", "dense L1", 7.5, 8.0),
    ("pcie", "fetch L1 E2", 8.0, 10.0), ("pcie", "fetch L1 E0", 10.0, 12.0), ("pcie", "fetch L1 E1", 12.0, 14.0),
    ("gpu", "L1 E2", 10.0, 12.0), ("gpu", "L1 E0", 12.0, 13.0), ("gpu", "L1 E1", 14.0, 15.0),
    # step 1, layer 0 (starts 15): cache {0, 1}: both hits, no copies
    ("gpu", "dense L0", 15.0, 15.5), ("gpu", "L0 E1", 15.5, 16.5), ("gpu", "L0 E0", 16.5, 17.5),
    # step 1, layer 1 (starts 17.5): cache {0, 2}; touch 1 (miss: evict 0, the only non-activated
    # entry), 2 (hit). The GPU computes E2 first (present) while E1 is copied, then waits for E1.
    ("gpu", "dense L1", 17.5, 18.0), ("pcie", "fetch L1 E1", 18.0, 20.0),
    ("gpu", "L1 E2", 18.0, 19.0), ("gpu", "L1 E1", 20.0, 21.0),
]


def test_case_a_copies_overlap_computes(monkeypatch, overlap_trace, profile):
    """gpu-lru, 2 slots per layer, 2 staging buffers, empty caches.

    step 0 layer 0 (t = 0): dense 0-0.5; copies E0 0.5-2.5, E1 2.5-4.5, E2 4.5-6.5 back to back;
      GPU: E0 (2 tokens) 2.5-4.5 overlapping E1's copy, E1 4.5-5.5, waits, E2 6.5-7.5. End 7.5.
    step 0 layer 1 (t = 7.5): dense 7.5-8; copies E2 8-10, E0 10-12, E1 12-14;
      GPU: E2 (2 tokens) 10-12, E0 12-13, waits, E1 14-15. End 15.
    step 1 layer 0 (t = 15): dense 15-15.5; hits E1 15.5-16.5, E0 16.5-17.5. End 17.5.
    step 1 layer 1 (t = 17.5): dense 17.5-18; E1 misses (victim 0), E2 hits: copy E1 18-20;
      GPU: E2 18-19 (first present in touch order), waits, E1 20-21. End 21 = makespan.
    GPU waits: layer 0: 2 + 1 = 3 s; layer 1: 2 + 1 + 1 = 4 s.
    Events: 4 dense + 10 computes + 7 copies = 21.
    """
    r = run_both(monkeypatch, overlap_trace, "gpu-lru", profile, {"memory": {"cache_experts": "2"}})
    assert spans(r) == sorted(CASE_A)
    s = r.summary
    assert s["makespan_s"] == 21.0 and s["events"] == 21
    assert (s["hits"], s["on_demand"], s["admitted"], s["evicted"], s["staged"]) == (3, 7, 5, 1, 2)
    assert r.per_layer["gpu_wait_s"].tolist() == [3.0, 4.0]
    assert r.per_layer["time_s"].tolist() == [7.5 + 2.5, 7.5 + 3.5]
    assert r.per_step["time_s"].tolist() == [15.0, 6.0]
    assert s["busy"] == {"gpu": 14 / 21, "cpu": 0.0, "pcie": 14 / 21, "host": 0.0}
    # interval args: the step and, for computes, the tokens
    by = {(iv.track, iv.name, iv.start): iv.args for iv in r.intervals}
    assert by[("gpu", "L0 E0", 2.5)] == {"step": 0, "tokens": 2}
    assert by[("pcie", "fetch L1 E1", 18.0)] == {"step": 1, "kind": "on-demand"}


# ---- case B: a staged copy waits for a staging buffer ------------------------------------------------
CASE_B = [
    ("gpu", "dense L0", 0.0, 0.5),
    ("pcie", "fetch L0 E0", 0.5, 2.5), ("gpu", "L0 E0", 2.5, 4.5),
    ("pcie", "fetch L0 E1", 4.5, 6.5), ("gpu", "L0 E1", 6.5, 7.5),
    ("pcie", "fetch L0 E2", 7.5, 9.5), ("gpu", "L0 E2", 9.5, 10.5),
    ("gpu", "dense L1", 10.5, 11.0),
    ("pcie", "fetch L1 E2", 11.0, 13.0), ("gpu", "L1 E2", 13.0, 15.0),
    ("pcie", "fetch L1 E0", 15.0, 17.0), ("gpu", "L1 E0", 17.0, 18.0),
    ("pcie", "fetch L1 E1", 18.0, 20.0), ("gpu", "L1 E1", 20.0, 21.0),
    ("gpu", "dense L0", 21.0, 21.5),
    ("pcie", "fetch L0 E1", 21.5, 23.5), ("gpu", "L0 E1", 23.5, 24.5),
    ("pcie", "fetch L0 E0", 24.5, 26.5), ("gpu", "L0 E0", 26.5, 27.5),
    ("gpu", "dense L1", 27.5, 28.0),
    ("pcie", "fetch L1 E1", 28.0, 30.0), ("gpu", "L1 E1", 30.0, 31.0),
    ("pcie", "fetch L1 E2", 31.0, 33.0), ("gpu", "L1 E2", 33.0, 34.0),
]


def test_case_b_staging_buffer_wait(monkeypatch, overlap_trace, profile):
    """gpu-lru with no cache slots and ONE staging buffer: every expert is fetched and staged, and
    each copy must wait until the previous staged expert's GPU compute has released the buffer.

    step 0 layer 0: dense 0-0.5; copy E0 0.5-2.5, compute E0 (2 tokens) 2.5-4.5 -> buffer free at 4.5;
      copy E1 4.5-6.5 (the link was free since 2.5: a 2 s buffer wait), compute 6.5-7.5;
      copy E2 7.5-9.5, compute 9.5-10.5.
    step 0 layer 1: dense 10.5-11; E2 copy 11-13, compute 13-15; E0 copy 15-17, compute 17-18;
      E1 copy 18-20, compute 20-21.
    step 1 layer 0: dense 21-21.5; E1 21.5-23.5 / 23.5-24.5; E0 24.5-26.5 / 26.5-27.5.
    step 1 layer 1: dense 27.5-28; E1 28-30 / 30-31; E2 31-33 / 33-34. Makespan 34.
    With 2 buffers the same run takes 26 s: step 0 layer 0 as in case A (7.5 s), layer 1 copies
    8-10, 10-12, 12-14 (E1's buffer frees at 12 when E2's compute ends), computes 10-12, 12-13, 14-15
    (end 15); step 1 layer 0: copies 15.5-17.5, 17.5-19.5, computes 17.5-18.5, 19.5-20.5 (end 20.5);
    step 1 layer 1: copies 21-23, 23-25, computes 23-24, 25-26 (end 26).
    """
    over = {"memory": {"cache_experts": "0", "staging_slots": "1"}}
    r = run_both(monkeypatch, overlap_trace, "gpu-lru", profile, over)
    assert spans(r) == sorted(CASE_B)
    s = r.summary
    assert s["makespan_s"] == 34.0 and s["events"] == 4 + 10 + 10
    assert (s["hits"], s["on_demand"], s["admitted"], s["staged"]) == (0, 10, 0, 10)
    two = run_both(monkeypatch, overlap_trace, "gpu-lru", profile, {"memory": {"cache_experts": "0"}})
    assert two.summary["makespan_s"] == 26.0
    assert [iv.start for iv in sorted(two.intervals, key=lambda iv: iv.start) if iv.track == "pcie"] == [
        0.5, 2.5, 4.5, 8.0, 10.0, 12.0, 15.5, 17.5, 21.0, 23.0]


# ---- case C: CPU and GPU lanes in parallel -----------------------------------------------------------
CASE_C = [
    # step 0 layer 0: E0 (2 tokens) on the CPU: 3 x 2 = 6 s from 0.5; E1, E2 fetched and admitted
    ("gpu", "dense L0", 0.0, 0.5), ("cpu", "L0 E0", 0.5, 6.5),
    ("pcie", "fetch L0 E1", 0.5, 2.5), ("pcie", "fetch L0 E2", 2.5, 4.5),
    ("gpu", "L0 E1", 2.5, 3.5), ("gpu", "L0 E2", 4.5, 5.5),
    # step 0 layer 1 (starts 6.5, when the slower CPU lane ends): E0 (1 token) on the CPU 7-10
    ("gpu", "dense L1", 6.5, 7.0), ("cpu", "L1 E0", 7.0, 10.0),
    ("pcie", "fetch L1 E2", 7.0, 9.0), ("pcie", "fetch L1 E1", 9.0, 11.0),
    ("gpu", "L1 E2", 9.0, 11.0), ("gpu", "L1 E1", 11.0, 12.0),
    # step 1 layer 0 (starts 12, when the slower GPU lane ends): E1 hit on the GPU, E0 on the CPU
    ("gpu", "dense L0", 12.0, 12.5), ("gpu", "L0 E1", 12.5, 13.5), ("cpu", "L0 E0", 12.5, 15.5),
    # step 1 layer 1 (starts 15.5): both hits on the GPU
    ("gpu", "dense L1", 15.5, 16.0), ("gpu", "L1 E1", 16.0, 17.0), ("gpu", "L1 E2", 17.0, 18.0),
]


def test_case_c_cpu_and_gpu_lanes(monkeypatch, overlap_trace, profile):
    """Expert 0 always on the CPU, the others on the GPU (LRU cache, 2 slots).

    step 0 layer 0: dense 0-0.5; CPU lane E0 0.5-6.5; GPU lane: copies E1 0.5-2.5, E2 2.5-4.5,
      computes E1 2.5-3.5, E2 4.5-5.5. GPU lane ends 5.5, CPU 6.5: the CPU decides, end 6.5.
    step 0 layer 1: dense 6.5-7; CPU E0 7-10; copies E2 7-9, E1 9-11; computes E2 (2 tokens) 9-11,
      E1 11-12. The GPU decides: end 12.
    step 1 layer 0: dense 12-12.5; E1 (hit) 12.5-13.5 on the GPU, E0 12.5-15.5 on the CPU: end 15.5.
    step 1 layer 1: dense 15.5-16; hits E1 16-17, E2 17-18. Makespan 18.
    Busy: GPU 2 (dense) + 8 (experts) = 10 s, CPU 6 + 3 + 3 = 12 s, PCIe 4 x 2 = 8 s.
    """
    r = run_both(monkeypatch, overlap_trace, split_system([0]), profile)
    assert spans(r) == sorted(CASE_C)
    s = r.summary
    assert s["makespan_s"] == 18.0 and s["events"] == 18  # 4 dense + 3 CPU + 7 GPU computes + 4 copies
    assert s["busy"] == {"gpu": 10 / 18, "cpu": 12 / 18, "pcie": 8 / 18, "host": 0.0}
    assert (s["cpu_experts"], s["gpu_experts"], s["hits"], s["on_demand"], s["admitted"]) == (3, 7, 3, 4, 4)
    assert s["cpu_tokens"] == 4 and s["gpu_tokens"] == 8
    assert r.per_step["time_s"].tolist() == [12.0, 6.0]
    assert r.config["system"]["placement"]["policy"] == "test-cpu-set"


def test_case_c_slower_lane_decides(monkeypatch, overlap_trace, profile):
    """Each layer visit ends at the later of its two lanes, and the next dense part starts exactly
    then: step 0 layer 0 lanes end CPU 6.5 / GPU 5.5 -> next dense at 6.5; layer 1 CPU 10 / GPU 12
    -> 12; step 1 layer 0 CPU 15.5 / GPU 13.5 -> 15.5. Moving expert 0 to the CPU makes the run 18 s
    instead of case A's 21 s."""
    r = run_both(monkeypatch, overlap_trace, split_system([0]), profile)
    dense = sorted(start for track, name, start, end in spans(r) if name.startswith("dense"))
    assert dense == [0.0, 6.5, 12.0, 15.5]
    lane_end: dict[tuple[int, str], float] = {}
    for track, name, start, end in spans(r):
        if track in ("gpu", "cpu") and not name.startswith("dense"):
            visit = sum(start >= d for d in dense) - 1  # index of the layer visit it belongs to
            lane_end[(visit, track)] = max(lane_end.get((visit, track), 0.0), end)
    assert lane_end == {(0, "cpu"): 6.5, (0, "gpu"): 5.5, (1, "cpu"): 10.0, (1, "gpu"): 12.0,
                        (2, "cpu"): 15.5, (2, "gpu"): 13.5, (3, "gpu"): 18.0}
    for visit in range(3):
        assert dense[visit + 1] == max(lane_end[(visit, "cpu")], lane_end[(visit, "gpu")])
    assert r.per_step["start_s"].tolist() == [0.0, 12.0]


def test_cpu_only_lane(monkeypatch, overlap_trace, profile):
    """cpu-only: each layer = dense 0.5 + its CPU experts back to back: step 0 layer 0: 0.5-6.5,
    6.5-9.5, 9.5-12.5 (E0 6 s, E1 3 s, E2 3 s); layer 1 from 12.5: 13-19 (E2), 19-22, 22-25;
    step 1: layer 0 25-25.5, 25.5-28.5, 28.5-31.5; layer 1 31.5-32, 32-35, 35-38. Makespan 38."""
    r = run_both(monkeypatch, overlap_trace, "cpu-only", profile)
    cpu = sorted(((name, start, end) for track, name, start, end in spans(r) if track == "cpu"), key=lambda x: x[1])
    assert cpu == [("L0 E0", 0.5, 6.5), ("L0 E1", 6.5, 9.5), ("L0 E2", 9.5, 12.5),
                   ("L1 E2", 13.0, 19.0), ("L1 E0", 19.0, 22.0), ("L1 E1", 22.0, 25.0),
                   ("L0 E1", 25.5, 28.5), ("L0 E0", 28.5, 31.5),
                   ("L1 E1", 32.0, 35.0), ("L1 E2", 35.0, 38.0)]
    assert r.summary["makespan_s"] == 38.0
    assert not [s for s in spans(r) if s[0] == "pcie"]
