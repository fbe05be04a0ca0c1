"""Every preset, the oracle heuristic and the time bound on *real* routing: the trace recorded from our trained model.

The synthetic traces of the other experiments have predictors of chosen accuracy; here the routing,
the prompts' domains and both lookahead predictors (``next-gate``, ``residual``) come from a real run
of ``models/dali-tiny-moe`` (``traces/dali-tiny-moe.parquet``, 64 prompts of five domains). Nothing in
``dali`` or ``dali-plus`` was tuned on it.

The trained model is tiny (74 KB experts), so its own costs would be all fixed overheads. The routing
is therefore costed at a realistic expert size: the Qwen3-30B-A3B shape (hidden 2048, expert
intermediate 768, bf16, its attention) with the recorded model's 4 MoE layers x 32 experts, top-4.
The GPU budget holds the dense part, the KV cache and ``--expert-share`` (default 50%) of the experts,
the same budget for every preset. ``hybrimoe`` uses its next-layer predictor only (the trace has no
``gate2``/``gate3``).

    python experiments/recorded_trace.py [--quick] [--out DIR] [--batch-sizes 1,8,16] [--expert-share 0.5]
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

import common as C  # noqa: E402
import style as S  # noqa: E402
from dali_sim.models import get_model  # noqa: E402
from dali_sim.policies import system_names  # noqa: E402
from dali_sim.runtime.memory import kv_cache_bytes  # noqa: E402
from dali_sim.trace.provenance import file_sha256  # noqa: E402
from dali_sim.trace.reader import Trace, read_trace  # noqa: E402
from dali_sim.workload import Workload, WorkloadConfig  # noqa: E402

NAME = "recorded_trace"
TRACE = C.REPO / "traces" / "dali-tiny-moe.parquet"
COST_SHAPE = "qwen3-30b-a3b"
OVERRIDES = {name: {"prefetch": {"predictor2": "", "predictor3": ""}} for name in ("hybrimoe", "hybrimoe-best")}


def costed(trace: Trace) -> Trace:
    """The recorded routing with the expert size, attention and precision of :data:`COST_SHAPE`."""
    big, m = get_model(COST_SHAPE), trace.model
    model = dataclasses.replace(big, name=f"{m.name}@{COST_SHAPE}", num_layers=m.num_layers,
                                moe_layers=m.moe_layers, num_experts=m.num_experts, top_k=m.top_k,
                                vocab_size=m.vocab_size)
    return Trace(trace.table, dataclasses.replace(trace.meta, model=model), trace.path)


def budget_gib(trace: Trace, batch_size: int, share: float) -> float:
    """Dense weights + KV cache of the largest step + ``share`` of all experts, in GiB."""
    m = trace.model
    kv = kv_cache_bytes(m, Workload(trace, WorkloadConfig(batch_size)).max_batch_context)
    experts = share * m.num_moe_layers * m.num_experts * m.expert_bytes
    return (m.bytes_of(m.non_expert_params) + kv + experts) / 2**30


def run(args, trace: Trace) -> pd.DataFrame:
    rows = []
    for bs in args.batch_sizes:
        gib = budget_gib(trace, bs, args.expert_share)
        for system in system_names():
            C.progress(f"recorded bs={bs} {system}")
            over = {**OVERRIDES.get(system, {}), "memory": {"gpu_memory_gib": f"{gib:.6f}"}}
            try:
                r = C.run_sim(trace, system, bs, over, seed=args.seed)
            except ValueError as exc:  # the preset's minimum working set exceeds the budget
                if "cannot hold the minimum working set" not in str(exc):
                    raise
                C.progress(f"  {system}: does not fit ({exc})")
                r = {"fits": False}
            rows.append({"batch_size": bs, "system": system, "gpu_memory_gib": gib, "fits": True, **r})
    df = pd.DataFrame(rows)
    keys = df["batch_size"].to_numpy()
    for phase in ("prefill", "decode"):
        tps = f"{phase}_tokens_per_s"
        for ref in ("oracle", "dali"):
            base = df[df.system == {"oracle": "oracle-heuristic"}.get(ref, ref)].set_index("batch_size")[tps]
            df[f"{phase}_vs_{ref}"] = df[tps].to_numpy() / base.reindex(keys).to_numpy()
    return df


def plot(df: pd.DataFrame):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    order = df.groupby("system")["decode_vs_oracle"].mean().sort_values(ascending=False).index
    for ax, phase in zip(axes, ("decode", "prefill")):
        bss = sorted(df.batch_size.unique())
        width = 0.8 / len(bss)
        x = np.arange(len(order))
        for k, bs in enumerate(bss):
            v = df[df.batch_size == bs].set_index("system").reindex(order)[f"{phase}_vs_oracle"]
            ax.bar(x + (k - (len(bss) - 1) / 2) * width, v.to_numpy(), width, label=f"batch {bs}",
                   color=S.colors(order), alpha=0.45 + 0.55 * (k + 1) / len(bss), edgecolor="white")
        ax.axhline(1.0, color="k", lw=0.8)
        S.tick_labels(ax, x, order, rotation=40)
        ax.set_ylabel(f"{phase} tokens/s / oracle's")
        ax.set_title(f"{phase}: recorded dali-tiny-moe routing (bars left to right: batch "
                     f"{', '.join(map(str, bss))})", fontsize=8)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    p = C.parser(__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=TRACE, help="a recorded trace with next-gate and residual columns")
    p.add_argument("--batch-sizes", type=C.int_list, default=[1, 8, 16])
    p.add_argument("--expert-share", type=float, default=0.5, help="share of all experts the GPU budget holds")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes = [4]
    t0 = time.perf_counter()
    trace = costed(read_trace(args.trace))
    df = run(args, trace)
    cols = ["batch_size", "system", "fits", "decode_tokens_per_s", "prefill_tokens_per_s", "decode_vs_oracle",
            "prefill_vs_oracle", "decode_vs_dali", "prefill_vs_dali", "hit_rate", "gpu_fraction",
            "prefetch_precision", "bound", "oracle"]
    piv = df.pivot(index="system", columns="batch_size", values="decode_vs_oracle").reset_index()
    piv.columns = ["system"] + [f"decode/oracle b{b}" for b in piv.columns[1:]]
    md = [
        "# Every preset on real routing: the trace recorded from dali-tiny-moe (simulated)",
        "**What this shows.** The presets on routing and predictors recorded from a real model "
        f"(`{args.trace.name}`, {trace.num_sequences} prompts from five domains), none of them tuned on it: "
        "decode and prefill tokens/s per sequence relative to the `oracle-heuristic` preset (a reference "
        "point that reads the future, not a bound; `lower-bound` is the time bound) and to `dali`. Costs: the "
        f"{COST_SHAPE} expert size with the recorded 4 layers x 32 experts, top-4, on rtx3090-epyc7532; GPU "
        f"budget = dense part + KV cache + {args.expert_share:.0%} of the experts (same for every preset). "
        "`hybrimoe` prefetches with its next-layer predictor only (no gate2/gate3 in a recorded trace). "
        "A preset whose minimum working set exceeds the budget is listed with `fits` = no and no numbers "
        "(`moe-lightning` and `oracle-heuristic` hold one whole layer of prefetch buffers).",
        "## Decode tokens/s as a fraction of the oracle heuristic's",
        C.markdown_table(piv.sort_values(piv.columns[1], ascending=False)),
        "## Every run",
        C.markdown_table(df[cols]),
        f"Runtime: {time.perf_counter() - t0:.0f} s.",
    ]
    manifest = C.base_manifest(NAME, args, [], trace=str(args.trace), trace_sha256=file_sha256(args.trace),
                               cost_shape=COST_SHAPE, model=trace.model.to_dict(), overrides=OVERRIDES,
                               runtime_s=round(time.perf_counter() - t0, 1))
    C.write_outputs(args.out, NAME, df, plot(df), md, manifest, show=piv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
