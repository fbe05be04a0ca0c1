"""The CPU lane's grouped call in a replay: beside the accelerator lane, alone on its worker, and inline.

    python benchmarks/cpu_lane_beside.py                       # dali, Qwen3-30B-A3B shape as cpu_validation.py
    python benchmarks/cpu_lane_beside.py --rounds 5 --json out.json

dali computes a layer's experts on both lanes at once: on the CPU device its CPU lane's grouped call runs on the
worker thread while the replay's thread computes the accelerator lane on the other core. This replays dali on the
validation's Qwen3 shape (``experiments/cpu_validation.py``: scale 1/4, bf16, 8 MoE layers, batch 4, 24 GiB) in
three modes, round by round, and takes each CPU-lane call's wall and thread-CPU time (``_cpu_lane``):

* ``beside``: as the executor runs it (the worker computes while the replay's thread goes on);
* ``alone``: on the worker, but the replay's thread waits for the job before its own lane (nothing beside it);
* ``inline``: in the replay's thread itself (``OffloadRuntime.cpu_inline``), after its lane.

Wall over thread CPU is what the call waited (for the GIL, for a core); thread CPU beside over alone is what the
other core's work cost the call's own instructions (shared caches and memory). The calibration's contention
table (``cpu+gpu``) is meant to hold the latter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import common as C  # noqa: E402
from dali_exec.executor.cpu_worker import CpuWorker  # noqa: E402
from dali_exec.executor.problem import ReplayOptions  # noqa: E402
from dali_exec.executor.replay import ExecOptions, execute  # noqa: E402
from dali_exec.executor.runtime import OffloadRuntime  # noqa: E402

MODES = ("beside", "alone", "inline")


def replay_once(trace, mode: str, replay: ReplayOptions, batch: int, memory_gib: float) -> dict:
    """One replay of dali in ``mode``: the medians of its CPU-lane calls' wall and thread-CPU us, the run's seconds."""
    wall, cpu = [], []
    init, submit, cpu_lane = OffloadRuntime.__init__, CpuWorker.submit, OffloadRuntime._cpu_lane

    def runtime_init(self, *a, **k):
        init(self, *a, **k)
        self.cpu_inline = mode == "inline"

    def submitted(self, *a, **k):
        job = submit(self, *a, **k)
        if mode == "alone":
            job.result()
        return job

    def timed_lane(self, *a, **k):
        w0, c0 = time.perf_counter(), time.thread_time()
        out = cpu_lane(self, *a, **k)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.thread_time() - c0)
        return out

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(OffloadRuntime, "__init__", runtime_init))
        stack.enter_context(mock.patch.object(CpuWorker, "submit", submitted))
        stack.enter_context(mock.patch.object(OffloadRuntime, "_cpu_lane", timed_lane))
        res = execute(trace, "dali", replay, ExecOptions(device="cpu"), batch_size=batch,
                      overrides={"memory": {"gpu_memory_gib": str(memory_gib)}})
    if not wall:
        raise RuntimeError("dali computed nothing on the CPU lane in this replay: nothing to compare")
    return {"mode": mode, "calls": len(wall), "wall_us": 1e6 * float(np.median(wall)),
            "cpu_us": 1e6 * float(np.median(cpu)), "run_s": float(res.per_step["time_s"].sum())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="2 layers, short sequences, 1 round")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    batch, memory_gib = 4, 24.0  # (cpu_validation.py's)
    spec = C.TraceSpec(a.shape, sequences=C.total_sequences(batch), prompt_len=8 if a.quick else 32,
                       gen_len=4 if a.quick else 16, seed=0)
    trace = C.get_trace(spec)
    replay = ReplayOptions(model_shape=a.shape, layers=2 if a.quick else a.layers, scale=a.scale, dtype="bf16")
    rows = []
    for r in range(1 if a.quick else a.rounds):
        for mode in MODES:
            row = replay_once(trace, mode, replay, batch, memory_gib) | {"round": r}
            rows.append(row)
            print(f"round {r} {mode:6s}: {row['calls']} CPU-lane calls, median wall {row['wall_us']:.0f} us, "
                  f"thread CPU {row['cpu_us']:.0f} us; the run {row['run_s']:.3f} s", flush=True)
    med = {m: {k: float(np.median([r[k] for r in rows if r["mode"] == m])) for k in ("wall_us", "cpu_us")}
           for m in MODES}
    print(f"medians over the rounds: beside/alone thread CPU {med['beside']['cpu_us'] / med['alone']['cpu_us']:.2f}x, "
          f"beside wall/CPU {med['beside']['wall_us'] / med['beside']['cpu_us']:.2f}, "
          f"alone/inline thread CPU {med['alone']['cpu_us'] / med['inline']['cpu_us']:.2f}x; load average "
          f"{os.getloadavg()[0]:.2f}")
    if a.json:
        a.json.write_text(json.dumps({"settings": vars(a) | {"json": str(a.json)}, "rows": rows, "medians": med},
                                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
