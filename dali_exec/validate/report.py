"""The files of a validation: ``validation.csv`` (one row per system), ``validation.md`` (the tables),
``validation.json`` (everything), ``per_step.csv`` and the plot ``validation.png``. Each is written
atomically (a temp file, then a rename), so a file is complete or absent."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from dali_exec.validate.compare import KINDS, RUNTIME_COUNTS, SHOWN_COUNTERS, speedup_error
from dali_sim.files import atomic_output, write_text_atomic
from dali_sim.jsonsafe import json_safe

CSV, MARKDOWN, JSON = "validation.csv", "validation.md", "validation.json"
STEPS, PLOT = "per_step.csv", "validation.png"


def summary_frame(report) -> pd.DataFrame:
    """One row per system: the comparison's row, the executor's overhead, the counters (exec and sim) and
    speedups over the first system on both sides."""
    rows = []
    base = report.rows[0] if report.rows else None
    for s in report.systems:
        r = {k: v for k, v in s["row"].items() if k != "counters_differ"}
        r["counters_differ"] = ",".join(s["row"]["counters_differ"])
        ov = s["overhead"]
        r["overhead_us_per_layer"] = ov.get("overhead_us_per_layer", math.nan)
        r["overhead_cpu_us_per_layer"] = ov.get("overhead_cpu_us_per_layer", math.nan)
        r["layer_time_us"] = ov.get("layer_time_us", math.nan)
        r["overhead_fraction"] = ov.get("fraction_of_layer_time", math.nan)
        r["exec_speedup"] = base["exec_s"] / r["exec_s"] if r["exec_s"] else math.nan
        r["sim_speedup"] = base["sim_s"] / r["sim_s"] if r["sim_s"] else math.nan
        r["speedup_err"] = speedup_error(r, base)
        for k, v in s["counters"].items():
            r[f"{k}_exec"], r[f"{k}_sim"] = v["exec"], v["sim"]
        rows.append(r)
    return pd.DataFrame(rows)


def steps_frame(report) -> pd.DataFrame:
    frames = []
    for s in report.systems:
        f = s["steps"].reset_index()
        f.insert(0, "system", s["row"]["system"])
        frames.append(f)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _pct(x: float) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:+.1f}%"


def _apct(x: float) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


def _num(x: Any, digits: int = 3) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:,.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def markdown(report) -> str:
    st = report.settings
    lines = [
        "# Executor vs simulator",
        "",
        f"`{st['command']}`",
        "",
        f"Trace {st['trace']}: {st['full_model']} replayed as {st['replay_model']} (scale {st['scale']:g}, "
        f"{st['layers']} MoE layers, {st['dtype']}), {st['steps']} steps, {st['tokens']:,} tokens, batch "
        f"{st['batch_size']}, seed {st['seed']}. Budget {st['gpu_memory_gib']:g} GiB for the full model = "
        f"{st['replay_budget_gib']:.3f} GiB for the replay. Device {st['device_name']} ({st['device']}), host "
        f"{st['host']}, CPU lane {st['cpu_threads']} threads"
        + (f", accelerator lane {st['accel_threads']} threads" if st.get("accel_threads") else "")
        + f". Profile {st['profile']} ({'calibrated here' if st['calibrated_here'] else 'given'}).",
        "",
        "Errors are (simulated - executed) / executed: negative = the simulator predicts less time. A speedup's "
        "error is the simulated speedup over the measured one, - 1: a drift of the machine's speed between the "
        "calibration and the replays moves every system's total error alike and cancels in it."
        + (f" Each system was replayed {st['replays']} times, round by round over the systems: exec s is the "
           "median of its totals (their range in parentheses), each step's time the median of that step's."
           if st.get("replays", 1) > 1 else "")
        + (" sim s in parentheses: the range of the totals simulated with each calibration round's expert tables "
           "and fixed parts per call instead of their medians (docs/validation.md, \"The calibration's rounds\")."
           if any(s.get("sim_s_rounds") for s in report.systems) else ""),
        "",
        "## Time",
        "",
    ]
    rows = []
    base = report.rows[0] if report.rows else None
    for s in report.systems:
        r, ov = s["row"], s["overhead"]
        exec_s = _num(r["exec_s"]) + (f" ({_num(r['exec_s_min'])}-{_num(r['exec_s_max'])})"
                                       if r.get("replays", 1) > 1 else "")
        speedup = ("1 (the base)" if r is base else
                   f"{_num(base['exec_s'] / r['exec_s'], 2)} / {_num(base['sim_s'] / r['sim_s'], 2)} "
                   f"({_pct(speedup_error(r, base))})" if r["exec_s"] and r["sim_s"] else "-")
        sim_s = _num(r["sim_s"]) + (f" ({_num(r['sim_s_rounds_min'])}-{_num(r['sim_s_rounds_max'])})"
                                     if math.isfinite(r.get("sim_s_rounds_min", math.nan)) else "")
        rows.append([r["system"], exec_s, sim_s, _pct(r["total_rel_err"]), speedup,
                     _apct(r["step_abs_err_median"]), _apct(r["step_abs_err_p90"]),
                     f"{_num(r['decode_tokens_per_s_exec'], 1)} / {_num(r['decode_tokens_per_s_sim'], 1)}",
                     f"{_num(ov.get('overhead_us_per_layer'), 0)} ({_apct(ov.get('fraction_of_layer_time'))})",
                     _pct(r["sim_plus_overhead_rel_err"]), f"{_num(r['idle_exec_s'])} / {_num(r['idle_sim_s'])}",
                     "yes" if r["exact"] else ("NO: " + ", ".join(r["counters_differ"]))])
    lines += _table(["system", "exec s", "sim s", "total err",
                     f"speedup over {base['system'] if base else '-'} exec / sim (err)", "step abs err median", "p90",
                     "decode tok/s exec / sim", "overhead us/layer (share)", "err of sim + overhead",
                     "idle s exec / sim",
                     "counters exact"], rows)
    rk = report.ranking
    if rk and rk.get("pairs"):
        lines += ["", f"Order by total time, executor: {', '.join(rk['exec_order'])}; simulator: "
                      f"{', '.join(rk['sim_order'])} (Kendall tau {rk['kendall_tau']:.2f}, "
                      f"{rk['discordant_pairs']} of {rk['pairs']} pairs discordant)."]
    v = report.verdict
    if v:
        t = v["thresholds"]
        rule = (f"|total error| <= {100 * t['total']:.0f}% per system"
                + (f", per-step |error| p90 <= {100 * t['step_p90']:.0f}%" if t.get("step_p90") is not None else "")
                + f", the same order where measured times differ by more than {100 * t['order_margin']:.0f}%, "
                  "counters exact where they must be")
        lines += ["", "## Verdict", "", f"**{'OK' if v['ok'] else 'FAIL'}** ({rule})."]
        lines += [f"- FAIL {f}" for f in v["failures"]]
    if report.warnings:
        lines += ["", "## Warnings", "", *(f"- WARNING {w}" for w in report.warnings)]
    lines += ["", "## Counters (executor / simulator where they differ)", ""]
    rows = []
    for s in report.systems:
        cells = [s["row"]["system"]]
        for k in SHOWN_COUNTERS:
            e, m = s["counters"][k]["exec"], s["counters"][k]["sim"]
            cells.append(_num(e) if e == m else f"{_num(e)} / {_num(m)}")
        h = s["counters"]["hit_rate"]
        cells.append(_apct(h["exec"]) if h["exec"] == h["sim"] else f"{_apct(h['exec'])} / {_apct(h['sim'])}")
        for k in RUNTIME_COUNTS:
            e, m = s["row"].get(f"{k}_exec"), s["row"].get(f"{k}_sim")
            cells.append(_num(e) if e == m else f"{_num(e)} / {_num(m)}")
        rows.append(cells)
    lines += _table(["system", *SHOWN_COUNTERS, "hit_rate", *RUNTIME_COUNTS], rows)
    lines += ["", "A hand-over is a request to a thread asleep on its queue (the CPU lane's worker, the copy "
                  "thread), which the host pays for (the profile's lane_wake.host); prefetches_waited: prefetches "
                  "that found no free buffer as their layer visit started. The CPU lane's hand-overs and the waiting "
                  "prefetches must match; the copy thread's hand-overs depend on when its copies land, on both sides."]
    lines += ["", "## Busy time by activity (seconds, executor / simulator, error)", "",
              "Summed interval lengths per kind; lanes overlap, so these do not add up to the total time. `host` is "
              "not the same work on the two sides (no error): the executor's decisions against the simulator's "
              "whole modelled host work of each visit.", ""]
    rows = []
    for s in report.systems:
        cells = [s["row"]["system"]]
        for k in KINDS:
            b = s["busy"].get(k)
            cells.append("-" if b is None else f"{b['exec_s']:.3f} / {b['sim_s']:.3f} ({_pct(b['rel_err'])})")
        rows.append(cells)
    lines += _table(["system", *KINDS], rows)
    if report.failed:
        lines += ["", "## Failed", ""] + [f"- {s['system']}: {s['error']}" for s in report.failed]
    if report.skipped:
        lines += ["", "## Skipped", ""] + [f"- {s['system']}: {s['reason']}" for s in report.skipped]
    lines += ["", f"Elapsed {report.settings.get('elapsed_s', math.nan):.1f} s. Method and definitions: "
                  "docs/validation.md.", ""]
    return "\n".join(lines)


def to_json(report) -> dict[str, Any]:
    systems = []
    for s in report.systems:
        systems.append({**{k: v for k, v in s.items() if k != "steps"},
                        "steps": s["steps"].reset_index().to_dict(orient="list")})
    return {"settings": report.settings, "systems": systems, "skipped": report.skipped, "failed": report.failed,
            "ranking": report.ranking, "verdict": report.verdict, "warnings": report.warnings}


def write_tables(report, out: Path) -> list[Path]:
    """validation.csv, validation.md, validation.json and per_step.csv (atomically)."""
    out = Path(out)
    paths = [write_text_atomic(out / CSV, summary_frame(report).to_csv(index=False)),
             write_text_atomic(out / STEPS, steps_frame(report).to_csv(index=False)),
             write_text_atomic(out / MARKDOWN, markdown(report)),
             write_text_atomic(out / JSON, json.dumps(json_safe(to_json(report)), indent=1, allow_nan=False,
                                                 default=str))]
    for p in paths:
        if p.name not in report.files:
            report.files.append(p.name)
    return paths


def write_plot(report, path: Path, title: str | None = None) -> Path:
    """Per system, each step's time executed vs simulated (log scale: prefill steps are long); the last
    panel: total time per system on both sides."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(report.systems) + 1
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    flat = axes.ravel()
    for ax, s in zip(flat, report.systems):
        st, r = s["steps"], s["row"]
        ax.plot(st.index, 1e3 * st["exec_s"], label="executor", color="tab:blue", lw=1.2)
        ax.plot(st.index, 1e3 * st["sim_s"], label="simulator", color="tab:orange", lw=1.2, ls="--")
        ax.set_yscale("log")
        ax.set_title(f"{r['system']}: total {_pct(r['total_rel_err'])}, "
                     f"step |err| med {_apct(r['step_abs_err_median'])}", fontsize=8)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("step time (ms)", fontsize=8)
        ax.tick_params(labelsize=7)
    flat[0].legend(fontsize=7)
    ax = flat[len(report.systems)]
    names = [r["system"] for r in report.rows]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [r["exec_s"] for r in report.rows], 0.4, label="executor", color="tab:blue")
    ax.bar([i + 0.2 for i in x], [r["sim_s"] for r in report.rows], 0.4, label="simulator", color="tab:orange")
    ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("total time (s)", fontsize=8)
    ax.set_title("total time", fontsize=8)
    ax.legend(fontsize=7)
    for extra in flat[n:]:
        extra.axis("off")
    st = report.settings
    fig.suptitle(title or f"executor vs simulator: {st['replay_model']} on {st['device_name']}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    if path.name not in report.files:
        report.files.append(path.name)
    return path


__all__ = ["markdown", "summary_frame", "steps_frame", "to_json", "write_plot", "write_tables"]
