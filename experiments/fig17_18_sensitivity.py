"""Paper Figs. 17-18: sensitivity of DALI (and our dali-plus) to the cache ratio, the prefetch size k and
the cache window (w, u).

Three one-at-a-time sweeps from the preset, per model, at one batch size, decode tokens/s per sequence,
each a sweep spec (experiments/sweeps/): ``fig17_18_ratio`` (``cache_ratio`` R: round(R x E) slots per
layer, with the time bound ``lower-bound`` at each ratio), ``fig17_18_k`` (``prefetch.k`` at cache ratio
0.5: the preset's 4 prefetch buffers hold every k, so the cache does not change) and ``fig17_18_window``
(``cache.w`` x ``cache.u`` at cache ratio 0.5). A ratio whose cache does not fit the GPU budget would be a
failed configuration (the script stops with its error).

    python experiments/fig17_18_sensitivity.py [--quick] [--out DIR] [--workers N]
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

NAME = "fig17_18_sensitivity"
SWEEPS = ("cache_ratio", "k", "window")


SPECS = {"cache_ratio": "fig17_18_ratio", "k": "fig17_18_k", "window": "fig17_18_window"}


def value_of(sweep: str, r) -> str:
    if sweep == "cache_ratio":
        return f"{r.cache_ratio:g}"
    if sweep == "k":
        return str(int(r["prefetch.k"]))
    return f"({int(r['cache.w'])},{int(r['cache.u'])})"


def run(args) -> pd.DataFrame:
    parts = []
    for sweep, spec in SPECS.items():
        d = C.run_grid(spec, args)
        d.insert(0, "sweep", sweep)
        d.insert(1, "value", [value_of(sweep, r) for _, r in d.iterrows()])
        parts.append(d)
    df = pd.concat(parts, ignore_index=True)
    df["bound"] = df.bounds.astype(str).str.len() > 0
    # decode tokens/s relative to the same system's value at the sweep's first setting
    first = df.groupby(["model", "sweep", "system"], sort=False).decode_tokens_per_s.transform("first")
    df["decode_rel_first"] = df.decode_tokens_per_s / first
    return df


def plot(df: pd.DataFrame):
    models = list(dict.fromkeys(df.model))
    fig, axes = plt.subplots(len(models), len(SWEEPS), figsize=(4.2 * len(SWEEPS), 3.2 * len(models)), squeeze=False)
    marker = {"dali": "o-", "dali-plus": "s-", "lower-bound": "^--"}
    for i, m in enumerate(models):
        for j, sweep in enumerate(SWEEPS):
            ax = axes[i, j]
            d = df[(df.model == m) & (df.sweep == sweep)]
            labels = list(dict.fromkeys(d.value))
            x = np.arange(len(labels))
            for s, g in d.groupby("system", sort=False):
                v = g.set_index("value").reindex(labels).decode_tokens_per_s.to_numpy(dtype=float)
                ax.plot(x, v, marker.get(s, "x-"), color=S.color(s), label=s)
            ax.set_xticks(x, labels)
            ax.set_xlabel({"cache_ratio": "cache ratio", "k": "prefetch size k", "window": "window (w, u)"}[sweep])
            ax.set_ylabel("decode tokens/s per seq.")
            ax.set_ylim(bottom=0)
            ax.set_title(f"{m} bs={d.batch_size.iloc[0]}", fontsize=9)
            if j == 0:
                ax.legend(fontsize=7)
    fig.suptitle("Sensitivity of DALI (simulated, rtx3090-epyc7532)", fontsize=10)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    p = C.parser(__doc__.split("\n\n")[0])
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    df = run(args)
    wide = df.pivot_table(index=["model", "sweep", "value"], columns="system", values="decode_tokens_per_s",
                          sort=False).reset_index()
    wide.columns.name = None
    cols = ["model", "batch_size", "sweep", "value", "system", "decode_tokens_per_s", "decode_rel_first",
            "prefill_tokens_per_s", "hit_rate", "gpu_fraction", "prefetch_precision", "busy_pcie", "bound"]
    md = [
        "# Figs. 17-18: sensitivity to cache ratio, prefetch size and window (simulated)",
        "**What this shows.** Per-sequence decode tokens/s of `dali` and our `dali-plus` when one "
        "parameter is changed from the preset at a time, on the rtx3090-epyc7532 profile and synthetic "
        "traces of DeepSeek-V2-Lite and Qwen3-30B-A3B in the paper's setup (specs "
        "`experiments/sweeps/fig17_18_{ratio,k,window}.toml`: batch 8 over 16 evaluated sequences, prompt 64 "
        f"+ 64 generated, default precision, profiling split 0.25; predictor recall {C.ACCURACY}): the cache "
        "ratio (with the time bound `lower-bound` at each ratio), the prefetch size k and the window (w, u) of "
        "the workload-aware cache, the last two at the paper's cache ratio 0.5. More cache should help; the k "
        "and window curves show whether DALI's chosen parameters (k = 4, (w, u) = (4, 8) for DeepSeek and Qwen) "
        "sit near the best setting in this simulation.",
        "## Decode tokens/s per sequence",
        C.markdown_table(wide),
        "## Every run",
        C.markdown_table(df[[c for c in cols if c in df.columns]]),
    ]
    C.write_sweep_outputs(NAME, list(SPECS.values()), args, df, plot(df), md, t0, show=wide)
    return 0


if __name__ == "__main__":
    sys.exit(main())
