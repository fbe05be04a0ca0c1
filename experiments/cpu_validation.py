"""The executor against the simulator on this machine's CPU device (docs/validation.md, section 2).

    python experiments/cpu_validation.py [--repeats 3] [--replays 3] [--calibrate-each] [--out DIR] [--shapes mixtral-8x7b,deepseek-v2-lite,qwen3-30b-a3b]

For each model shape: a synthetic trace (6 sequences of 32 prompt + 16 generated tokens: the first 2 are the
profiling input (the default split), the other 4 are evaluated; the lookahead
columns of every system), replayed at scale 1/4 on its first MoE layers, batch 4, by `dali exec
validate` for cpu-only, gpu-lru, llamacpp, hybrimoe, dali and moe-lightning-best (attention on the CPU lane, every
expert of the next layer not cached streamed during the previous one), each replayed ``--replays`` times round by
round over the systems and compared by the medians (its total, each step); the first repeat calibrates the machine
(the profile is kept), the others reuse that profile, so the repeats show how long one profile holds on
the machine; with ``--calibrate-each`` every repeat calibrates first, as three separate `dali exec
validate` runs do, and the repeats show the spread of the whole procedure. Per system and repeat:
measured and simulated seconds, the total error, the per-step |error| median and 90th percentile, the
machine's drift since the calibration and the change of its lanes' overlap
(`dali_exec.validate.drift.SpeedProbe`, timed by each validation before and after), the validation's
warnings, and the verdict (|total error| <= 15%, order of systems that differ by more than 10%). Load
averages before and after each repeat are recorded: on a loaded machine the measured times are not the
machine's, and the table says so.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402
from dali_exec.executor.problem import ReplayOptions  # noqa: E402
from dali_exec.executor.replay import ExecOptions  # noqa: E402
from dali_exec.validate import ValidationConfig, validate  # noqa: E402
from dali_exec.validate.compare import Thresholds, speedup_error  # noqa: E402

BATCH = 4
SYSTEMS = ("cpu-only", "gpu-lru", "llamacpp", "hybrimoe", "dali", "moe-lightning-best")
THRESHOLDS = Thresholds(total=0.15, step_p90=0.25, order_margin=0.10)  # the targets


@dataclass(frozen=True)
class Shape:
    model: str
    layers: int
    gpu_memory_gib: float  # the full-size model's budget (the replay scales it)


SHAPES = {
    "mixtral-8x7b": Shape("mixtral-8x7b", 8, 24.0),  # 1 cache slot per layer at bf16
    "deepseek-v2-lite": Shape("deepseek-v2-lite", 6, 12.0),
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", 8, 24.0),  # small experts (128, top-8): where host work weighs most
}


def loadavg() -> float:
    return os.getloadavg()[0]


def run_shape(shape: Shape, repeats: int, out: Path, scale: float, quick: bool, calibrate_each: bool,
              replays: int, spin_us: float = ExecOptions.spin_us) -> list[dict]:
    spec = C.TraceSpec(shape.model, sequences=C.total_sequences(BATCH), prompt_len=8 if quick else 32, gen_len=4 if quick else 16,
                       seed=0)
    trace = C.get_trace(spec)
    replay = ReplayOptions(model_shape=shape.model, layers=2 if quick else shape.layers, scale=scale,
                           dtype="bf16")
    rows, profile = [], None
    reference = None  # the probe when the profile in use was calibrated
    for rep in range(repeats):
        folder = out / f"{shape.model}-r{rep}"
        before = loadavg()
        cfg = ValidationConfig(systems=SYSTEMS, replay=replay, run=ExecOptions(device="cpu", spin_us=spin_us),
                               profile=profile,
                               batch_size=BATCH, gpu_memory_gib=shape.gpu_memory_gib, timelines=False, plot=False,
                               thresholds=THRESHOLDS, replays=replays)
        report = validate(trace, cfg, folder, command=f"experiments/cpu_validation.py ({shape.model}, repeat {rep})",
                          log=C.progress)
        st = report.settings
        probe_before, probe_after = st["probe_before_s"], st["probe_after_s"]
        if reference is None or calibrate_each:
            reference = (probe_before, st["overlap_before"])
        profile = None if calibrate_each else profile or report.settings["profile"]
        after = loadavg()
        for r in report.rows:
            rows.append({"shape": shape.model, "repeat": rep, "system": r["system"], "exec_s": r["exec_s"],
                         "exec_s_min": r["exec_s_min"], "exec_s_max": r["exec_s_max"], "sim_s": r["sim_s"],
                         "sim_s_rounds_min": r["sim_s_rounds_min"], "sim_s_rounds_max": r["sim_s_rounds_max"],
                         "total_err": r["total_rel_err"],
                         "speedup_err": speedup_error(r, report.rows[0]),
                         "step_err_median": r["step_abs_err_median"], "step_err_p90": r["step_abs_err_p90"],
                         "counters_exact": r["exact"], "load_before": before, "load_after": after,
                         "probe_before_ms": 1e3 * probe_before, "probe_after_ms": 1e3 * probe_after,
                         "machine_drift": probe_after / reference[0] - 1,
                         "overlap_before": st["overlap_before"], "overlap_after": st["overlap_after"],
                         "overlap_drift": st["overlap_after"] / reference[1] - 1,
                         "calibrated": calibrate_each or rep == 0, "verdict_ok": report.ok,
                         "failures": "; ".join(report.verdict.get("failures", [])),
                         "warnings": "; ".join(report.warnings)})
    return rows


def figure(df: pd.DataFrame):
    shapes = list(dict.fromkeys(df["shape"]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 3.4), squeeze=False)
    import style as S
    for ax, shape in zip(axes[0], shapes):
        d = df[df["shape"] == shape]
        for k, system in enumerate(SYSTEMS):
            v = 100 * d[d.system == system]["total_err"].to_numpy()
            ax.scatter(np.full(len(v), k), v, color=S.color(system), label=system, zorder=3)
        ax.axhspan(-100 * THRESHOLDS.total, 100 * THRESHOLDS.total, color="0.9", zorder=0)
        ax.axhline(0, color="k", lw=0.6)
        S.tick_labels(ax, np.arange(len(SYSTEMS)), SYSTEMS, fontsize=8, rotation=30)
        ax.set_ylabel("simulated vs measured total time (%)")
        ax.set_title(f"{shape}, scale 1/4, CPU device", fontsize=9)
    return fig


def main(argv=None) -> int:
    p = C.parser(__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shapes", type=C.str_list, default=list(SHAPES))
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--calibrate-each", action="store_true",
                   help="calibrate before every repeat (each repeat a whole `dali exec validate`), instead of "
                        "reusing the first repeat's profile")
    p.add_argument("--replays", type=int, default=3,
                   help="measured replays per system in each repeat, round by round over the systems; each system "
                        "is compared by their medians (`dali exec validate --replays`)")
    p.add_argument("--spin-us", type=float, default=ExecOptions.spin_us,
                   help="the CPU lane's worker's spin before it sleeps (`dali exec validate --spin-us`)")
    args = p.parse_args(argv)
    unknown = set(args.shapes) - set(SHAPES)
    if unknown:
        p.error(f"unknown shapes {sorted(unknown)}; known: {', '.join(SHAPES)}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.replays < 1:
        p.error("--replays must be >= 1")
    work = args.out / "cpu_validation_runs"
    rows = []
    for name in args.shapes:
        rows += run_shape(SHAPES[name], 1 if args.quick else args.repeats, work, args.scale, args.quick,
                          args.calibrate_each, 1 if args.quick else args.replays, args.spin_us)
    df = pd.DataFrame(rows)
    worst = df.groupby("shape").agg(max_abs_total=("total_err", lambda s: float(s.abs().max())),
                                    max_step_p90=("step_err_p90", "max"),
                                    load_max=("load_after", "max")).reset_index()
    ok = int((df.groupby(["shape", "repeat"])["verdict_ok"].first()).sum())
    n = df.groupby(["shape", "repeat"]).ngroups
    others = df[df.system != SYSTEMS[0]]
    summary = (f"{ok} of {n} validations pass (|total error| <= {THRESHOLDS.total:.0%}, step p90 <= "
               f"{THRESHOLDS.step_p90:.0%}, order margin {THRESHOLDS.order_margin:.0%}); largest |total error| "
               + ", ".join(f"{r.shape} {100 * r.max_abs_total:.1f}%" for r in worst.itertuples())
               + f"; speedups over {SYSTEMS[0]} within {THRESHOLDS.total:.0%} of the measured ones in "
               f"{int((others.speedup_err.abs() <= THRESHOLDS.total).sum())} of {len(others)} rows"
               + f"; load average up to {df['load_after'].max():.1f} on {os.cpu_count()} cores.")
    show = df[["shape", "repeat", "system", "exec_s", "sim_s", "total_err", "speedup_err", "step_err_p90", "load_before",
               "load_after", "machine_drift", "overlap_drift"]]
    md = ["# The executor against the simulator on this machine (CPU device)", summary,
          f"Each repeat runs every system {args.replays} time(s) on the executor (round by round over the systems; "
          "exec_s is the median total, exec_s_min/max the range, steps the per-step medians) and once in the "
          "simulator; "
          + ("every repeat calibrates the machine first. " if args.calibrate_each else
             "the first repeat calibrates the machine and the others reuse its profile. ")
          + "total_err = simulated / measured - 1; speedup_err = the simulated speedup over "
          f"{SYSTEMS[0]} / the measured one - 1 (the machine's drift, common to every system, cancels in it); "
          "step_err = the per-step |relative error|. sim_s_rounds_min/max: the totals simulated with each of "
          "the calibration's rounds of expert tables and fixed parts per call instead of their medians (how much of "
          "sim_s the calibration alone leaves open). probe_*_ms: the "
          "calibration's grouped call of one-token experts on each lane, summed (SpeedProbe), before the "
          "repeat's calibration (or first replay) and after its last replay; "
          "machine_drift = the probe after the repeat over the probe when its profile was calibrated, - 1 "
          "(a diagnostic: > 0 means the machine ran slower than when it was calibrated, and simulated times "
          "then come out fast); overlap_*: both lanes' probe calls started together over the slower one alone "
          "(1 = the lanes ran side by side, 2 = one after the other), overlap_drift its change since the "
          "calibration (> 0: systems that compute on both lanes at once, e.g. dali, come out fast).",
          C.markdown_table(df.drop(columns=["failures", "warnings"])),
          *(f"{title}:\n\n" + ("\n".join(f"- {s} r{r}: {f}" for s, r, f in
                                          df[df[col] != ""][["shape", "repeat", col]]
                                          .drop_duplicates().itertuples(index=False)) or "none")
            for title, col in (("Failures", "failures"), ("Warnings (`dali exec validate`'s)", "warnings")))]
    manifest = C.base_manifest("cpu_validation", args, [], systems=list(SYSTEMS), shapes=args.shapes,
                               thresholds=dataclasses.asdict(THRESHOLDS),
                               cpu_count=os.cpu_count(), summary=summary)
    C.write_outputs(args.out, "cpu_validation", df, figure(df), md, manifest, show)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
