"""CPU-hours of a large sweep, estimated from a timed sample (issue 13's 1,050-configuration sweep).

    python benchmarks/sweep_estimate.py                       # 3 models x 10 batch sizes x 5 cache ratios x 7 systems
    python benchmarks/sweep_estimate.py --json estimate.json  # every sampled measurement too
    python benchmarks/sweep_estimate.py --systems dali,gpu-lru --batches 1,32 --sample-batches 1,32

The sweep: ``--models`` (default DeepSeek-V2-Lite, OLMoE-1B-7B, Qwen3-30B-A3B shapes) x ``--batches``
(1, 2, 4, 8, 12, 16, 20, 24, 28, 32) x ``--ratios`` (cache ratio 0.1 .. 0.5) x ``--systems`` (cpu-only,
gpu-lru, llamacpp, ktransformers, hybrimoe, dali, oracle-heuristic) on synthetic traces of
``--sequences`` x (``--prompt-len`` + ``--gen-len``) tokens with residual, next-gate, gate2 and gate3
lookahead columns, every sequence evaluated (``profile_share`` 0), run as ``dali sweep`` runs it: one
workload (and one set of next-use times) per (trace, batch size), shared by its configurations.

How it estimates (process CPU time, not wall time: the machine may be shared):

1. A sample of the sweep's own configurations: for each model and each of ``--sample-batches``
   (default 1, 8, 32) the shared setup (``Workload`` and ``FutureDemand``) is timed once, then each
   system once at a cache ratio drawn from ``--ratios`` (seeded; ``--all-ratios``: every ratio), after
   one warm-up run of each system (numba compiles, scipy imports: once per worker process in a sweep).
   Each measurement is CPU seconds per (step, MoE layer) pair of its configuration.
2. Every configuration's pairs come from its workload (built, not simulated). Its CPU time = its pairs x
   the per-pair cost of its (model, system), interpolated linearly in log2(batch size) between the
   sampled batch sizes (held constant beyond them), averaged over the sampled ratios; the setup is added
   once per (model, batch size).

The per-pair cost depends on the batch size (more experts per layer, fewer steps to spread fixed costs
over), hence the sampled batch sizes, and on the cache ratio (with fewer experts resident more layers
have copies that meet other activities, timed event by event), hence ``--all-ratios`` for a closer
estimate. Uses only ``simulate()`` and the workload classes, so the same script measures an older
checkout (``PYTHONPATH=OLD_TREE python benchmarks/sweep_estimate.py``).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"  # one core, as a sweep worker

import argparse
import gc
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dali_sim.runtime.future import FutureDemand
from dali_sim.sim import simulate
from dali_sim.trace.reader import read_trace
from dali_sim.trace.synth import SynthConfig, synthesize
from dali_sim.workload.builder import Workload, WorkloadConfig
from dali_sim.workload.profiling import ProfileSpec

MODELS = ("deepseek-v2-lite", "olmoe-1b-7b", "qwen3-30b-a3b")
SYSTEMS = ("cpu-only", "gpu-lru", "llamacpp", "ktransformers", "hybrimoe", "dali", "oracle-heuristic")
BATCHES = (1, 2, 4, 8, 12, 16, 20, 24, 28, 32)
RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5)
LOOKAHEAD = ("residual=0.9", "next-gate=0.75", "gate2=0.6@2", "gate3=0.5@3")
WHOLE = ProfileSpec(share=0.0)
FUTURE_READERS = ("oracle-heuristic",)  # systems whose policies read next-use times (Belady's cache)


def csv(cast):
    return lambda text: tuple(cast(x) for x in text.split(",") if x)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=csv(str), default=MODELS)
    ap.add_argument("--systems", type=csv(str), default=SYSTEMS)
    ap.add_argument("--batches", type=csv(int), default=BATCHES)
    ap.add_argument("--ratios", type=csv(float), default=RATIOS)
    ap.add_argument("--sequences", type=int, default=64, help="sequences per trace of the full sweep (default 64)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--sample-batches", type=csv(int), default=(1, 8, 32))
    ap.add_argument("--all-ratios", action="store_true", help="sample every cache ratio, not one drawn at random")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the measurements and the estimate as JSON")
    args = ap.parse_args(argv)
    if max(args.batches + args.sample_batches) > args.sequences:
        ap.error(f"--batches up to {max(args.batches)} need --sequences >= that, got {args.sequences}")
    return args


def make_trace(folder: Path, model: str, sequences: int, args, seed: int):
    path = folder / f"{model}-{sequences}.parquet"
    if not path.exists():
        synthesize(SynthConfig(model=model, sequences=sequences, prompt_len=args.prompt_len, gen_len=args.gen_len,
                               seed=seed, lookahead=LOOKAHEAD), path, progress=False)
    return read_trace(path)


def cpu_of(fn):
    gc.collect()
    c0 = time.process_time()
    out = fn()
    return time.process_time() - c0, out


def run(trace, system: str, batch: int, ratio: float, workload, future):
    kw = {"future": future} if system in FUTURE_READERS else {}
    return simulate(trace, system, batch_size=batch, profiling=WHOLE, workload=workload,
                    overrides={"memory": {"cache_ratio": str(ratio)}}, **kw)


def sample(args, folder: Path, rng) -> list[dict]:
    rows = []
    warm: set[str] = set()
    for mi, model in enumerate(args.models):
        for batch in args.sample_batches:
            trace = make_trace(folder, model, args.sequences, args, seed=mi + 1)
            setup_s, (workload, future) = cpu_of(lambda: _setup(trace, batch))
            pairs = workload.num_steps * workload.num_layers
            rows.append({"model": model, "system": "(setup)", "batch": batch, "ratio": None, "pairs": pairs,
                         "cpu_s": setup_s, "cpu_per_pair_s": setup_s / pairs})
            for system, ratio in [(s, r) for s in args.systems
                                  for r in (args.ratios if args.all_ratios else [float(rng.choice(args.ratios))])]:
                if system not in warm:
                    run(trace, system, batch, ratio, workload, future)
                    warm.add(system)
                cpu, res = cpu_of(lambda: run(trace, system, batch, ratio, workload, future))
                pairs = int(res.summary["steps"]) * workload.num_layers
                rows.append({"model": model, "system": system, "batch": batch, "ratio": ratio, "pairs": pairs,
                             "cpu_s": cpu, "cpu_per_pair_s": cpu / pairs, "load": os.getloadavg()})
                print(f"  {model} {system} b{batch} r{ratio}: {cpu:.2f} s CPU, {pairs:,} pairs, "
                      f"{pairs / cpu:,.0f} pairs/CPU-s", file=sys.stderr, flush=True)
    return rows


def _setup(trace, batch: int):
    workload = Workload(trace, WorkloadConfig(batch, 0), predictors=tuple(n.partition("=")[0] for n in LOOKAHEAD))
    return workload, FutureDemand.from_workload(workload)


def full_pairs(args, folder: Path) -> dict[tuple[str, int], int]:
    out = {}
    for mi, model in enumerate(args.models):
        trace = make_trace(folder, model, args.sequences, args, seed=mi + 1)
        for batch in args.batches:
            w = Workload(trace, WorkloadConfig(batch, 0))
            out[(model, batch)] = w.num_steps * w.num_layers
    return out


def per_pair(rows: list[dict], model: str, system: str, batch: int) -> float:
    mine = [r for r in rows if r["model"] == model and r["system"] == system]
    batches = sorted({r["batch"] for r in mine})
    mean = [np.mean([r["cpu_per_pair_s"] for r in mine if r["batch"] == b]) for b in batches]  # over the ratios
    return float(np.interp(np.log2(batch), np.log2(batches), mean))


def estimate(args, rows: list[dict], pairs: dict[tuple[str, int], int]) -> dict:
    by_system = dict.fromkeys(args.systems, 0.0)
    setup = 0.0
    for (model, batch), n in pairs.items():
        setup += n * per_pair(rows, model, "(setup)", batch)
        for system in args.systems:
            by_system[system] += len(args.ratios) * n * per_pair(rows, model, system, batch)
    total = setup + sum(by_system.values())
    configs = len(args.models) * len(args.batches) * len(args.ratios) * len(args.systems)
    return {"configurations": configs, "cpu_hours": total / 3600, "setup_cpu_hours": setup / 3600,
            "cpu_hours_by_system": {k: v / 3600 for k, v in by_system.items()},
            "share_by_system": {k: v / total for k, v in by_system.items()}}


def git_rev() -> str | None:
    try:
        import dali_sim
        root = Path(dali_sim.__file__).resolve().parents[1]
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None) -> int:
    args = parse_args(argv)
    import dali_sim
    load0 = os.getloadavg()
    print(f"sweep_estimate: {platform.processor() or platform.machine()}, load {load0[0]:.2f}, {load0[1]:.2f}, "
          f"{load0[2]:.2f}; dali_sim from {Path(dali_sim.__file__).parent} (git {git_rev()})", flush=True)
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dali-sweep-estimate-") as tmp:
        rows = sample(args, Path(tmp), rng)
        pairs = full_pairs(args, Path(tmp))
    est = estimate(args, rows, pairs)
    load1 = os.getloadavg()
    print(f"\nsampled {len(rows)} measurements in {time.perf_counter() - t0:.0f} s wall; load after "
          f"{load1[0]:.2f}, {load1[1]:.2f}, {load1[2]:.2f}")
    print(f"sweep: {len(args.models)} models x {len(args.batches)} batch sizes x {len(args.ratios)} cache ratios x "
          f"{len(args.systems)} systems = {est['configurations']:,} configurations; traces {args.sequences} x "
          f"({args.prompt_len} + {args.gen_len}) tokens")
    print(f"estimated CPU-hours: {est['cpu_hours']:.2f} (shared setup {est['setup_cpu_hours']:.2f})")
    for system, h in est["cpu_hours_by_system"].items():
        print(f"  {system:<18} {h:7.2f} h  {100 * est['share_by_system'][system]:5.1f} %")
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in
                                                      vars(args).items()},
                                         "git": git_rev(), "load_before": load0, "load_after": load1,
                                         "samples": rows, "estimate": est}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
