"""Our diagnostic of Fig. 12's decode gap: how much of DALI's loss to llama.cpp and KTransformers at small
batches is its implementation's host cost (``pytorch-eager``: a Python loop over GPU experts, 10 launches
and a synchronisation per GPU expert, no CUDA graphs; DALI's code is not public, docs/hardware.md) rather
than its policy. The same policies run with other implementations' traits (``system.implementation``:
``kt-sglang`` = grouped GPU experts and CUDA graphs in decode, ``bare`` = no host costs at all), batch 4,
cache ratio 0.5 (sweep ``experiments/sweeps/implementation_share.toml``). Not a paper figure.

    python experiments/implementation_share.py [--quick] [--out DIR] [--workers N]
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

NAME = "implementation_share"


def runs(df: pd.DataFrame) -> pd.DataFrame:
    impl = df["dali:system.implementation"].fillna(df["llamacpp:system.implementation"]).fillna(
        df["ktransformers-best:system.implementation"])
    return pd.DataFrame({"model": df.model, "batch_size": df.batch_size, "system": df.system, "implementation": impl,
                         "label": df.system + " @ " + impl, "decode_tokens_per_s": df.decode_tokens_per_s,
                         "gpu_fraction": df.gpu_fraction, "busy_pcie": df.busy_pcie, "busy_host": df.busy_host})


def table(d: pd.DataFrame) -> pd.DataFrame:
    piv = d.pivot_table(index="model", columns="label", values="decode_tokens_per_s", sort=False)
    piv.columns.name = None
    for impl in ("pytorch-eager", "kt-sglang", "bare"):
        piv[f"dali@{impl} / llamacpp"] = piv[f"dali @ {impl}"] / piv["llamacpp @ llamacpp"]
        piv[f"dali@{impl} / ktransformers-best"] = piv[f"dali @ {impl}"] / piv["ktransformers-best @ kt-sglang"]
    return piv.reset_index()


def plot(d: pd.DataFrame):
    models = list(dict.fromkeys(d.model))
    labels = list(dict.fromkeys(d.label))
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(labels)), 4))
    x = np.arange(len(models))
    w = 0.8 / len(labels)
    for i, lab in enumerate(labels):
        v = d[d.label == lab].set_index("model").reindex(models).decode_tokens_per_s.to_numpy()
        ax.bar(x + (i - (len(labels) - 1) / 2) * w, v, w, label=lab)
    ax.set_xticks(x, models)
    ax.set_ylabel("decode tokens/s per sequence (batch 4)")
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("The same policies with other implementations' host costs (rtx3090-epyc7532, cache ratio 0.5)",
                 fontsize=9)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    p = C.parser(__doc__.split("\n\n")[0])
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    d = runs(C.run_grid(NAME, args))
    piv = table(d)
    md = [
        "# Diagnostic: DALI's policy with other implementations' host costs (simulated)",
        "**What this shows.** Decode tokens/s per sequence at batch 4, cache ratio 0.5, prompt 64 + 64 "
        "generated, q4_0 (spec `experiments/sweeps/implementation_share.toml`) of `dali`, `llamacpp` and "
        "`ktransformers-best`, each with its own implementation and with others: `pytorch-eager` (DALI's: a "
        "Python loop over GPU experts, per-expert launches and a synchronisation, no CUDA graphs), `kt-sglang` "
        "(grouped GPU experts, CUDA graphs in decode), `bare` (no host costs). The policies' plans do not see "
        "these costs (their cost tables are the devices' compute and copy times), the engine charges them. "
        "Not a paper figure: it separates what the paper's Fig. 12 gaps owe to the policy from what they owe "
        "to the implementation (docs/experiments.md).",
        C.markdown_table(piv),
        "## Every run",
        C.markdown_table(d),
    ]
    C.write_sweep_outputs(NAME, [NAME], args, d, plot(d), md, t0, show=piv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
