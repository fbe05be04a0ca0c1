"""Run every experiment script with its defaults (or ``--quick``) into one output folder, write the headline
table ``<out>/headline.md``, then execute ``notebooks/ablation.ipynb`` on those results and save it with its
figures as ``<out>/ablation.ipynb``.

The paper's figures are sweeps (experiments/sweeps/*.toml) run with local worker processes into
``<out>/sweeps/`` and resumed: a rerun runs only what is missing. ``--quick`` writes to
experiments/results-quick/ (never to the committed experiments/results/).

    python experiments/run_all.py [--quick] [--out DIR] [--workers N] [--only fig14_assignment,...] [--no-notebook]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOTEBOOK = HERE.parent / "notebooks" / "ablation.ipynb"
sys.path.insert(0, str(HERE))

import common as C  # noqa: E402

SCRIPTS = ("fig12_13_speedups", "implementation_share", "fig14_assignment", "table4_greedy_vs_exact", "fig17_18_sensitivity",
           "fig19_breakdown", "presets_vs_oracle", "prefetch_accuracy",
           "recorded_trace", "published_validation")
HEADLINE_INPUTS = ("fig12_13_speedups", "fig14_assignment", "table4_greedy_vs_exact", "fig17_18_sensitivity",
                   "fig19_breakdown")  # the headline table reads their results


def render_notebook(results: Path, timeout: int = 600) -> Path:
    """Execute the ablation notebook on ``results`` and save it, outputs (figures) included, as
    ``results/ablation.ipynb``; the notebook in notebooks/ stays without outputs (diffable)."""
    import nbclient
    import nbformat

    from dali_sim.files import write_text_atomic

    nb = nbformat.read(NOTEBOOK, as_version=4)
    old = os.environ.get("DALI_RESULTS")
    os.environ["DALI_RESULTS"] = str(Path(results).resolve())  # the kernel inherits it
    try:
        nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    finally:
        if old is None:
            os.environ.pop("DALI_RESULTS", None)
        else:
            os.environ["DALI_RESULTS"] = old
    return write_text_atomic(Path(results) / NOTEBOOK.name, nbformat.writes(nb))


def main(argv=None) -> int:
    p = C.parser(__doc__.split("\n\n")[0])
    p.add_argument("--only", type=C.str_list, default=list(SCRIPTS), help="comma-separated script names")
    p.add_argument("--no-notebook", action="store_true", help="do not execute and save the ablation notebook")
    args = p.parse_args(argv)
    unknown = set(args.only) - set(SCRIPTS)
    if unknown:
        p.error(f"unknown scripts {sorted(unknown)}; choose from {', '.join(SCRIPTS)}")
    failed = []
    t_all = time.perf_counter()
    for name in args.only:
        cmd = [sys.executable, str(HERE / f"{name}.py"), "--out", str(args.out), "--seed", str(args.seed)]
        if args.workers is not None:
            cmd += ["--workers", str(args.workers)]
        if args.quick:
            cmd.append("--quick")
        t0 = time.perf_counter()
        C.progress(f"== {name}")
        rc = subprocess.call(cmd)
        C.progress(f"== {name}: exit {rc}, {time.perf_counter() - t0:.0f} s")
        if rc:
            failed.append(name)
    if set(HEADLINE_INPUTS) <= set(args.only) and not failed:
        from headline import NAME as HEADLINE, headline

        from dali_sim.files import write_text_atomic

        C.progress(f"== headline: {write_text_atomic(Path(args.out) / f'{HEADLINE}.md', headline(Path(args.out)))}")
    if not args.no_notebook:
        try:
            C.progress(f"== notebook: {render_notebook(args.out)} (with its figures)")
        except ImportError as exc:
            C.progress(f"== notebook not rendered ({exc}): pip install -e '.[notebooks]'")
        except Exception as exc:  # a failing cell: reported, the results stay
            C.progress(f"== notebook failed: {type(exc).__name__}: {exc}")
            failed.append("notebook")
    C.progress(f"== run_all: {time.perf_counter() - t_all:.0f} s into {args.out}")
    if failed:
        C.progress(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
