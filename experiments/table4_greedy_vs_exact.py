"""Paper Table 4: DALI's greedy assignment vs the exact per-layer optimum, on the objective itself.

For every sampled (step, MoE layer) of a trace under a batch size, the activated experts' costs
come from the cost model of the paper's testbed profile (``CostModel``): ``t_cpu`` = CPU compute at
the expert's workload, ``t_gpu`` = GPU compute if the expert is resident, else max(transfer, GPU
compute) (DALI's cost model, ``overlap=true``). Residency is a static cache: per layer the
``gpu-lru`` preset's number of slots at cache ratio 0.5 (the paper's setup), filled with the experts of
largest total workload in the profiling quarter of the trace (``memory.cache_init=frequency``; the
other sequences are evaluated). Then
``greedy_assign`` (Algorithm 1) and ``optimal_assign`` (exact: enumeration up to 12 experts, HiGHS
above; a BOUND) each give ``max(T_cpu, T_gpu)``; we report the summed plan MoE time per token, the
greedy gap and each solver's wall time per layer on this machine.

    python experiments/table4_greedy_vs_exact.py [--quick] [--out DIR] [--batch-sizes 1,16,64] [--max-layers 400]
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
from dali_sim.hardware import CostModel, load_profile  # noqa: E402
from dali_sim.policies.placement_dali import greedy_assign, makespan  # noqa: E402
from dali_sim.policies.hybrimoe import hybrid_schedule  # noqa: E402
from dali_sim.policies.placement_optimal import optimal_assign  # noqa: E402
from dali_sim.sim import simulate  # noqa: E402
from dali_sim.workload import Workload  # noqa: E402
from dali_sim.workload.builder import WorkloadConfig  # noqa: E402
from dali_sim.workload.profiling import apply_profile  # noqa: E402

NAME = "table4_greedy_vs_exact"
CACHE_RATIO = 0.5  # the paper's setup


def serial_copies_makespan(on_gpu, resident, counts, gpu, cpu, xfer: float) -> float:
    """An assignment's makespan when copies run back to back over one link (HybriMoE's model: the GPU runs
    its resident experts, then each copied one once it has landed, copies in descending load)."""
    fetched = np.flatnonzero(on_gpu & ~resident)
    fetched = fetched[np.lexsort((fetched, -counts[fetched]))]
    g = float(gpu[on_gpu & resident].sum())
    for i, e in enumerate(fetched.tolist()):
        g = max(g, (i + 1) * xfer) + float(gpu[e])
    return max(g, float(cpu[~on_gpu].sum()))


def cache_slots(trace, bs: int) -> np.ndarray:
    r = simulate(trace, "gpu-lru", batch_size=bs, timing=False,
                 overrides={"memory": {"cache_init": "frequency", "cache_ratio": CACHE_RATIO}})
    return np.asarray(r.manifest["memory"]["cache_slots_per_layer"], dtype=int)


def evaluate(trace, bs: int, max_layers: int, seed: int) -> list[dict]:
    costs = CostModel(load_profile(C.HARDWARE), trace.model)
    split = apply_profile(trace)  # the default profiling split: the cache from the profile, the rest evaluated
    w = Workload(split.evaluated, WorkloadConfig(bs, 0))
    slots = cache_slots(trace, bs)
    freq = split.frequencies
    resident = np.zeros_like(freq, dtype=bool)
    for l in range(w.num_layers):  # noqa: E741
        top = np.lexsort((np.arange(w.num_experts), -freq[l]))[: slots[l]]
        resident[l, top] = True
    xfer = costs.expert_transfer_time()
    pairs = [(s, l) for s in range(w.num_steps) for l in range(w.num_layers)]  # noqa: E741
    if len(pairs) > max_layers:  # evenly spaced, deterministic
        pairs = [pairs[i] for i in np.linspace(0, len(pairs) - 1, max_layers).round().astype(int)]
    rows = []
    one = np.ones(2)
    greedy_assign(one, one, workload=np.ones(2, dtype=np.int64), ids=np.arange(2))  # compile before timing
    optimal_assign(one, one)
    for s, l in pairs:  # noqa: E741
        experts, counts, _ = w.activated(s, l)
        if len(experts) == 0:
            continue
        counts = np.asarray(counts, dtype=np.int64)
        gpu = np.asarray(costs.expert_time("gpu", counts), dtype=float)
        cpu = np.asarray(costs.expert_time("cpu", counts), dtype=float)
        res = resident[l, experts]
        t_gpu = np.where(res, gpu, np.maximum(xfer, gpu))
        t0 = time.perf_counter()
        g = greedy_assign(t_gpu, cpu, workload=counts, ids=experts)
        t1 = time.perf_counter()
        o = optimal_assign(t_gpu, cpu)
        t2 = time.perf_counter()
        hss = hybrid_schedule(counts, res, gpu, cpu, xfer, "hss").on_gpu  # HybriMoE's schedule, same inputs
        prefix = hybrid_schedule(counts, res, gpu, cpu, xfer, "best").on_gpu  # the paper's description (best prefix)
        every = np.ones(len(experts), dtype=bool)  # HybriMoE as released in a step of > 1 token
        serial = lambda a: serial_copies_makespan(a, res, counts, gpu, cpu, xfer)  # noqa: E731
        rows.append({"step": s, "layer": l, "phase": "prefill" if w.step_phase[s] == 0 else "decode",
                     "tokens": int(w.step_tokens[s]), "experts": len(experts),
                     "greedy_s": makespan(g, t_gpu, cpu), "optimal_s": makespan(o, t_gpu, cpu),
                     "hss_s": makespan(hss, t_gpu, cpu), "all_gpu_s": makespan(every, t_gpu, cpu),
                     "prefix_s": makespan(prefix, t_gpu, cpu), "prefix_serial_s": serial(prefix),
                     "greedy_serial_s": serial(g), "hss_serial_s": serial(hss), "all_gpu_serial_s": serial(every),
                     "greedy_wall_s": t1 - t0, "optimal_wall_s": t2 - t1})
    return rows


def run(args) -> tuple[pd.DataFrame, pd.DataFrame]:
    detail, specs = [], []
    for model in args.models:
        for bs in args.batch_sizes:
            spec = (C.TraceSpec(model, 0, 0, 0) if model == "gpt-oss-20b"
                    else C.TraceSpec(model, C.total_sequences(bs * args.batches), args.prompt_len, args.gen_len,
                                     args.seed))
            specs.append(spec)
            C.progress(f"{model} bs={bs}")
            trace = C.get_trace(spec, quiet=False)
            if not C.batch_fits(trace, bs):
                C.progress(f"{model} bs={bs}: skipped, the trace has fewer evaluated sequences")
                continue
            for r in evaluate(trace, bs, args.max_layers, args.seed):
                detail.append({"model": model, "batch_size": bs, **r})
    d = pd.DataFrame(detail)
    g = d.groupby(["model", "batch_size", "phase"], sort=False)
    summ = pd.DataFrame({
        "layers": g.size(),
        "mean_experts": g["experts"].mean(),
        "greedy_ms_per_layer": 1e3 * g["greedy_s"].mean(),
        "optimal_ms_per_layer": 1e3 * g["optimal_s"].mean(),
        "greedy_over_optimal": g["greedy_s"].sum() / g["optimal_s"].sum(),
        "worst_layer_ratio": g.apply(lambda x: (x.greedy_s / x.optimal_s.where(x.optimal_s > 0)).max(),
                                     include_groups=False),
        "share_layers_greedy_optimal": g.apply(lambda x: float(np.mean(x.greedy_s <= x.optimal_s * (1 + 1e-9))),
                                               include_groups=False),
        # HybriMoE's assignments on the same plan inputs (Fig. 14's claim): its time / greedy's - 1, under
        # DALI's objective (copies overlap their expert) and under serial copies (HybriMoE's model)
        "hss_over_greedy": g["hss_s"].sum() / g["greedy_s"].sum(),
        "all_gpu_over_greedy": g["all_gpu_s"].sum() / g["greedy_s"].sum(),
        "prefix_over_greedy": g["prefix_s"].sum() / g["greedy_s"].sum(),
        "hss_over_greedy_serial": g["hss_serial_s"].sum() / g["greedy_serial_s"].sum(),
        "all_gpu_over_greedy_serial": g["all_gpu_serial_s"].sum() / g["greedy_serial_s"].sum(),
        "prefix_over_greedy_serial": g["prefix_serial_s"].sum() / g["greedy_serial_s"].sum(),
        "greedy_wall_us": 1e6 * g["greedy_wall_s"].mean(),
        "optimal_wall_us": 1e6 * g["optimal_wall_s"].mean(),
    }).reset_index()
    args._specs = specs
    return summ, d


def plot(summ: pd.DataFrame, d: pd.DataFrame):
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 0.45 * len(summ) + 4), 4.4))
    lab = summ.model + " bs " + summ.batch_size.astype(str) + " " + summ.phase.str[:3]
    x = np.arange(len(summ))
    axes[0].bar(x, summ.greedy_over_optimal - 1, color=S.color("dali-greedy"))
    S.tick_labels(axes[0], x, lab, fontsize=6, rotation=45)  # one line each, rotated: they overlapped
    axes[0].set_ylabel("greedy / optimal - 1 (plan MoE time)")
    axes[0].set_title("Greedy's gap to the exact optimum (BOUND)", fontsize=9)
    axes[1].bar(x - 0.2, summ.greedy_wall_us, 0.4, label="greedy", color=S.color("dali-greedy"))
    axes[1].bar(x + 0.2, summ.optimal_wall_us, 0.4, label="exact (enum/HiGHS)", color=S.color("optimal"))
    S.tick_labels(axes[1], x, lab, fontsize=6, rotation=45)
    axes[1].set_ylabel("solver wall time per layer (us)")
    S.log_y(axes[1])
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    p = C.parser(__doc__.split("\n\n")[0])
    p.add_argument("--models", type=C.str_list, default=list(C.PAPER_MODELS) + ["gpt-oss-20b"])
    p.add_argument("--batch-sizes", type=C.int_list, default=[1, 4, 16, 64])
    p.add_argument("--batches", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--max-layers", type=int, default=300, help="(step, layer) pairs sampled per run")
    args = p.parse_args(argv)
    if args.quick:
        args.models = [m for m in args.models if m == "mixtral-8x7b"] or args.models[:1]
        args.batch_sizes, args.prompt_len, args.gen_len, args.max_layers = [4], 16, 4, 40
    t0 = time.perf_counter()
    summ, detail = run(args)
    md = [
        "# Table 4: greedy vs exact assignment (plan MoE time, solver overhead)",
        "**What this shows.** On DALI's own per-layer objective max(T_cpu, T_gpu) (static frequency "
        "cache of the gpu-lru memory plan at cache ratio 0.5, prompt 64 + 64 generated, default precision, costs of rtx3090-epyc7532), how far Algorithm 1's greedy is "
        "from the exact optimum (a BOUND), and what each costs in wall time per layer on this 2-core "
        "machine (Python greedy; exact = brute force up to 12 experts, HiGHS MILP above). "
        "`greedy_over_optimal` is summed plan time over sampled layers; `worst_layer_ratio` the worst "
        "single layer. The paper's Table 4 numbers are not in the issue, so none are listed. "
        "For Fig. 14's claim, HybriMoE's assignments run on the same plan inputs: `hss_over_greedy` is its "
        "schedule (the released code's HSS) against greedy on DALI's objective, `all_gpu_over_greedy` the "
        "released code's path for a step of more than one token (every activated expert on the GPU), "
        "`prefix_over_greedy` the paper's description of the schedule (the best number of copied experts in "
        "descending load, `placement.mode=best`); the "
        "`_serial` columns evaluate both assignments with copies back to back over one link (HybriMoE's model "
        "of the link) instead of DALI's max(transfer, compute) per expert.",
        C.markdown_table(summ, 4),
        f"Sampled at most {args.max_layers} (step, layer) pairs per run, evenly spaced. "
        f"Runtime: {time.perf_counter() - t0:.0f} s.",
    ]
    manifest = C.base_manifest(NAME, args, args._specs, runtime_s=round(time.perf_counter() - t0, 1),
                               cost_model="overlap=true, static frequency cache (gpu-lru slots)")
    C.write_outputs(args.out, NAME, summ, plot(summ, detail), md, manifest, show=summ)
    return 0


if __name__ == "__main__":
    sys.exit(main())
