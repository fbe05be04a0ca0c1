"""Prefetch accuracy on a recorded trace (the DALI paper's Tables 2, 5 and 8, on our trained model).

Two predictors of MoE layer l+1's routing, both recorded by ``dali trace record``:

* ``next-gate``: layer l+1's gate applied to layer l's gate input (mixtral-offloading, AdapMoE);
* ``residual``: layer l+1's gate applied to layer l's gate input plus layer l's calibrated residual
  vector (DALI).

For each decode batch size B (the trace's sequences in batches of B, as the simulator batches them),
per (decode step, layer l): the true workload of layer l+1 (tokens per expert) and each predictor's
predicted workload (tokens whose predicted top-k holds the expert). **Top-k recall** = the true
workload of the predictor's k highest predicted experts (ties by best predicted rank, then lower id)
over the true workload of layer l+1's k highest-workload experts, averaged over steps and layers: 1
when the prefetch of k experts brings the most useful k (with tied workloads, any of them counts, so
batch 1 is not penalised for an arbitrary tie-break). k = 1, 2 and 4 (DALI's prefetch sizes: 1 for
Mixtral, 4 for DeepSeek and Qwen) and the model's top-k.

**Input similarity** (needs hidden states and the residual file): per token and layer, the cosine
similarity of each predictor's input (x_l, or x_l + r_l) with the true next gate input x_{l+1}.

    python experiments/prefetch_accuracy.py [--quick] [--trace T] [--residual R] [--batch-sizes 1,4,16,64]
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
from dali_sim.trace.provenance import file_sha256  # noqa: E402
from dali_sim.trace.reader import Trace, read_trace  # noqa: E402
from dali_sim.trace.schema import DECODE  # noqa: E402
from dali_sim.workload.builder import Workload, WorkloadConfig  # noqa: E402

NAME = "prefetch_accuracy"
PREDICTORS = ("next-gate", "residual")
TRACE = C.REPO / "traces" / "dali-tiny-moe.parquet"
HIDDEN_TRACE = C.REPO / "traces" / "dali-tiny-moe-hidden.parquet"
RESIDUAL = C.REPO / "models" / "dali-tiny-moe" / "residual.safetensors"


def top(values: np.ndarray, k: int, tiebreak: np.ndarray) -> np.ndarray:
    """Indices of the k largest positive values; ties by ``tiebreak`` (smaller first), then lower id."""
    ids = np.flatnonzero(values > 0)
    return ids[np.lexsort((ids, tiebreak[ids], -values[ids]))][:k]


def recall_rows(trace: Trace, batch_sizes: list[int], ks: list[int]) -> list[dict]:
    rows = []
    for bs in batch_sizes:
        w = Workload(trace, WorkloadConfig(bs), predictors=PREDICTORS)
        hits = {(p, k): [] for p in PREDICTORS for k in ks}
        for step in np.flatnonzero(w.step_phase == DECODE).tolist():
            for layer in range(w.num_layers - 1):
                experts, counts, _ = w.activated(step, layer + 1)
                true = np.zeros(w.num_experts)
                true[experts] = counts
                for p in PREDICTORS:
                    pred, rank = w.predicted_counts(p, step, layer + 1), w.predicted_ranks(p, step, layer + 1)
                    for k in ks:
                        best = np.sort(true)[-k:].sum()
                        hits[(p, k)].append(true[top(pred, k, rank)].sum() / best)
        for (p, k), v in hits.items():
            rows.append({"batch_size": bs, "predictor": p, "k": k, "recall": float(np.mean(v)),
                         "samples": len(v), "sequences": len(w.sequences)})
    return rows


def load_residuals(path: Path) -> dict[int, np.ndarray]:
    """Residual vectors by MoE block index, from ``dali trace calibrate-residual``'s file."""
    from safetensors.numpy import load_file

    return {int(k.split(".", 1)[1]): v.astype(np.float32) for k, v in load_file(str(path)).items()}


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12)


def similarity_rows(trace: Trace, residual: dict[int, np.ndarray]) -> list[dict]:
    keys, hidden = trace.hidden_states()
    hidden = hidden.astype(np.float32)
    index = pd.Series(np.arange(len(keys)), index=pd.MultiIndex.from_frame(keys[["seq_id", "pos", "layer"]]))
    blocks = list(trace.model.moe_layers)
    rows = []
    for this, nxt in zip(blocks, blocks[1:]):
        a = keys[keys.layer == this]
        want = pd.MultiIndex.from_arrays([a.seq_id.to_numpy(), a.pos.to_numpy(), np.full(len(a), nxt)])
        j = index.reindex(want).to_numpy()
        ok = ~np.isnan(j)
        if not ok.any():
            continue
        x, y = hidden[a.index.to_numpy()[ok]], hidden[j[ok].astype(np.int64)]
        for name, pred in (("next-gate", x), ("residual", x + residual[this])):
            rows.append({"layer": this, "next_layer": nxt, "predictor": name, "tokens": int(ok.sum()),
                         "cosine_mean": float(cosine(pred, y).mean())})
    return rows


def plot(rec: pd.DataFrame, sim: pd.DataFrame | None):
    ks = sorted(rec.k.unique())
    fig, axes = plt.subplots(1, len(ks) + (sim is not None), figsize=(3.2 * (len(ks) + 1), 3.2), squeeze=False)
    for ax, k in zip(axes[0], ks):
        for p, style in zip(PREDICTORS, ("s--", "o-")):
            d = rec[(rec.k == k) & (rec.predictor == p)]
            ax.plot(d.batch_size, d.recall, style, label=p, color=S.color(p))
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("decode batch size")
        ax.set_ylabel(f"top-{k} recall")
        ax.set_title(f"k = {k}", fontsize=9)
    axes[0, 0].legend(fontsize=8)
    if sim is not None:
        ax = axes[0, -1]
        for p, style in zip(PREDICTORS, ("s--", "o-")):
            d = sim[sim.predictor == p]
            ax.plot(d.layer, d.cosine_mean, style, label=p, color=S.color(p))
        ax.set_xlabel("MoE layer l")
        ax.set_ylabel("cos(predictor input, x_{l+1})")
        ax.set_title("input similarity", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    p = C.parser(__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=TRACE, help="a recorded trace with next-gate and residual columns")
    p.add_argument("--hidden-trace", type=Path, default=HIDDEN_TRACE,
                   help="a recorded trace with hidden states (input similarity); '' to skip")
    p.add_argument("--residual", type=Path, default=RESIDUAL, help="residual vectors (for input similarity)")
    p.add_argument("--batch-sizes", type=C.int_list, default=[1, 2, 4, 8, 16, 32, 64])
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes = [1, 4]
    t0 = time.perf_counter()
    trace = read_trace(args.trace)
    missing = [n for n in PREDICTORS if n not in trace.meta.predictors]
    if missing:
        p.error(f"{args.trace} has no lookahead column {missing}: record it with "
                "`dali trace record ... --residual RES` (docs/recorder.md)")
    ks = sorted({1, 2, 4, trace.model.top_k})
    n_seq = trace.num_sequences
    too_big = [b for b in args.batch_sizes if b > n_seq]
    if too_big:
        p.error(f"{args.trace} has {n_seq} sequences: batch sizes {too_big} would not be full")
    rec = pd.DataFrame(recall_rows(trace, args.batch_sizes, ks))
    sim = None
    if str(args.hidden_trace) not in ("", "."):
        sim = pd.DataFrame(similarity_rows(read_trace(args.hidden_trace), load_residuals(args.residual)))
    piv = rec.pivot_table(index=["k", "batch_size"], columns="predictor", values="recall").reset_index()
    piv["residual - next-gate"] = piv["residual"] - piv["next-gate"]
    md = [
        f"# Prefetch accuracy: next-gate vs residual on {trace.model.name}",
        "**What this shows.** How well each lookahead predictor, made at layer l, finds the experts of "
        "layer l+1 that carry the most tokens in a decode batch (top-k recall, as DALI's prefetcher "
        "uses it), and how close each predictor's input is to the true next gate input. Trace: "
        f"`{args.trace.name}` ({n_seq} sequences, recorded from the real model). The DALI paper's Tables "
        "2, 5 and 8 report these for Mixtral, DeepSeek and Qwen; their values are not in our issue, so "
        "only the direction is compared: the paper finds residual > next-gate.",
        "## Top-k recall of layer l+1's highest-workload experts (decode steps)",
        C.markdown_table(piv),
    ]
    if sim is not None:
        ps = sim.pivot_table(index=["layer", "next_layer"], columns="predictor", values="cosine_mean").reset_index()
        overall = sim.groupby("predictor").apply(lambda d: np.average(d.cosine_mean, weights=d.tokens),
                                                 include_groups=False)
        md += ["## Cosine similarity of the predictor's input with the true next gate input", C.markdown_table(ps),
               f"Token-weighted mean: next-gate {overall['next-gate']:.4f}, residual {overall['residual']:.4f}."]
    md.append(f"Runtime: {time.perf_counter() - t0:.0f} s.")
    df = rec if sim is None else pd.concat([rec.assign(metric="recall"),
                                            sim.assign(metric="cosine")], ignore_index=True)
    manifest = C.base_manifest(NAME, args, [], trace=str(args.trace), trace_sha256=file_sha256(args.trace),
                               hidden_trace=str(args.hidden_trace) if sim is not None else None,
                               residual=str(args.residual) if sim is not None else None, ks=ks,
                               runtime_s=round(time.perf_counter() - t0, 1))
    C.write_outputs(args.out, NAME, df, plot(rec, sim), md, manifest, show=piv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
