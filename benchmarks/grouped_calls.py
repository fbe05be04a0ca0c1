"""Grouped expert calls: seconds of a call of G experts on each lane, and the lines the calibration could fit.

    python benchmarks/grouped_calls.py                                   # Mixtral shape at scale 1/4, bf16
    python benchmarks/grouped_calls.py --shape deepseek-v2-lite --groups 1,2,4,8,12,16 --rounds 4

The calibration (``dali_exec.calibrate.micro.Microbench.expert_seconds``) takes an expert's share of a
lane's grouped call as the slope of a line through calls of 1, 2, 4, 8 and 16 experts, and the call's
fixed part as its intercept. This script times the calibration's own grouped op
(``Microbench.expert_op``, caches flushed before each run) for every size of ``--groups`` over
``--rounds`` rounds, and prints per lane the median seconds per size, the repeated-medians line
(``robust_line``, what the calibration fits) and the least-squares line through the calibration's sizes,
with each line's error on every measured size, so a reader sees how well a line describes the calls and
which fit follows the calls the replay makes (docs/hardware.md, "Measured profiles").
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

from dali_exec.calibrate.micro import GROUP_SIZES, Microbench, MicroSettings, robust_line
from dali_exec.executor.cpu_worker import CpuWorker
from dali_exec.executor.devices import Devices
from dali_exec.executor.problem import DTYPE_PRECISION
from dali_sim.models.presets import get_model
from dali_sim.models.scaled import scale_model


def ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="mixtral-8x7b")
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_PRECISION))
    p.add_argument("--groups", type=ints, default=[1, 2, 3, 4, 6, 8])
    p.add_argument("--tokens", type=int, default=1, help="tokens per expert (1: decode)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    model = scale_model(get_model(a.shape), a.scale, None, DTYPE_PRECISION[a.dtype])
    if max(a.groups) > model.num_experts or min(a.groups) < 1:
        p.error(f"--groups must be within 1..{model.num_experts} (the model's experts)")
    if a.rounds < 1 or a.repeats < 1:
        p.error("--rounds and --repeats must be >= 1")
    torch.set_num_threads(1)
    worker = CpuWorker(1)
    devices = Devices.create("cpu", a.dtype)
    bench = Microbench(model, devices, worker, MicroSettings(repeats=a.repeats, warmup=1, max_group=max(a.groups)))
    g = np.asarray(a.groups, float)
    fit_sizes = [s for s in GROUP_SIZES if s <= max(a.groups) and s in a.groups]
    sel = np.isin(g, fit_sizes)
    out = {"shape": a.shape, "scale": a.scale, "dtype": a.dtype, "tokens": a.tokens, "groups": a.groups,
           "load_average": os.getloadavg(), "lanes": {}}
    try:
        rows = {lane: [] for lane in ("gpu", "cpu")}
        for _ in range(a.rounds):
            for lane in rows:
                rows[lane].append([bench._timed(lane, bench.expert_op(lane, a.tokens, G)) for G in a.groups])
    finally:
        worker.close()
    print(f"{a.shape} at scale {a.scale:g}, {a.dtype}, {a.tokens} token(s) per expert, CPU device, "
          f"median of {a.rounds} rounds; load average {out['load_average'][0]:.2f}")
    for lane, r in rows.items():
        t = np.median(np.asarray(r), axis=0)
        robust = robust_line(g[sel], t[sel])
        lsq = tuple(float(v) for v in np.polyfit(g[sel], t[sel], 1))
        lines = {"repeated medians": robust, "least squares": lsq}
        print(f"{lane} lane: " + "  ".join(f"G{G}: {v * 1e3:.3f} ms" for G, v in zip(a.groups, t)))
        for name, (slope, icpt) in lines.items():
            pred = max(icpt, 0.0) + slope * g
            err = ", ".join(f"G{G} {100 * (pv / tv - 1):+.1f}%" for G, pv, tv in zip(a.groups, pred, t))
            print(f"  {name:16s} share {slope * 1e3:.3f} ms, fixed {icpt * 1e3:+.3f} ms -> {err}")
        out["lanes"][lane] = {"seconds": t.tolist(), **{k: {"share_s": v[0], "fixed_s": v[1]} for k, v in lines.items()}}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
