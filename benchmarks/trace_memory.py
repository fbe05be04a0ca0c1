"""Peak memory of simulating large traces (issue 13, item 6).

    python benchmarks/trace_memory.py                       # both cases (synthesises ~10 M + 3 M rows once)
    python benchmarks/trace_memory.py --case rows10m        # `dali sim run --no-timing` on a 10 M-row trace
    python benchmarks/trace_memory.py --case qwen-lookahead # `dali` on 64 x 1024 Qwen3 tokens, 2 lookahead columns
    python benchmarks/trace_memory.py --json mem.json --cache out/bench-memory

Each case runs the `dali sim run` command in a fresh child process and reports its peak resident set
size (``ru_maxrss`` from ``os.wait4`` on that child, i.e. the kernel's high-water mark of the whole
run: reading, validation, workload, simulation and results), its wall time and the trace's rows and
size on disk. Traces are synthesised once into ``--cache`` (default ``out/bench-memory``) and reused.

Cases (targets of the issue):

* ``rows10m``: Qwen3-30B-A3B shape (48 MoE layers, 128 experts, top-8), 64 sequences x (256 prompt +
  2,999 decode) tokens = 10.0 M rows with gate weights and no lookahead column; ``gpu-lru``,
  ``--no-timing``, batch 32. Target: under 1.5 GB.
* ``qwen-lookahead``: the same shape, 64 sequences x (512 prompt + 512 decode) tokens = 3.1 M rows with
  ``residual`` and ``next-gate`` lookahead columns; ``dali`` (SimPy path), batch 32. Target: under 3 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

CASES = {
    "rows10m": {
        "synth": ["--model", "qwen3-30b-a3b", "--sequences", "64", "--prompt-len", "256", "--gen-len", "2999",
                  "--seed", "1"],
        "sim": ["--system", "gpu-lru", "--no-timing", "--batch-size", "32"],
        "target_gib": 1.5,
    },
    "qwen-lookahead": {
        "synth": ["--model", "qwen3-30b-a3b", "--sequences", "64", "--prompt-len", "512", "--gen-len", "512",
                  "--seed", "1", "--lookahead", "residual=0.9", "--lookahead", "next-gate=0.75"],
        "sim": ["--system", "dali", "--batch-size", "32"],
        "target_gib": 3.0,
    },
}


def dali_command() -> list[str]:
    return [sys.executable, "-m", "dali_sim"]


def run_measured(cmd: list[str]) -> tuple[float, float, int, str]:
    """(peak RSS in GiB, wall seconds, exit status, stdout) of ``cmd`` run as a child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss / 2**20, time.perf_counter() - start, proc.returncode, out


def trace_for(case: str, cache: Path) -> Path:
    path = cache / f"{case}.parquet"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        cmd = dali_command() + ["trace", "synth", *CASES[case]["synth"], "-q", "-o", str(path)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        print(f"synthesised {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=list(CASES), action="append", help="case(s) to run (default: all)")
    ap.add_argument("--cache", type=Path, default=Path("out/bench-memory"), help="folder of the synthesised traces")
    ap.add_argument("--json", type=Path, help="also write the measurements as JSON")
    args = ap.parse_args()
    from dali_sim.trace.reader import read_meta

    rows = []
    for case in args.case or list(CASES):
        path = trace_for(case, args.cache)
        meta = read_meta(path)
        cmd = dali_command() + ["sim", "run", "--trace", str(path), *CASES[case]["sim"], "--json"]
        peak, wall, rc, out = run_measured(cmd)
        if rc != 0:
            raise SystemExit(f"{case}: {' '.join(cmd)} failed ({rc}):\n{out[-2000:]}")
        row = {"case": case, "rows": meta.num_rows, "file_mib": path.stat().st_size / 2**20,
               "predictors": sorted(meta.predictors), "command": " ".join(CASES[case]["sim"]),
               "peak_rss_gib": peak, "bytes_per_row": peak * 2**30 / meta.num_rows, "wall_s": wall,
               "target_gib": CASES[case]["target_gib"], "ok": peak < CASES[case]["target_gib"]}
        rows.append(row)
        print(f"{case}: {meta.num_rows:,} rows ({row['file_mib']:.0f} MiB on disk, lookahead "
              f"{', '.join(row['predictors']) or 'none'}), `dali sim run {row['command']}`: peak RSS "
              f"{peak:.2f} GiB ({row['bytes_per_row']:.0f} B/row; target < {row['target_gib']} GB: "
              f"{'ok' if row['ok'] else 'MISSED'}), {wall:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                                     "load_avg": os.getloadavg()}, "cases": rows}, indent=2))


if __name__ == "__main__":
    main()
