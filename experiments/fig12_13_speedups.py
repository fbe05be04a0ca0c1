"""Paper Fig. 12 / 13: decode and prefill speedup of DALI over llama.cpp, KTransformers, MoE-Lightning
and HybriMoE, each competitor in both readings (``NAME`` = as the DALI paper ran it, ``NAME-best`` = the
most favourable reading; `dali sim systems -v`), per model and batch size, on the paper's testbed profile.

The runs are the sweep ``experiments/sweeps/fig12_13_speedups.toml`` (the paper's setup: cache ratio 0.5,
64 + 64 tokens, default precision, profiling split 0.25), run or resumed into ``<out>/sweeps/`` with local
workers; this script reads the store and draws. Speedup = DALI's per-sequence tokens/s / the system's (the
paper's metric, docs/metrics.md), > 1 = DALI faster. ``lower-bound`` (a time bound, docs/bounds.md) shows
how far DALI is from the fastest any system could be.

    python experiments/fig12_13_speedups.py [--quick] [--out DIR] [--workers N]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

import common as C  # noqa: E402
import style as S  # noqa: E402

NAME = "fig12_13_speedups"
COMPETITORS = ("llamacpp", "ktransformers", "moe-lightning", "hybrimoe")
OURS = ("dali", "dali-plus")
PAPER = {  # the paper's headline speedups of DALI (issue text)
    "decode": {"llamacpp": 3.97, "ktransformers": 2.16, "moe-lightning": 1.48, "hybrimoe": 1.32},
    "prefill": {"llamacpp": 7.62, "ktransformers": 3.80, "moe-lightning": 2.45, "hybrimoe": 2.00},
}
HEADLINE_BATCHES = (4, 16, 64)  # the paper's batch sizes of the headline numbers; batch 1 is reported apart
PHASES = ("decode", "prefill")


def speedups(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    for ours in OURS + ("lower-bound",):
        tag = ours.replace("-", "_")
        for phase in PHASES:
            df[f"{tag}_{phase}_speedup"] = C.speed_ratio(df, f"{phase}_tokens_per_s", ours, ["model", "batch_size"])
    df["reading"] = [C.reading(s) if C.competitor(s) in COMPETITORS else "" for s in df.system]
    return df


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per competitor and reading: DALI's (and dali-plus') speedup, geometric mean over the models at the
    headline batch sizes, at each batch size, and the paper's number."""
    rows = []
    for ours in OURS:
        tag = ours.replace("-", "_")
        for comp in COMPETITORS:
            for rd, system in (("paper", comp), ("best", f"{comp}-best")):
                d = df[df.system == system]
                row = {"system": ours, "over": comp, "reading": rd}
                for phase in PHASES:
                    col = f"{tag}_{phase}_speedup"
                    row[f"{phase} paper"] = PAPER[phase][comp] if ours == "dali" else float("nan")
                    row[f"{phase} ours (bs {'/'.join(map(str, HEADLINE_BATCHES))})"] = C.geomean(
                        d[d.batch_size.isin(HEADLINE_BATCHES)][col])
                    for bs in sorted(d.batch_size.unique()):
                        row[f"{phase} bs{bs}"] = C.geomean(d[d.batch_size == bs][col])
                rows.append(row)
    return pd.DataFrame(rows)


def bound_table(df: pd.DataFrame) -> pd.DataFrame:
    """How close DALI, dali-plus and each competitor's best reading come to the time bound (system tokens/s /
    bound tokens/s, <= 1), and DALI's PCIe busy share, per model and batch size (decode)."""
    keep = df[df.system.isin(OURS + tuple(f"{c}-best" for c in COMPETITORS))]
    piv = keep.pivot_table(index=["model", "batch_size"], columns="system", values="lower_bound_decode_speedup",
                           sort=False)
    piv = (1 / piv).round(3)  # system tps / lower_bound tps
    piv.columns = [f"{c} / bound" for c in piv.columns]
    pcie = df[df.system == "dali"].set_index(["model", "batch_size"])["busy_pcie"].rename("dali busy_pcie")
    return piv.join(pcie).reset_index()


def plot(df: pd.DataFrame):
    models = list(dict.fromkeys(df.model))
    fig, axes = plt.subplots(2, len(models), figsize=(4.6 * len(models), 7.0), squeeze=False)
    systems = [s for c in COMPETITORS for s in (c, f"{c}-best") if s in set(df.system)]
    for j, m in enumerate(models):
        d = df[(df.model == m) & df.system.isin(systems)]
        bss = sorted(d.batch_size.unique())
        for i, phase in enumerate(PHASES):
            ax = axes[i, j]
            values = {s: d[d.system == s].set_index("batch_size").reindex(bss)[f"dali_{phase}_speedup"].to_numpy()
                      for s in systems}
            ax.set_title(f"{m} ({phase})", fontsize=9)
            if S.no_data(ax, np.concatenate([v for v in values.values()] or [[]]),
                         f"no {phase} speedups: this trace has no {phase} steps" if len(d) else "no runs"):
                ax.set_title(f"{m} ({phase})", fontsize=9)
                continue
            x = S.grouped_bars(ax, bss, systems, values, labels={s: f"vs {s}" for s in systems})
            ax.axhline(1.0, color="k", lw=0.8)
            S.tick_labels(ax, x, [str(b) for b in bss])
            ax.set_xlabel("batch size")
            ax.set_ylabel(f"DALI {phase} speedup (x)")
            S.log_y(ax)
    fig.suptitle("DALI speedup over each competitor, paper reading (NAME) and best reading (NAME-best); "
                 "simulated, rtx3090-epyc7532, cache ratio 0.5", fontsize=9)
    S.legend_below(fig, axes)
    return fig


def main(argv=None) -> int:
    p = C.parser(__doc__.split("\n\n")[0])
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    df = speedups(C.run_grid(NAME, args))
    summ = summary_table(df)
    bounds = bound_table(df)
    cols = ["model", "batch_size", "system", "reading", "precision", "cache_slots", "prefill_tokens_per_s",
            "decode_tokens_per_s", "dali_prefill_speedup", "dali_decode_speedup", "dali_plus_decode_speedup",
            "hit_rate", "gpu_fraction", "busy_pcie"]
    md = [
        "# Fig. 12 / 13: DALI's decode and prefill speedups (simulated), both readings of every competitor",
        "**What this shows.** DALI's per-sequence tokens/s divided by each competitor's, on the rtx3090-epyc7532 "
        "profile (the paper's testbed), for the paper's three models as synthetic traces in the paper's setup "
        "(spec `experiments/sweeps/fig12_13_speedups.toml`: cache ratio 0.5, prompt 64 + 64 generated, "
        "default precision, the first 25% of each trace's sequences profile; predictor recall "
        f"{C.ACCURACY}). Every competitor runs in its paper reading (`NAME`, as the DALI paper ran it) and its "
        "best reading (`NAME-best`); `dali sim systems -v` gives each one's source. > 1 = DALI faster. "
        "`dali-plus` is our improvement (worth-prefetch); the last table is each system's distance to the "
        "time bound `lower-bound` (no system can be faster).",
        "## DALI's speedup (geometric mean over the three models)",
        C.markdown_table(summ),
        "## Share of the time bound (decode; system tokens/s / bound tokens/s, <= 1)",
        C.markdown_table(bounds),
        "## Every run",
        C.markdown_table(df[cols]),
    ]
    C.write_sweep_outputs(NAME, [NAME], args, df, plot(df), md, t0, show=summ, paper=PAPER)
    return 0


if __name__ == "__main__":
    sys.exit(main())
