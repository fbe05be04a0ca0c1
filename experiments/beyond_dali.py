"""Beyond DALI, honestly (issue 11 item 7): every competitor's readings, dali, dali-plus, our
``link-budget`` preset and the time lower bound, per model and batch size, at matched memory.

Setup (the paper's): the default profile (rtx3090-epyc7532), each model at its default precision (q4_0
for the paper's three), ``memory.cache_ratio`` 0.5 for every system (whole-layer systems: matched in
expert bytes), synthetic traces of 64 + 64 tokens per sequence with the calibrated lookahead columns
(experiments/common.py), the default profiling split (the first 25% of the sequences profile, the
rest are evaluated; at least 8 evaluated sequences, so batch 1 averages 8 batches). The lower bound
gets the GPU budget the hungriest compared system uses (``memory.gpu_memory_gib``), so it bounds every
one of them. Metric: decode tokens/s per sequence (``summary.decode_tokens_per_s``); prefill alongside.
Each preset runs on its own implementation (``system.implementation``, docs/hardware.md); ``link-budget``
on ``kt-sglang`` (the engine of ``ktransformers-best``) and, as a second reading, on ``pytorch-eager``
(DALI's and dali-plus's).

    python experiments/beyond_dali.py [--quick] [--models ...] [--batch-sizes 1,4,16,64,128]
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
from dali_sim.policies import resolve_system  # noqa: E402
from dali_sim.sim import simulate  # noqa: E402

NAME = "beyond_dali"
COMPETITORS = ("llamacpp", "ktransformers", "hybrimoe", "fiddler", "moe-lightning", "mixtral-offloading")
READINGS = tuple(r for c in COMPETITORS for r in (c, f"{c}-best"))
OURS = "link-budget"
ENGINE = "kt-sglang"
#: (label, preset, overrides beside the cache ratio)
SYSTEMS: tuple[tuple[str, str, dict], ...] = (
    *((r, r, {}) for r in READINGS),
    ("dali", "dali", {}),
    ("dali-plus", "dali-plus", {}),
    (OURS, OURS, {}),
    (f"{OURS}@pytorch-eager", OURS, {"system": {"implementation": "pytorch-eager"}}),
    # the same engine for every policy (kt-sglang): what the policies alone are worth
    *((f"{s}@kt-sglang", s, {"system": {"implementation": "kt-sglang"}})
      for s in ("llamacpp-best", "hybrimoe-best", "fiddler-best", "dali", "dali-plus")),
)
RATIO = 0.5
MIN_EVALUATED = 8
#: where dali loses time: one change at a time, from the paper's dali to ours (each step keeps the earlier ones)
ABLATION: tuple[tuple[str, str, dict], ...] = (
    ("dali (paper)", "dali", {}),
    ("dali-plus (gated prefetch)", "dali-plus", {}),
    ("dali, no prefetch", "dali", {"prefetch": {"policy": "none"}}),
    ("+ no window swaps (u=0)", "dali", {"prefetch": {"policy": "none"}, "cache": {"u": 0}}),
    ("+ profile's frequent experts to start", "dali", {"prefetch": {"policy": "none"}, "cache": {"u": 0},
                                                       "memory": {"cache_init": "frequency"}}),
    ("+ kt-sglang engine", "dali", {"prefetch": {"policy": "none"}, "cache": {"u": 0},
                                    "memory": {"cache_init": "frequency"}, "system": {"implementation": ENGINE}}),
    ("+ HybriMoE's schedule (HSS)", "dali", {"prefetch": {"policy": "none"}, "cache": {"u": 0},
                                             "memory": {"cache_init": "frequency"},
                                             "system": {"implementation": ENGINE},
                                             "placement": {"policy": "hybrimoe", "mode": "hss"}}),
    ("+ link-budget cache = ours", OURS, {}),
)


def with_ratio(extra: dict) -> dict:
    """``extra`` with the matched-memory cache ratio added to its memory section."""
    return {**extra, "memory": {"cache_ratio": RATIO, **extra.get("memory", {})}}


def trace_for(model: str, batch_size: int, args) -> C.TraceSpec:
    evaluated = max(batch_size, MIN_EVALUATED)
    return C.TraceSpec(model, C.total_sequences(evaluated), args.prompt_len, args.gen_len, args.seed)


def one_run(trace, preset: str, batch_size: int, overrides: dict, seed: int) -> dict:
    t0 = time.perf_counter()
    r = simulate(trace, preset, batch_size=batch_size, overrides=overrides, seed=seed)
    s = r.summary
    busy = s.get("busy") or {}
    return {"decode_tokens_per_s": s["decode_tokens_per_s"], "prefill_tokens_per_s": s["prefill_tokens_per_s"],
            "decode_s": s["decode_s"], "prefill_s": s["prefill_s"], "hit_rate": s.get("hit_rate", float("nan")),
            "on_demand": s.get("on_demand", float("nan")), "prefetch_issued": s.get("prefetch_issued", float("nan")),
            "swaps": s.get("swaps", float("nan")),
            **{f"busy_{k}": float(v) for k, v in busy.items()},
            "used_gib": float(r.manifest["memory"].get("used_gib", float("nan"))),
            "implementation": (r.manifest.get("implementation") or {}).get("name", ""),
            "sim_wall_s": time.perf_counter() - t0}


def run(args) -> pd.DataFrame:
    rows = []
    for model in args.models:
        for bs in args.batch_sizes:
            spec = trace_for(model, bs, args)
            trace = C.get_trace(spec, quiet=False)
            cell = []
            for label, preset, extra in SYSTEMS:
                if label not in args.systems:
                    continue
                ov = with_ratio(extra)
                try:
                    resolve_system(preset, ov, trace.model)
                except ValueError as e:  # a reading that cannot run this model (e.g. a missing column)
                    C.progress(f"{model} bs={bs} {label}: skipped ({e})")
                    continue
                C.progress(f"{model} bs={bs} {label}")
                try:
                    got = one_run(trace, preset, bs, ov, args.seed)
                except Exception as e:  # noqa: BLE001  (a simulator failure is reported, not hidden)
                    C.progress(f"  FAILED: {type(e).__name__}: {e}")
                    got = {"decode_tokens_per_s": float("nan"), "error": f"{type(e).__name__}: {e}"}
                cell.append({"model": model, "batch_size": bs, "system": label, **got})
            budget = max(r["used_gib"] for r in cell if "error" not in r)
            C.progress(f"{model} bs={bs} lower-bound ({budget:.2f} GiB)")
            lb = one_run(trace, "lower-bound", bs, {"memory": {"gpu_memory_gib": budget}}, args.seed)
            cell.append({"model": model, "batch_size": bs, "system": "lower-bound", **lb, "used_gib": budget})
            rows.extend(cell)
    return pd.DataFrame(rows)


def run_ablation(args) -> pd.DataFrame:
    rows = []
    for model in args.models:
        for bs in args.ablation_batch_sizes:
            trace = C.get_trace(trace_for(model, bs, args), quiet=False)
            for label, preset, extra in ABLATION:
                ov = with_ratio(extra)
                C.progress(f"ablation {model} bs={bs} {label}")
                rows.append({"model": model, "batch_size": bs, "step": label,
                             **one_run(trace, preset, bs, ov, args.seed)})
    return pd.DataFrame(rows)


def headline(df: pd.DataFrame) -> pd.DataFrame:
    """Per (model, batch): each competitor's best reading, the best of all readings, dali, dali-plus,
    ours and the bound (decode tokens/s), our ratio to the best competitor and our share of the bound."""
    out = []
    for (model, bs), d in df.groupby(["model", "batch_size"], sort=False):
        v = d.set_index("system")["decode_tokens_per_s"]
        row: dict = {"model": model, "batch": int(bs)}
        for c in COMPETITORS:
            got = [v[r] for r in (c, f"{c}-best") if r in v and np.isfinite(v[r])]
            row[c] = max(got) if got else float("nan")
        comp = pd.Series({r: v[r] for r in READINGS if r in v and np.isfinite(v[r])})
        row["best competitor"] = f"{comp.idxmax()} {comp.max():.3g}" if len(comp) else "-"
        for s in ("dali", "dali-plus", OURS, f"{OURS}@pytorch-eager", "lower-bound"):
            row[s] = v.get(s, float("nan"))
        row["ours / best"] = row[OURS] / comp.max() if len(comp) else float("nan")
        row["ours / bound"] = row[OURS] / row["lower-bound"]
        out.append(row)
    return pd.DataFrame(out)


def same_engine(df: pd.DataFrame) -> pd.DataFrame:
    """Decode tokens/s of the policies on one engine (kt-sglang): ktransformers-best (its own), the other
    strong readings and dali / dali-plus moved to it, ours, and our ratio to the best of them."""
    cols = ["ktransformers-best"] + [f"{s}@{ENGINE}" for s in ("llamacpp-best", "hybrimoe-best", "fiddler-best",
                                                               "dali", "dali-plus")]
    out = []
    for (model, bs), d in df.groupby(["model", "batch_size"], sort=False):
        v = d.set_index("system")["decode_tokens_per_s"]
        row = {"model": model, "batch": int(bs), **{c: v.get(c, float("nan")) for c in cols}, OURS: v.get(OURS)}
        others = [v[c] for c in cols if c in v and np.isfinite(v[c]) and not c.startswith("dali")]
        row["ours / best other"] = row[OURS] / max(others) if others else float("nan")
        out.append(row)
    return pd.DataFrame(out)


def failures(df: pd.DataFrame) -> list[str]:
    if "error" not in df or not df["error"].notna().any():
        return []
    bad = df[df["error"].notna()][["model", "batch_size", "system", "error"]]
    return ["## Runs that failed (left out of the maxima)", C.markdown_table(bad)]


def plot(df: pd.DataFrame):
    models = list(dict.fromkeys(df.model))
    fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 3.8), squeeze=False)
    for j, m in enumerate(models):
        ax = axes[0, j]
        d = df[df.model == m]
        bss = sorted(d.batch_size.unique())
        series = {}
        for label in ("best competitor", "dali", "dali-plus", OURS, "lower-bound"):
            vals = []
            for bs in bss:
                e = d[d.batch_size == bs].set_index("system")["decode_tokens_per_s"]
                vals.append(e[[r for r in READINGS if r in e]].max() if label == "best competitor" else e.get(label, np.nan))
            series[label] = np.asarray(vals, dtype=float)
        for label, vals in series.items():
            style = "--" if label == "lower-bound" else "-"
            ax.plot([str(b) for b in bss], vals, style, marker="o", color=S.color(label if label != "best competitor"
                                                                                    else "ktransformers-best"),
                    label=label)
        ax.set_title(m, fontsize=9)
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tokens/s per sequence")
        S.log_y(ax)
    fig.suptitle("Beyond DALI: decode speed at 50% expert memory, q4_0, rtx3090-epyc7532 (simulated)", fontsize=10)
    S.legend_below(fig, axes)
    return fig


def main(argv=None) -> int:
    p = C.parser(__doc__.split("\n\n")[0])
    p.add_argument("--models", type=C.str_list, default=list(C.PAPER_MODELS))
    p.add_argument("--batch-sizes", type=C.int_list, default=[1, 4, 16, 64, 128])
    p.add_argument("--systems", type=C.str_list, default=[s[0] for s in SYSTEMS])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--ablation-batch-sizes", type=C.int_list, default=[1, 16])
    p.add_argument("--part", choices=("all", "grid", "ablation"), default="all",
                   help="grid: every system at every batch size; ablation: from dali to ours one change at a time")
    args = p.parse_args(argv)
    unknown = sorted(set(args.systems) - {s[0] for s in SYSTEMS})
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {', '.join(s[0] for s in SYSTEMS)}")
    if args.quick:
        args.models, args.batch_sizes, args.prompt_len, args.gen_len = ["mixtral-8x7b"], [1], 8, 4
        args.ablation_batch_sizes = [1]
    if args.part in ("all", "ablation"):
        ablation_outputs(args)
    if args.part in ("all", "grid"):
        grid_outputs(args)
    return 0


def ablation_outputs(args) -> None:
    t0 = time.perf_counter()
    df = run_ablation(args)
    cols = ["model", "batch_size", "step", "decode_tokens_per_s", "hit_rate", "on_demand", "prefetch_issued",
            "swaps"] + [c for c in ("busy_gpu", "busy_cpu", "busy_pcie", "busy_host") if c in df]
    md = ["# Where dali loses time: from dali to ours, one change at a time (simulated)",
          "Decode tokens/s per sequence and the busy share of each lane (`summary.busy`: gpu, cpu, pcie = the "
          "host-to-GPU link, host = the implementation's own host work) on the setup of beyond_dali.md. Each "
          "row keeps the changes of the rows above it (the second row, dali-plus, is a side branch).",
          C.markdown_table(df[cols]), f"Runtime: {time.perf_counter() - t0:.0f} s."]
    specs = list(dict.fromkeys(trace_for(m, b, args) for m in args.models for b in args.ablation_batch_sizes))
    manifest = C.base_manifest(f"{NAME}_ablation", args, specs, cache_ratio=RATIO, min_evaluated=MIN_EVALUATED,
                               steps=[{"label": a, "preset": b, "overrides": c} for a, b, c in ABLATION])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for (model, bs), d in df.groupby(["model", "batch_size"], sort=False):
        ax.plot(range(len(d)), d["decode_tokens_per_s"].to_numpy(), marker="o", label=f"{model} b{bs}")
    S.tick_labels(ax, list(range(len(ABLATION))), [a for a, _, _ in ABLATION])
    ax.set_ylabel("decode tokens/s per sequence")
    S.log_y(ax)
    ax.legend(fontsize=7)
    C.write_outputs(args.out, f"{NAME}_ablation", df, fig, md, manifest, show=df[cols])


def grid_outputs(args) -> None:
    t0 = time.perf_counter()
    df = run(args)
    head = headline(df)
    md = [
        "# Beyond DALI, honestly: competitors, DALI, ours and the time bound (simulated)",
        "**What this shows.** Decode tokens/s per sequence on the rtx3090-epyc7532 profile, q4_0 experts, "
        f"{RATIO:.0%} of each layer's experts in GPU memory for every system (whole-layer systems matched in expert "
        f"bytes), synthetic traces of {args.prompt_len} + {args.gen_len} tokens (at least {MIN_EVALUATED} "
        "evaluated sequences after the 25% profiling split). A competitor's column is the better of its two "
        "readings (`NAME`, `NAME-best`); `best competitor` names the fastest reading. `link-budget` is ours "
        "(docs/policies.md, *Beyond DALI, honestly*), on the `kt-sglang` implementation; "
        "`link-budget@pytorch-eager` the same policies on DALI's implementation. `lower-bound` is the time "
        "bound (docs/bounds.md) at the GPU budget of the hungriest system of the cell.",
        C.markdown_table(head),
        "## The policies alone: every one on the kt-sglang engine",
        "Competitors' implementations differ (per-expert Python loops, CUDA graphs or not, pageable copies: "
        "docs/hardware.md). Here the policies of the strongest readings run on `kt-sglang` like ours, so the "
        "differences are the policies' own.",
        C.markdown_table(same_engine(df)),
        *failures(df),
        "## Every run",
        C.markdown_table(df[["model", "batch_size", "system", "decode_tokens_per_s", "prefill_tokens_per_s",
                             "hit_rate", "on_demand", "prefetch_issued", "swaps"]
                            + [c for c in ("busy_gpu", "busy_cpu", "busy_pcie", "busy_host") if c in df]]),
        f"Runtime: {time.perf_counter() - t0:.0f} s.",
    ]
    specs = list(dict.fromkeys(trace_for(m, b, args) for m in args.models for b in args.batch_sizes))
    manifest = C.base_manifest(NAME, args, specs, cache_ratio=RATIO, min_evaluated=MIN_EVALUATED,
                               systems=[{"label": s[0], "preset": s[1], "overrides": s[2]} for s in SYSTEMS
                                        if s[0] in args.systems])
    C.write_outputs(args.out, NAME, df, plot(df), md, manifest, show=head)


if __name__ == "__main__":
    raise SystemExit(main())
