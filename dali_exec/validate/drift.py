"""The machine's speed before and after a validation, so a user can tell model error from a machine that
changed speed (docs/validation.md, "Verdict"): :class:`SpeedProbe` and the warnings it and the replays'
spread give. The probe reads two things: each lane's speed alone, and how well the two lanes overlap
when they compute at once (on a 2-vCPU VM the second of these moved by itself, and only the systems
that use both lanes at once, such as ``dali``, felt it). A diagnostic only: no simulated time is scaled
by it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dali_exec.calibrate.bench import time_call
from dali_exec.calibrate.micro import Microbench, MicroSettings
from dali_exec.executor.cpu_worker import CpuWorker
from dali_exec.executor.devices import Devices
from dali_sim.models.spec import ModelSpec

#: weights per lane of the probe's grouped call (at most 16 experts, at least 2)
PROBE_BYTES = 32 << 20


@dataclass(frozen=True)
class ProbeReading:
    """One reading of :class:`SpeedProbe`: ``seconds``, each lane's call alone, summed; ``overlap``, both
    lanes' calls started together over the slower of them alone (1 = the lanes run side by side as if
    alone; 2 = one waits for the other, e.g. both on one core)."""

    seconds: float
    overlap: float


class SpeedProbe:
    """The calibration's own grouped call of one-token experts (:meth:`Microbench.expert_op`, caches flushed;
    as many experts as make :data:`PROBE_BYTES` of weights, 2 to 16) on each lane, with one torch thread per
    lane: alone on each lane, and on both lanes at once (the CPU lane's on its worker, as a replay runs them).
    Each figure is the median of ``rounds`` rounds of medians of ``repeats`` calls."""

    def __init__(self, model: ModelSpec, devices: Devices, rounds: int = 3, repeats: int = 15):
        self.worker = CpuWorker(1)
        self.bench = Microbench(model, devices, self.worker, MicroSettings(repeats=repeats, warmup=2))
        group = int(min(16, model.num_experts, max(2, math.ceil(PROBE_BYTES / max(model.expert_bytes, 1)))))
        self.ops = {lane: self.bench.expert_op(lane, 1, group) for lane in ("gpu", "cpu")}
        self.rounds = rounds
        self.read()  # (a process's first calls are slower: not a reading)

    def read(self) -> ProbeReading:
        prev = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            sums, overlaps = [], []
            for _ in range(self.rounds):
                alone = [self.bench._timed(lane, op) for lane, op in self.ops.items()]
                sums.append(sum(alone))
                overlaps.append(self._together() / max(alone))
            return ProbeReading(float(np.median(sums)), float(np.median(overlaps)))
        finally:
            torch.set_num_threads(prev)

    def _together(self) -> float:
        """Median wall seconds of both lanes' calls started at once (the CPU lane's handed to its worker first)."""
        b, gpu, cpu = self.bench, self.ops["gpu"], self.ops["cpu"]
        flush_gpu, flush_cpu = b.flush("gpu"), b.flush("cpu")
        sync = (lambda: torch.cuda.synchronize(b.cuda)) if b.cuda is not None else (lambda: None)

        def cold() -> None:
            flush_gpu()
            self.worker.run(flush_cpu)

        def both(i: int) -> None:
            job = self.worker.submit(cpu, i)
            gpu(i)
            sync()
            job.result()
        return time_call(both, cuda=None, repeats=b.s.repeats, warmup=b.s.warmup, prepare=cold)

    def close(self) -> None:
        self.worker.close()

    def __enter__(self) -> "SpeedProbe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def drift_warning(before_s: float, after_s: float, limit: float) -> str | None:
    """A warning when the probe moved by more than ``limit`` (a fraction) between ``before_s`` and
    ``after_s``, else None."""
    drift = after_s / before_s - 1
    if abs(drift) <= limit:
        return None
    return (f"the machine's speed changed during the validation: the probe (a cold grouped expert call per lane) "
            f"took {1e3 * before_s:.3f} ms before and {1e3 * after_s:.3f} ms after ({100 * drift:+.1f}%, more than "
            f"+-{100 * limit:.0f}%): the time errors mix the model's error with the machine's change; rerun on a "
            "quiet machine")


def overlap_warning(before: float, after: float, limit: float, systems: list[str]) -> str | None:
    """A warning when the lanes' overlap (:attr:`ProbeReading.overlap`) moved by more than ``limit`` (a fraction)
    and there are ``systems`` whose two lanes computed at once, else None."""
    change = after / before - 1
    if abs(change) <= limit or not systems:
        return None
    return (f"the two lanes overlapped differently at the end than at the start: both lanes' probe calls at once "
            f"took {before:.2f}x the slower one alone before and {after:.2f}x after ({100 * change:+.1f}%, more than "
            f"+-{100 * limit:.0f}%): the times of the systems whose two lanes computed at once "
            f"({', '.join(systems)}) mix the model's error with the machine's change; rerun on a quiet machine")


def spread_warnings(rows: list[dict], limit: float) -> list[str]:
    """Per system replayed more than once: a warning when its slowest replay took more than ``limit`` (a
    fraction) longer than its fastest."""
    out = []
    for r in rows:
        lo, hi = r.get("exec_s_min"), r.get("exec_s_max")
        if r.get("replays", 1) > 1 and lo and hi / lo - 1 > limit:
            out.append(f"{r['system']}: its {r['replays']} replays took {lo:.3f}-{hi:.3f} s ({100 * (hi / lo - 1):.0f}% "
                       f"apart, more than {100 * limit:.0f}%): the machine's speed moved while it was measured")
    return out


__all__ = ["PROBE_BYTES", "ProbeReading", "SpeedProbe", "drift_warning", "overlap_warning", "spread_warnings"]
