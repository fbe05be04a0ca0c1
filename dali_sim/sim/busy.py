"""Busy time in a timeline (executed or simulated): the activity kind of each interval, the seconds of each kind,
the time two lanes were busy at once, the time no lane was. Torch-free: the validation's comparison
(``dali_exec.validate.compare``) and the calibration's lane measurement (``dali_exec.calibrate.lanes``) read
timelines with it."""

from __future__ import annotations

import math
from typing import Iterable

from dali_sim.sim.engine import Interval

#: activity kinds of timeline intervals (docs/simulator.md, Timelines)
KINDS = ("host", "dense", "block", "gpu_expert", "cpu_expert", "fetch", "prefetch", "swap", "other")


def activity_kind(iv: Interval) -> str:
    """The kind of a timeline interval from its track and name (``dense L3``, ``dense block 0``,
    ``L3 E17``, ``fetch L3 E17``, ``prefetch L4 E2``, ``swap L3 +E5 -E9``)."""
    name = iv.name
    if name.startswith("dense block"):
        return "block"
    if name.startswith("dense"):
        return "dense"
    head = name.split(" ", 1)[0]
    if head in ("fetch", "prefetch", "swap", "host"):
        return head
    if head.startswith("L") and " E" in name:
        return "gpu_expert" if iv.track == "gpu" else "cpu_expert"
    return "other"  # LM head, lane overheads, activation hand-overs, shared experts


def busy_by_kind(intervals: Iterable[Interval]) -> dict[str, tuple[int, float]]:
    """Per activity kind: (number of intervals, seconds summed)."""
    out = {k: [0, 0.0] for k in KINDS}
    for iv in intervals:
        c = out[activity_kind(iv)]
        c[0] += 1
        c[1] += iv.end - iv.start
    return {k: (int(n), float(s)) for k, (n, s) in out.items()}


def _covered_seconds(spans: Iterable[tuple[float, float]], since: float = -math.inf,
                     until: float = math.inf) -> float:
    """Length of the union of ``(start, end)`` spans within ``[since, until]``."""
    covered, end = 0.0, since
    for a, b in sorted(spans):
        a, b = max(a, end), min(b, until)
        if b > a:
            covered += b - a
        end = max(end, min(b, until))
    return covered


def lanes_overlap_seconds(intervals: Iterable[Interval]) -> float:
    """Seconds during which the CPU lane (track ``cpu``) and the accelerator lane (track ``gpu``) were busy at
    once: the time a change in how the machine runs two threads side by side can move."""
    ivs = list(intervals)
    cpu = [(iv.start, iv.end) for iv in ivs if iv.track == "cpu"]
    gpu = [(iv.start, iv.end) for iv in ivs if iv.track == "gpu"]
    return max(0.0, _covered_seconds(cpu) + _covered_seconds(gpu) - _covered_seconds(cpu + gpu))


def idle_seconds(intervals: Iterable[Interval], makespan: float) -> float:
    """Time within ``[0, makespan]`` when no track (GPU, CPU, PCIe) is busy: in a simulation only waits
    the model has (none, in most layers); in an executed run also the host's own work between them."""
    return max(0.0, makespan - _covered_seconds(((iv.start, iv.end) for iv in intervals), 0.0, makespan))


__all__ = ["KINDS", "activity_kind", "busy_by_kind", "idle_seconds", "lanes_overlap_seconds"]
