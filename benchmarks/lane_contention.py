"""Two compute lanes at once: the slowdown a replay's layer sees, against the one the calibration records.

    python benchmarks/lane_contention.py                                   # DeepSeek-V2-Lite shape, scale 1/4, bf16
    python benchmarks/lane_contention.py --shape mixtral-8x7b --groups 1,2,3 --rounds 24 --json out.json
    python benchmarks/lane_contention.py --groups 10 --rounds 40 --blocks 6 --gap-ms 0.5   # the patterns in blocks
    python benchmarks/lane_contention.py --shape qwen3-30b-a3b --groups 15 --unflushed 6   # calibration unflushed

A layer of a system with experts on both lanes (``dali``) starts them together: the CPU lane's grouped call
goes to its worker, which has slept since the last layer, and the accelerator lane's call runs in this
thread at once (dali_exec/executor/runtime.py). Per group size G (experts per call, ``--tokens`` each),
this script times that pattern, each lane's call alone in the same round (caches flushed and the worker
asleep ``--gap-ms`` before each, as between layers), and reports the medians over ``--rounds`` rounds and
the ratios together / alone. Last, the calibration's own measurement of the same lanes
(``Microbench.contention``: one ``--tokens`` expert on one lane while the other loops, the ``cpu+gpu`` entry
of a measured profile). Where the two disagree, the simulator's contention for ``dali`` is off by the
difference (docs/validation.md, "What remains").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

from dali_exec.calibrate.micro import Microbench, MicroSettings
from dali_exec.executor.cpu_worker import CpuWorker
from dali_exec.executor.devices import Devices
from dali_exec.executor.problem import DTYPE_PRECISION
from dali_sim.models.presets import get_model
from dali_sim.models.scaled import scale_model

from cold_host import spin


def _elapsed(fn, i: int) -> float:
    t0 = time.perf_counter()
    fn(i)
    return time.perf_counter() - t0


def measure(bench: Microbench, worker: CpuWorker, tokens: int, group: int, rounds: int, gap_s: float) -> dict:
    """Median seconds of each lane's call alone and of both started together, over ``rounds`` rounds (two
    more first, untimed), each call after a cache flush and ``gap_s`` of the worker asleep."""
    acc, cpu = bench.expert_op("gpu", tokens, group), bench.expert_op("cpu", tokens, group)
    flush_acc, flush_cpu = bench.flush("gpu"), bench.flush("cpu")
    runs: dict[str, list[float]] = {"gpu_alone": [], "cpu_alone": [], "gpu_together": [], "cpu_together": []}
    for r in range(rounds + 2):
        i = 3 * r  # other weight copies each time (cycled by the op)
        flush_acc()
        ga = _elapsed(acc, i)
        worker.run(flush_cpu)
        time.sleep(gap_s)
        ca = worker.run(_elapsed, cpu, i + 1)
        flush_acc()
        worker.run(flush_cpu)
        time.sleep(gap_s)
        job = worker.submit(_elapsed, cpu, i + 2)  # as the runtime: the CPU lane first, then this thread's call
        gt = _elapsed(acc, i + 2)
        ct = job.result()
        if r >= 2:
            for key, v in zip(runs, (ga, ca, gt, ct)):
                runs[key].append(v)
    return _row(runs, group, tokens)


def _row(runs: dict[str, list[float]], group: int, tokens: int) -> dict:
    """The medians (ms) of each lane alone and together, and the ratios together / alone."""
    med = {k: float(np.median(v)) for k, v in runs.items()}
    return {"group": group, "tokens": tokens, **{f"{k}_ms": 1e3 * v for k, v in med.items()},
            "gpu_slowdown": med["gpu_together"] / med["gpu_alone"], "cpu_slowdown": med["cpu_together"] / med["cpu_alone"]}


def blocks(bench: Microbench, worker: CpuWorker, tokens: int, group: int, rounds: int, gap_s: float,
           n_blocks: int) -> list[dict]:
    """``n_blocks`` blocks of ``rounds`` layers of each pattern in turn (the accelerator lane alone, the worker
    asleep; the CPU lane alone on its worker, woken each layer, this thread waiting; both, as the runtime starts
    them): the median of each per block. Each layer: a cache flush, then this thread busy for ``gap_s`` (the
    dense part, which a layer runs on the accelerator lane while the worker sleeps), then the call(s). Where the
    machine changes speed over seconds, one pattern's block may run at another speed than the next one's,
    which :func:`measure`'s interleaving (the three patterns in every round) hides."""
    acc, cpu = bench.expert_op("gpu", tokens, group), bench.expert_op("cpu", tokens, group)
    flush = bench.flush("gpu")
    out = []
    for b in range(n_blocks):
        runs: dict[str, list[float]] = {"gpu_alone": [], "cpu_alone": [], "gpu_together": [], "cpu_together": []}
        for pattern in ("gpu", "cpu", "both"):
            for r in range(rounds + 2):
                flush()
                spin(gap_s)
                job = worker.submit(_elapsed, cpu, r) if pattern != "gpu" else None
                g = _elapsed(acc, r) if pattern != "cpu" else None
                c = job.result() if job is not None else None
                if r < 2:
                    continue
                if pattern == "both":
                    runs["gpu_together"].append(g)
                    runs["cpu_together"].append(c)
                else:
                    runs[f"{pattern}_alone"].append(g if pattern == "gpu" else c)
        out.append({"block": b} | _row(runs, group, tokens))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="deepseek-v2-lite")
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_PRECISION))
    p.add_argument("--tokens", type=int, default=1, help="tokens per expert")
    p.add_argument("--groups", default="1,4,10", help="experts per grouped call, comma-separated")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--gap-ms", type=float, default=2.0, help="the worker's sleep before each call (between layers)")
    p.add_argument("--blocks", type=int, default=0,
                   help="instead: this many blocks of --rounds layers per pattern (blocks()), for the first group size")
    p.add_argument("--unflushed", type=int, default=0, metavar="N",
                   help="also N interleaved pairs of the calibration's factors with its cache flush and without it "
                        "(MicroSettings.cold)")
    p.add_argument("--json", help="write the rows, the calibration's factors and the machine here")
    a = p.parse_args(argv)
    groups = [int(g) for g in a.groups.split(",") if g.strip()]
    if a.rounds < 1 or a.tokens < 1 or not groups or min(groups) < 1:
        p.error("--rounds, --tokens and every --groups entry must be >= 1")
    torch.set_num_threads(1)
    model = scale_model(get_model(a.shape), a.scale, None, DTYPE_PRECISION[a.dtype])
    devices = Devices.create("cpu", a.dtype)
    worker = CpuWorker(1)
    try:
        bench = Microbench(model, devices, worker, MicroSettings(repeats=5, warmup=1, contention_tokens=a.tokens), 1)
        rows = []
        print(f"{model.name} ({a.dtype}), {a.tokens} token(s) per expert, medians of {a.rounds} rounds; load average "
              f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if a.blocks:
            print(f"blocks of {a.rounds} layers per pattern, {groups[0]} experts per call (ms)")
            print(f"{'block':>7s} {'accel alone':>11s} {'cpu alone':>9s} {'accel together':>14s} {'cpu together':>12s}")
            rows = blocks(bench, worker, a.tokens, groups[0], a.rounds, a.gap_ms / 1e3, a.blocks)
            for row in rows:
                print(f"{row['block']:7d} {row['gpu_alone_ms']:11.3f} {row['cpu_alone_ms']:9.3f} "
                      f"{row['gpu_together_ms']:14.3f} {row['cpu_together_ms']:12.3f}", flush=True)
            groups = []
        else:
            print(f"{'experts':>7s} {'accel alone ms':>14s} {'cpu alone ms':>12s} {'accel together':>14s} "
                  f"{'cpu together':>12s}")
        for g in groups:
            row = measure(bench, worker, a.tokens, g, a.rounds, a.gap_ms / 1e3)
            rows.append(row)
            print(f"{g:7d} {row['gpu_alone_ms']:14.3f} {row['cpu_alone_ms']:12.3f} {row['gpu_slowdown']:13.2f}x "
                  f"{row['cpu_slowdown']:11.2f}x", flush=True)
        calibration = bench.contention()["cpu+gpu"]
        print(f"calibration (Microbench.contention, cpu+gpu, {a.tokens}-token expert against a loop): accelerator "
              f"{calibration['gpu']:.2f}x, cpu {calibration['cpu']:.2f}x")
        pairs = []
        for _ in range(a.unflushed):  # (the calibration flushes the caches before every measured call)
            pair = {}
            for cold in (True, False):
                settings = MicroSettings(repeats=5, warmup=1, contention_tokens=a.tokens, cold=cold)
                bench_of = Microbench(model, devices, worker, settings, 1)
                pair["flushed" if cold else "unflushed"] = bench_of.contention()["cpu+gpu"]
            pairs.append(pair)
            print("calibration's cpu+gpu, flushed / unflushed: " + "; ".join(
                f"{lane} {pair['flushed'][lane]:.2f}x / {pair['unflushed'][lane]:.2f}x" for lane in ("gpu", "cpu")),
                flush=True)
    finally:
        worker.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": vars(a), "rows": rows, "calibration_cpu+gpu": calibration,
                       "flushed_unflushed": pairs,
                       "machine": {"cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
                                   "torch": torch.__version__, "python": sys.version.split()[0]}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
