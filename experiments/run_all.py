"""Run every experiment script with its defaults (or ``--quick``) into one output folder.

    python experiments/run_all.py [--quick] [--out DIR] [--only fig14_assignment,...]
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common as C  # noqa: E402

SCRIPTS = ("fig12_13_speedups", "fig14_assignment", "table4_greedy_vs_exact", "fig17_18_sensitivity",
           "fig19_breakdown", "presets_vs_oracle", "prefetch_accuracy",
           "recorded_trace", "published_validation")


def main(argv=None) -> int:
    p = C.parser(__doc__.split("\n\n")[0])
    p.add_argument("--only", type=C.str_list, default=list(SCRIPTS), help="comma-separated script names")
    args = p.parse_args(argv)
    unknown = set(args.only) - set(SCRIPTS)
    if unknown:
        p.error(f"unknown scripts {sorted(unknown)}; choose from {', '.join(SCRIPTS)}")
    failed = []
    for name in args.only:
        cmd = [sys.executable, str(HERE / f"{name}.py"), "--out", str(args.out), "--seed", str(args.seed)]
        if args.quick:
            cmd.append("--quick")
        t0 = time.perf_counter()
        C.progress(f"== {name}")
        rc = subprocess.call(cmd)
        C.progress(f"== {name}: exit {rc}, {time.perf_counter() - t0:.0f} s")
        if rc:
            failed.append(name)
    if failed:
        C.progress(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
