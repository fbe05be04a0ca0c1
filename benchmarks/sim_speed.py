"""Simulator speed: simulated (step, MoE layer) pairs per second, SimPy path vs no-timing path.

    python benchmarks/sim_speed.py                 # full run (about 2-3 minutes on 2 slow cores)
    python benchmarks/sim_speed.py --quick         # about 30 s: one run per case, smaller traces
    python benchmarks/sim_speed.py --json out.json # also write every measurement as JSON
    python benchmarks/sim_speed.py --profile qwen3-30b-a3b:gpu-lru:32:simpy   # cProfile one case

What it measures (one process, one core):

* throughput: each model x system x batch size x path (``simpy`` = ``simulate(timing=True)``, ``replay``
  = ``simulate(timing=False)``) on a synthetic decode-only trace (``prompt_len=0``). Batch sizes > 1 use
  ``--sequences`` x ``--gen-len`` (default 64 x 128); batch 1 uses ``--batch1-sequences`` x ``--gen-len``
  (default 8 x 128: batch 1 has 32x more steps per token, and pairs/s hardly depends on the length);
* scaling: one model/system at one batch size, generation length (or sequence count) x1, x4, x16;
* the target: Mixtral, 64 sequences x 128 decode tokens, batch 32, SimPy path, gpu-lru, under 2 s.

A (step, layer) pair is one ``Controller.plan`` call: pairs = ``summary["steps"]`` x MoE layers.
Traces are synthesised into a temporary directory and read once (``read_trace``); only ``simulate()``
is timed (``time.perf_counter``), which includes its own setup (workload build, memory plan, the
trace file's SHA-256 for the manifest) and its result frames. Each case reports the best of
``--repeats`` runs (``gc.collect()`` before each), with fewer runs once a case has used
``--case-budget`` seconds.

One core: the simulator is single-threaded Python, but numpy/scipy's BLAS and pyarrow's pool may
start threads. This script sets ``OMP_NUM_THREADS=1``, ``OPENBLAS_NUM_THREADS=1``,
``MKL_NUM_THREADS=1`` and ``NUMEXPR_NUM_THREADS=1`` *before* importing numpy (pyarrow also sizes its
CPU pool from ``OMP_NUM_THREADS``); other variables such as ``OPENBLAS_CORETYPE`` are left alone.
``--pin-cpu N`` additionally restricts the process to CPU N (``os.sched_setaffinity``).
"""

from __future__ import annotations

import os

# Must happen before numpy (imported by dali_sim) is loaded: thread pools are sized at import time.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")
for _var in THREAD_VARS:
    os.environ[_var] = "1"

import argparse
import cProfile
import gc
import io
import json
import platform
import pstats
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dali_sim.policies.systems import resolve_system
from dali_sim.runtime.future import FutureDemand
from dali_sim.sim import simulate
from dali_sim.trace.reader import Trace, read_trace
from dali_sim.trace.synth import SynthConfig, synthesize
from dali_sim.workload.builder import Workload, WorkloadConfig
from dali_sim.workload.profiling import ProfileSpec

#: speed is measured on the whole trace (no profiling split), so the workloads keep their documented sizes
WHOLE_TRACE = ProfileSpec(share=0.0)

PATHS = {"simpy": True, "replay": False}  # path name -> simulate(timing=...)
TARGET = {"model": "mixtral-8x7b", "sequences": 64, "gen_len": 128, "system": "gpu-lru", "batch": 32, "path": "simpy"}
TARGET_SECONDS = 2.0


@dataclass
class Measurement:
    model: str
    system: str
    batch: int
    path: str
    sequences: int
    gen_len: int
    steps: int
    moe_layers: int
    pairs: int
    best_s: float
    times_s: list[float]
    pairs_per_s: float
    us_per_pair: float
    hit_rate: float | None
    events: int | None
    makespan_s: float | None
    cpu_per_wall: float  # the largest process-CPU-time / wall-time over the runs (> 1: more than one core busy)
    cpu_best_s: float = 0.0  # the least process CPU time of the runs
    pairs_per_cpu_s: float = 0.0  # pairs / cpu_best_s: steadier than wall time on a shared machine


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path):
        self.args = args
        self.tmp = tmp
        self.traces: dict[tuple[str, int, int], Trace] = {}
        self.results: dict[tuple, Measurement] = {}
        self.synth_s = 0.0
        self.futures: dict[tuple[int, int], FutureDemand] = {}

    def trace(self, model: str, sequences: int, gen_len: int) -> Trace:
        key = (model, sequences, gen_len)
        if key not in self.traces:
            t0 = time.perf_counter()
            config = SynthConfig(model=model, sequences=sequences, prompt_len=0, gen_len=gen_len,
                                 seed=self.args.seed, lookahead=tuple(self.args.lookahead))
            path = synthesize(config, self.tmp / f"{model}-{sequences}x{gen_len}.parquet", progress=False)
            self.traces[key] = read_trace(path)
            self.synth_s += time.perf_counter() - t0
        return self.traces[key]

    def future(self, trace: Trace, system: str, batch: int) -> FutureDemand | None:
        """Next-use times for a system that reads the future (oracle-heuristic's Belady cache), computed
        from the trace's workload once per (trace, batch size) and not timed, as a sweep shares them."""
        conf = resolve_system(system, None, trace.model)
        if not any(c.build().needs_future for c in (conf.placement, conf.cache, conf.prefetch)):
            return None
        key = (id(trace), batch)
        if key not in self.futures:
            self.futures[key] = FutureDemand.from_workload(Workload(trace, WorkloadConfig(batch, 0)))
        return self.futures[key]

    def simulate(self, trace: Trace, system: str, batch: int, path: str):
        return simulate(trace, system, batch_size=batch, timing=PATHS[path], hardware=self.args.hardware,
                        profiling=WHOLE_TRACE, future=self.future(trace, system, batch))

    def drop_traces(self, keep: set[tuple[str, int, int]]) -> None:
        for key in list(self.traces):
            if key not in keep:
                del self.traces[key]
        self.futures.clear()
        gc.collect()

    def measure(self, model: str, sequences: int, gen_len: int, system: str, batch: int, path: str,
                repeats: int | None = None) -> Measurement:
        key = (model, sequences, gen_len, system, batch, path)
        if key in self.results:
            return self.results[key]
        trace = self.trace(model, sequences, gen_len)
        repeats = self.args.repeats if repeats is None else repeats
        times: list[float] = []
        cpu: list[float] = []  # process CPU time (all threads) per run: ~ wall time on one core
        result = None
        self.future(trace, system, batch)  # computed once, outside the timed runs
        while len(times) < max(1, repeats):
            if times and sum(times) + min(times) > self.args.case_budget:
                break  # another run would overrun this case's budget: keep the best so far
            result = None
            gc.collect()
            c0, t0 = time.process_time(), time.perf_counter()
            result = self.simulate(trace, system, batch, path)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        s = result.summary
        layers = trace.model.num_moe_layers
        pairs = int(s["steps"]) * layers
        best = min(times)
        cpu_ratio = max(c / t for c, t in zip(cpu, times))
        m = Measurement(model=model, system=system, batch=batch, path=path, sequences=sequences, gen_len=gen_len,
                        steps=int(s["steps"]), moe_layers=layers, pairs=pairs, best_s=best, times_s=times,
                        pairs_per_s=pairs / best, us_per_pair=best / pairs * 1e6,
                        hit_rate=_num(s.get("hit_rate")), events=s.get("events"), makespan_s=_num(s.get("makespan_s")),
                        cpu_per_wall=cpu_ratio, cpu_best_s=min(cpu), pairs_per_cpu_s=pairs / min(cpu))
        self.results[key] = m
        if self.args.verbose:
            print(f"  [{model} {system} b{batch} {path} {sequences}x{gen_len}] best {best:.3f} s of "
                  f"{len(times)} run(s)", file=sys.stderr, flush=True)
        return m


def _num(v):
    if v is None:
        return None
    v = float(v)
    return None if np.isnan(v) else v


# ---- reporting ------------------------------------------------------------------------------------------
def table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    right = set(range(len(headers))) if right is None else right
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def os_threads() -> int | None:
    """Threads of this process as the kernel counts them (numpy/pyarrow pools included), or None."""
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("Threads:"))
    except (OSError, StopIteration, ValueError):
        return None


def machine_info(args) -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                                cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    import simpy

    import dali_sim

    return {
        "cpu": cpu, "machine": platform.machine(), "cpu_count": os.cpu_count(), "affinity": affinity,
        "loadavg_at_start": load, "python": platform.python_version(), "numpy": np.__version__,
        "simpy": simpy.__version__, "dali_sim": getattr(dali_sim, "__version__", None), "git_head": commit,
        "env": {v: os.environ.get(v) for v in (*THREAD_VARS, "OPENBLAS_CORETYPE")},
        "hardware_profile": args.hardware,
    }


# ---- sections -------------------------------------------------------------------------------------------
def run_throughput(bench: Bench, args) -> list[Measurement]:
    out = []
    for model in args.models:
        for batch in args.batches:
            seqs = args.batch1_sequences if batch == 1 else args.sequences
            for system in args.systems:
                for path in args.paths:
                    out.append(bench.measure(model, seqs, args.gen_len, system, batch, path))
        bench.drop_traces(keep={(TARGET["model"], TARGET["sequences"], TARGET["gen_len"])})
    return out


def print_throughput(ms: list[Measurement]) -> None:
    headers = ["model", "system", "batch", "path", "trace", "steps", "pairs", "best s", "pairs/s", "us/pair",
               "cpu s", "pairs/cpu-s", "runs", "cpu/wall", "events", "hit rate"]
    rows = [[m.model, m.system, m.batch, m.path, f"{m.sequences}x{m.gen_len}", m.steps, f"{m.pairs:,}",
             f"{m.best_s:.3f}", fmt_rate(m.pairs_per_s), f"{m.us_per_pair:.1f}", f"{m.cpu_best_s:.3f}",
             fmt_rate(m.pairs_per_cpu_s), len(m.times_s), f"{m.cpu_per_wall:.2f}",
             "-" if m.events is None else f"{m.events:,}", "-" if m.hit_rate is None else f"{m.hit_rate:.3f}"]
            for m in ms]
    print("Throughput (best of runs; pairs = steps x MoE layers; cpu s = least process CPU time of the runs; "
          "cpu/wall = process CPU time over wall time, worst run; events = intervals the SimPy path timed)")
    print(table(headers, rows, right={2, *range(5, 16)}))
    # SimPy overhead over the no-timing path, case by case
    by = {(m.model, m.system, m.batch, m.path): m for m in ms}
    pairs = [(k, by[k], by[(k[0], k[1], k[2], "replay")]) for k in by if k[3] == "simpy" and (k[0], k[1], k[2], "replay") in by]
    if pairs:
        print()
        print("SimPy path cost relative to the no-timing path (same trace, same decisions)")
        rows = [[k[0], k[1], k[2], f"{s.best_s / r.best_s:.2f}x", f"{s.us_per_pair - r.us_per_pair:.1f}",
                 "yes" if s.hit_rate == r.hit_rate else f"NO ({s.hit_rate} vs {r.hit_rate})"]
                for k, s, r in pairs]
        print(table(["model", "system", "batch", "simpy/replay", "extra us/pair", "same hit rate"], rows,
                    right={2, 3, 4}))


def run_scaling(bench: Bench, args) -> list[dict]:
    rows = []
    for system in args.scale_systems:
        for path in args.paths:
            base = None
            for f in args.scale_factors:
                seqs = args.scale_sequences * (f if args.scale_by == "sequences" else 1)
                gen = args.scale_gen_len * (f if args.scale_by == "gen" else 1)
                m = bench.measure(args.scale_model, seqs, gen, system, args.scale_batch, path)
                base = base or (f, m)
                rows.append({"factor": f, "measurement": m,
                             "time_ratio": m.best_s / base[1].best_s,
                             "ideal_ratio": f / base[0]})
    return rows


def print_scaling(rows: list[dict], args) -> None:
    if not rows:
        return
    what = "generation length" if args.scale_by == "gen" else "sequence count"
    print(f"Scaling with trace length ({what}; {args.scale_model}, batch {args.scale_batch}): "
          "linear growth = time ratio equal to the factor, pairs/s flat")
    headers = ["system", "path", "factor", "trace", "steps", "pairs", "best s", "pairs/s", "us/pair", "runs",
               "time ratio", "linear"]
    out = []
    for r in rows:
        m = r["measurement"]
        out.append([m.system, m.path, f"x{r['factor']}", f"{m.sequences}x{m.gen_len}", m.steps, f"{m.pairs:,}",
                    f"{m.best_s:.3f}", fmt_rate(m.pairs_per_s), f"{m.us_per_pair:.1f}", len(m.times_s),
                    f"{r['time_ratio']:.2f}", f"{r['ideal_ratio']:.0f}"])
    print(table(headers, out, right=set(range(2, 12))))
    # time = fixed + pairs / marginal rate, least squares over the factors of each (system, path)
    for fit in scaling_fits(rows):
        print(f"  {fit['system']} {fit['path']}: time ~ {fit['fixed_s']:.3f} s + pairs / "
              f"{fmt_rate(fit['marginal_pairs_per_s'])} pairs/s (least-squares line; the fixed part is per-run "
              "setup plus the cold-cache start)")


def scaling_fits(rows: list[dict]) -> list[dict]:
    out = []
    for key in dict.fromkeys((r["measurement"].system, r["measurement"].path) for r in rows):
        ms = [r["measurement"] for r in rows if (r["measurement"].system, r["measurement"].path) == key]
        if len(ms) >= 2:
            fixed, marginal = linear_fit(ms)
            out.append({"system": key[0], "path": key[1], "fixed_s": fixed, "marginal_pairs_per_s": marginal})
    return out


def linear_fit(ms: list[Measurement]) -> tuple[float, float]:
    """(intercept s, 1 / slope in pairs/s) of best time against pairs."""
    x = np.array([m.pairs for m in ms], dtype=float)
    y = np.array([m.best_s for m in ms])
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(1.0 / slope) if slope > 0 else float("inf")


def run_target(bench: Bench, args) -> Measurement:
    t = TARGET
    return bench.measure(t["model"], t["sequences"], t["gen_len"], t["system"], t["batch"], t["path"],
                         repeats=max(args.repeats, 3))


def print_target(m: Measurement) -> None:
    ok = m.best_s < TARGET_SECONDS
    print(f"Target: {m.model}, {m.sequences} sequences x {m.gen_len} decode tokens, batch {m.batch}, "
          f"{m.path} path, {m.system}: best {m.best_s:.3f} s of {len(m.times_s)} "
          f"({', '.join(f'{x:.3f}' for x in m.times_s)}), {fmt_rate(m.pairs_per_s)} pairs/s "
          f"-> {'PASS' if ok else 'FAIL'} (< {TARGET_SECONDS:g} s)")


def run_profile(bench: Bench, args, spec: str) -> str:
    try:
        model, system, batch, path = spec.split(":")
        batch = int(batch)
        if path not in PATHS:
            raise ValueError
    except ValueError:
        raise SystemExit(f"--profile {spec!r}: expected MODEL:SYSTEM:BATCH:simpy|replay") from None
    seqs = args.batch1_sequences if batch == 1 else args.sequences
    trace = bench.trace(model, seqs, args.gen_len)
    # a warm-up run first: numba compiles its kernels and scipy is imported on first use, costs a sweep
    # pays once per worker process, not per configuration
    bench.simulate(trace, system, batch, path)
    gc.collect()
    prof = cProfile.Profile()
    t0, c0 = time.perf_counter(), time.process_time()
    prof.enable()
    bench.simulate(trace, system, batch, path)
    prof.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.strip_dirs()
    buf.write(f"cProfile of {model} {system} batch {batch} {path} ({seqs}x{args.gen_len}): {wall:.2f} s under the "
              f"profiler ({cpu:.2f} s process CPU time; after one warm-up run)\n")
    st.sort_stats("tottime").print_stats(args.profile_lines)
    st.sort_stats("cumulative").print_stats(args.profile_lines)
    return "\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip())


# ---- main -----------------------------------------------------------------------------------------------
def csv(cast):
    return lambda s: [cast(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="one run per case, batch-1 trace of 2 sequences, scaling from 16 tokens (x1, x4, x16)")
    ap.add_argument("--models", type=csv(str), default=["mixtral-8x7b", "qwen3-30b-a3b"],
                    help="model presets (comma-separated; default: mixtral-8x7b,qwen3-30b-a3b)")
    ap.add_argument("--systems", type=csv(str), default=["gpu-lru", "cpu-only"],
                    help="system presets (see `dali sim systems`; default: gpu-lru,cpu-only)")
    ap.add_argument("--batches", type=csv(int), default=[1, 32], help="batch sizes (default: 1,32)")
    ap.add_argument("--paths", type=csv(str), default=list(PATHS), help="simpy,replay (default: both)")
    ap.add_argument("--sequences", type=int, default=64, help="sequences in the trace for batch > 1 (default 64)")
    ap.add_argument("--batch1-sequences", type=int, default=None,
                    help="sequences in the trace for batch 1 (default 8; 2 with --quick)")
    ap.add_argument("--gen-len", type=int, default=128, help="decode tokens per sequence (default 128)")
    ap.add_argument("--scale-model", default="mixtral-8x7b", help="model of the scaling section")
    ap.add_argument("--scale-systems", type=csv(str), default=["gpu-lru"], help="systems of the scaling section")
    ap.add_argument("--scale-batch", type=int, default=32, help="batch size of the scaling section (default 32)")
    ap.add_argument("--scale-by", choices=("gen", "sequences"), default="gen",
                    help="grow the generation length (default) or the number of sequences")
    ap.add_argument("--scale-factors", type=csv(int), default=[1, 4, 16], help="default: 1,4,16")
    ap.add_argument("--scale-gen-len", type=int, default=None,
                    help="generation length at x1 (default 32, so x4 is the 128-token target; 16 with --quick)")
    ap.add_argument("--scale-sequences", type=int, default=64, help="sequences at x1 (default 64)")
    ap.add_argument("--no-scaling", action="store_true", help="skip the scaling section")
    ap.add_argument("--repeats", type=int, default=None, help="runs per case, best reported (default 3; 1 with --quick)")
    ap.add_argument("--case-budget", type=float, default=15.0,
                    help="stop repeating a case once another run would push it past this many seconds (default 15)")
    ap.add_argument("--hardware", default="rtx3090-epyc7532", help="hardware profile (default: rtx3090-epyc7532)")
    ap.add_argument("--seed", type=int, default=0, help="synthetic trace seed")
    ap.add_argument("--lookahead", action="append", default=[], metavar="NAME=ACC[@OFFSET]",
                    help="a lookahead column of the synthetic traces (repeatable), for systems that prefetch, e.g. "
                         "residual=0.9 for dali; hybrimoe: next-gate=0.7, gate2=0.6@2, gate3=0.5@3")
    ap.add_argument("--pin-cpu", type=int, default=None, help="restrict the process to this CPU (sched_setaffinity)")
    ap.add_argument("--profile", metavar="MODEL:SYSTEM:BATCH:PATH", action="append", default=[],
                    help="also cProfile one case (repeatable), e.g. qwen3-30b-a3b:gpu-lru:32:simpy")
    ap.add_argument("--profile-only", action="store_true", help="run only the --profile cases")
    ap.add_argument("--profile-lines", type=int, default=15, help="functions shown per cProfile listing")
    ap.add_argument("--json", metavar="OUT", type=Path, help="write all measurements as JSON")
    ap.add_argument("-v", "--verbose", action="store_true", help="log each case to stderr as it finishes")
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.batch1_sequences is None:
        args.batch1_sequences = 2 if args.quick else 8
    if args.scale_gen_len is None:
        args.scale_gen_len = 16 if args.quick else 32
    bad = [p for p in args.paths if p not in PATHS]
    if bad:
        ap.error(f"--paths: unknown {bad}; choose from {list(PATHS)}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # keep the table and -v progress on stderr in order
    if args.pin_cpu is not None:
        os.sched_setaffinity(0, {args.pin_cpu})
    info = machine_info(args)
    aff = info["affinity"]
    print(f"sim_speed: {info['cpu']} ({info['machine']}), {info['cpu_count']} CPUs, "
          f"affinity {aff if aff is None or len(aff) < 8 else f'{len(aff)} CPUs'}, "
          f"load {', '.join(f'{x:.2f}' for x in info['loadavg_at_start'] or [])}; Python {info['python']}, "
          f"numpy {info['numpy']}, simpy {info['simpy']}; git {info['git_head']}")
    print("threads: " + ", ".join(f"{k}={v}" for k, v in info["env"].items() if v is not None)
          + f"; hardware profile {args.hardware}; repeats {args.repeats} (case budget {args.case_budget:g} s)")
    print()
    t_start = time.perf_counter()
    report: dict = {"machine": info, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="dali-sim-speed-") as tmp:
        bench = Bench(args, Path(tmp))
        if not args.profile_only:
            target = run_target(bench, args)  # first, while the machine is as quiet as it gets
            ms = run_throughput(bench, args)
            print_throughput(ms)
            print()
            scaling = [] if args.no_scaling else run_scaling(bench, args)
            bench.drop_traces(keep=set())
            if scaling:
                print_scaling(scaling, args)
                print()
            print_target(target)
            report |= {
                "throughput": [asdict(m) for m in ms],
                "scaling": [{"factor": r["factor"], "time_ratio": r["time_ratio"], "ideal_ratio": r["ideal_ratio"],
                             **asdict(r["measurement"])} for r in scaling],
                "scaling_fit": scaling_fits(scaling),
                "target": {**asdict(target), "limit_s": TARGET_SECONDS, "pass": target.best_s < TARGET_SECONDS},
            }
        profiles = {}
        for spec in args.profile:
            print()
            profiles[spec] = run_profile(bench, args, spec)
            print(profiles[spec])
        if profiles:
            report["profiles"] = profiles
    total = time.perf_counter() - t_start
    import pyarrow

    threads = os_threads()
    print(f"\ntotal {total:.1f} s (trace synthesis and reading {bench.synth_s:.1f} s, not in the numbers above); "
          f"process threads at the end: {threads}, pyarrow CPU pool: {pyarrow.cpu_count()}")
    report |= {"total_s": total, "synth_s": bench.synth_s, "os_threads_at_end": threads,
               "pyarrow_cpu_count": pyarrow.cpu_count()}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
