"""How long `dali` takes before doing anything: wall time of small commands, and what the CLI imports.

    python benchmarks/startup.py [--repeats 5]

Each command runs ``--repeats`` times in a fresh process (the console script, as a user types it); the
median and the minimum are printed, with ``python -c pass`` as the floor. Then ``python -X importtime``
lists the slowest imports of ``dali_sim.cli.main`` and whether scipy, pandas or pyarrow were loaded.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time

COMMANDS = (["--help"], ["trace", "--help"], ["model", "list"], ["sim", "systems"], ["hw", "list"],
            ["trace", "formats"], ["trace", "info", "traces/gpt-oss-20b.parquet"])
HEAVY = ("scipy", "pandas", "pyarrow", "simpy", "matplotlib", "torch")


def timed(cmd: list[str], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        out.append(time.perf_counter() - start)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    dali = shutil.which("dali") or sys.exit("the dali console script is not on PATH (pip install -e .)")
    floor = timed([sys.executable, "-c", "pass"], args.repeats)
    print(f"{'python -c pass':<40} median {statistics.median(floor):.3f} s  min {min(floor):.3f} s")
    for c in COMMANDS:
        t = timed([dali, *c], args.repeats)
        print(f"{'dali ' + ' '.join(c):<40} median {statistics.median(t):.3f} s  min {min(t):.3f} s")
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import sys, dali_sim.cli.main; print(sorted("
                        f"m for m in {HEAVY!r} if m in sys.modules))"], capture_output=True, text=True, check=True)
    rows = []
    for line in r.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = (p.strip() for p in line.split(":", 1)[1].split("|"))
            if cumulative.isdigit():
                rows.append((int(cumulative), name))
    print("slowest imports of dali_sim.cli.main (cumulative):")
    for us, name in sorted(rows, reverse=True)[:8]:
        print(f"  {us / 1e3:7.1f} ms  {name}")
    print(f"heavy modules loaded by `import dali_sim.cli.main`: {r.stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
