"""`dali sweep` scaling: one command, 1 vs 2 local workers, and local Ray giving the identical table.

    python benchmarks/sweep_scaling.py                 # 3 models x 6 batch sizes x 3 cache ratios x 6 systems
    python benchmarks/sweep_scaling.py --repeats 2 --json sweep.json
    python benchmarks/sweep_scaling.py --no-ray        # without the Ray run

The spec (written to ``--out``/spec.toml) sweeps 324 configurations: DeepSeek-V2-Lite, OLMoE-1B-7B and
Qwen3-30B-A3B shapes (short synthetic traces with residual, next-gate, gate2 and gate3 lookahead
columns) x batch 1, 2, 4, 8, 16, 32 x cache ratio 0.1, 0.2, 0.3 x cpu-only, gpu-lru, llamacpp,
ktransformers, hybrimoe, dali. The traces are synthesised once (not timed) and copied into each run's
folder; each run is the whole command ``dali sweep SPEC -o OUT --workers N -q`` in a fresh process
(start-up, pool, reading, simulation and writing included), timed by wall clock, with the 1-minute
load average before and after (the machine is shared: repeat when it is loaded). Every run's results
table must equal the first one's (``pandas.testing.assert_frame_equal``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

SPEC = """\
# benchmarks/sweep_scaling.py: 3 models x 6 batch sizes x 3 cache ratios x 6 systems = 324 configurations
systems = ["cpu-only", "gpu-lru", "llamacpp", "ktransformers", "hybrimoe", "dali"]
baseline = "llamacpp"

[grid]
batch_size = [1, 2, 4, 8, 16, 32]
cache_ratio = [0.1, 0.2, 0.3]
"""
MODELS = ("deepseek-v2-lite", "olmoe-1b-7b", "qwen3-30b-a3b")
LOOKAHEAD = '["residual=0.9", "next-gate=0.75", "gate2=0.6@2", "gate3=0.5@3"]'


def write_spec(folder: Path, sequences: int, prompt: int, gen: int) -> Path:
    text = SPEC
    for i, model in enumerate(MODELS):
        text += (f"\n[traces.{model}]\nsynth = {{ model = \"{model}\", sequences = {sequences}, prompt_len = {prompt}, "
                 f"gen_len = {gen}, seed = {i + 1}, lookahead = {LOOKAHEAD} }}\n")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "spec.toml"
    path.write_text(text)
    return path


def dali(*args: str) -> list[str]:
    return [sys.executable, "-m", "dali_sim", *args]


def timed_run(spec: Path, out: Path, traces: Path, engine: list[str]) -> dict:
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(traces, out / "traces")
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    r = subprocess.run(dali("sweep", str(spec), "-o", str(out), "-q", *engine), capture_output=True, text=True)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(engine)} failed:\n{r.stderr[-3000:]}")
    return {"engine": " ".join(engine), "wall_s": wall, "load_before": load_before, "load_after": os.getloadavg()[0],
            "log": r.stderr.strip().splitlines()[-1]}


def main() -> None:
    from dali_sim.workload.profiling import total_sequences

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("out/bench-sweep"))
    # 43 sequences: the default profiling split keeps 32 evaluated, so the largest batch (32) fits
    ap.add_argument("--sequences", type=int, default=total_sequences(32))
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--gen-len", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each engine (alternating)")
    ap.add_argument("--no-ray", action="store_true", help="skip the local Ray run")
    ap.add_argument("--json", type=Path, help="also write every measurement as JSON")
    args = ap.parse_args()
    import pandas as pd

    spec = write_spec(args.out, args.sequences, args.prompt_len, args.gen_len)
    from dali_sim.sweep.spec import load_spec, plan_runs

    source = args.out / "source"
    plan_runs(load_spec(spec), source)  # synthesises the recipes once into source/traces (not timed)
    traces = source / "traces"
    reference = None
    engines = [["--workers", "1"], ["--workers", "2"]] + ([] if args.no_ray else [["--ray", "auto"]])
    runs = []
    for repeat in range(args.repeats):
        for engine in engines:
            name = "-".join(e.strip("-") for e in engine)
            row = timed_run(spec, args.out / f"run-{name}", traces, engine) | {"repeat": repeat}
            table = pd.read_parquet(args.out / f"run-{name}" / "results.parquet")
            # an error names its trace file, which lies in each run's own folder
            table["error"] = table["error"].str.replace(str(args.out / f"run-{name}"), "OUT", regex=False)
            if reference is None:
                reference = table
            pd.testing.assert_frame_equal(table, reference)  # identical results, whatever ran them
            row["identical_table"] = True
            row["configurations"], row["failed"] = len(table), int((table["status"] != "ok").sum())
            runs.append(row)
            print(f"{row['engine']:<12} {row['wall_s']:7.1f} s  load {row['load_before']:.2f} -> "
                  f"{row['load_after']:.2f}  {row['configurations']} configurations ({row['failed']} failed), "
                  "table identical", flush=True)
    serial = min(r["wall_s"] for r in runs if r["engine"] == "--workers 1")
    two = min(r["wall_s"] for r in runs if r["engine"] == "--workers 2")
    print(f"speedup with 2 workers: {serial / two:.2f}x (best of {args.repeats})")
    if args.json:
        args.json.write_text(json.dumps({"machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
                                         "settings": vars(args) | {"out": str(args.out), "json": str(args.json)},
                                         "runs": runs, "speedup_2_workers": serial / two}, indent=2))


if __name__ == "__main__":
    main()
