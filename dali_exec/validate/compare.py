"""Executor vs simulator on the same replay: time errors, counters side by side, busy time by activity.

Torch-free: it compares two :class:`dali_sim.sim.simulate.SimResult` of the same workload, the first
measured (``execute`` / ``Replay.run``), the second simulated (``simulate`` on ``ReplaySetup.trace``
with ``ReplaySetup.sysconf`` and a profile measured on the same machine). Definitions in
docs/validation.md. Relative errors are ``(simulated - executed) / executed``: negative = the simulator
is optimistic (predicts less time than was measured).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from dali_sim.sim.counters import COUNTERS
from dali_sim.sim.busy import KINDS, activity_kind, busy_by_kind, idle_seconds, lanes_overlap_seconds
from dali_sim.sim.engine import HANDOFF_KINDS
from dali_sim.sim.simulate import SimResult

#: the counters shown side by side (all of COUNTERS are checked for the "exact" flag)
SHOWN_COUNTERS = ("hits", "on_demand", "prefetch_issued", "prefetch_used", "admitted", "evicted", "staged", "swaps",
                  "cpu_experts", "gpu_experts", "transfers", "bytes_h2d")
#: the runtime's own counts beside them (``<count>_exec`` / ``_sim``): hand-overs to a sleeping thread per kind, and
#: the prefetches that waited for a buffer
RUNTIME_COUNTS = (*(f"{k}_handoffs" for k in HANDOFF_KINDS), "prefetches_waited")
#: derived rates that follow from the counters (equal when the counters are)
RATES = ("hit_rate", "gpu_fraction", "prefetch_precision", "prefetch_recall")
#: kinds whose intervals are not the same work on the two sides, compared without an error: the executor's ``host``
#: intervals are its decisions (``Controller.plan``), the simulator's a visit's whole modelled host work (the
#: profile's host terms, docs/hardware.md), most of which the executor spends between its timed activities
UNLIKE_KINDS = ("host",)
#: placement policies whose decisions are not reproducible run to run (a solver under a time limit)
NONDETERMINISTIC_PLACEMENTS = ("optimal", "optimal-mem")


def rel_err(sim: float, exe: float) -> float:
    """``(sim - exe) / exe``; NaN when either is NaN or ``exe`` is 0."""
    if exe is None or sim is None or not math.isfinite(exe) or not math.isfinite(sim) or exe == 0:
        return float("nan")
    return (sim - exe) / exe


def speedup_error(row: dict[str, Any], base: dict[str, Any]) -> float:
    """How far the simulator's speedup of ``row``'s system over ``base``'s is from the measured one: (sim
    speedup) / (exec speedup) - 1, both from the rows' total times (0 for the base itself). The machine's
    drift between the calibration and the replays, which moves every system's error the same way, cancels in
    it; what is left is the model's error in comparing the two systems."""
    if not (row["sim_s"] and row["exec_s"]):
        return float("nan")
    return rel_err(base["sim_s"] / row["sim_s"], base["exec_s"] / row["exec_s"])


def _quantile(x: np.ndarray, q: float) -> float:
    x = x[np.isfinite(x)]
    return float(np.quantile(x, q)) if x.size else float("nan")


def step_table(executed: SimResult, simulated: SimResult, exec_step_s: np.ndarray | None = None) -> pd.DataFrame:
    """Per step: phase, batch, tokens, executed and simulated seconds, relative error; ``exec_step_s``: the
    executed seconds per step to use instead of ``executed``'s (the medians of several replays)."""
    e, s = executed.per_step, simulated.per_step
    if len(e) != len(s) or not (e["tokens"].to_numpy() == s["tokens"].to_numpy()).all():
        raise ValueError(f"the executed and simulated runs have different steps ({len(e)} vs {len(s)}): "
                         "they must replay the same workload")
    out = e[["phase", "batch", "tokens"]].copy()
    out.index.name = "step"
    out["exec_s"] = e["time_s"].to_numpy() if exec_step_s is None else np.asarray(exec_step_s, float)
    out["sim_s"] = s["time_s"].to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        out["rel_err"] = (out["sim_s"] - out["exec_s"]) / out["exec_s"]
    return out


def counters_equal(executed: SimResult, simulated: SimResult) -> tuple[bool, list[str]]:
    """Are every counter's total and its per-layer values the same? (and the keys that differ)"""
    differ = [k for k in COUNTERS if executed.summary[k] != simulated.summary[k]]
    cols = list(COUNTERS)
    if not differ:
        a, b = executed.per_layer[cols].to_numpy(), simulated.per_layer[cols].to_numpy()
        if a.shape != b.shape or not (a == b).all():
            differ = [c for i, c in enumerate(cols) if a.shape != b.shape or not (a[:, i] == b[:, i]).all()]
    return not differ, differ


def runtime_count_columns(executed: dict[str, Any], simulated: dict[str, Any]) -> dict[str, int | None]:
    """``RUNTIME_COUNTS`` from the two summaries, executed and simulated (``<count>_exec`` / ``_sim``; None where
    a summary has no count: a result from before they were counted)."""
    out = {}
    for side, summary in (("exec", executed), ("sim", simulated)):
        counts = {f"{k}_handoffs": n for k, n in (summary.get("handoffs") or {}).items()}
        counts["prefetches_waited"] = summary.get("prefetches_waited")
        out |= {f"{k}_{side}": counts.get(k) for k in RUNTIME_COUNTS}
    return out


def expected_exact(system_config: dict[str, Any]) -> bool:
    """Counters must match exactly unless the placement is a time-limited solver."""
    return system_config.get("placement", {}).get("policy") not in NONDETERMINISTIC_PLACEMENTS


def compare(executed: SimResult, simulated: SimResult, exec_step_s: np.ndarray | None = None) -> dict[str, Any]:
    """Everything docs/validation.md reports for one system, as one flat-ish dict (``exec_step_s``: as
    :func:`step_table`; the totals are ``executed``'s)."""
    se, ss = executed.summary, simulated.summary
    steps = step_table(executed, simulated, exec_step_s)
    abs_err = steps["rel_err"].abs().to_numpy()
    decode = (steps["phase"] == "decode").to_numpy()
    exact, differ = counters_equal(executed, simulated)
    per_layer = executed.per_layer
    overhead_s = float(per_layer["decision_s"].sum() + per_layer["bookkeeping_s"].sum())
    makespan_e, makespan_s = float(se["makespan_s"]), float(ss["makespan_s"])
    row: dict[str, Any] = {
        "system": se["system"],
        "steps": int(se["steps"]),
        "exec_s": makespan_e,
        "sim_s": makespan_s,
        "total_rel_err": rel_err(makespan_s, makespan_e),
        "prefill_exec_s": float(se["prefill_s"]),
        "prefill_sim_s": float(ss["prefill_s"]),
        "prefill_rel_err": rel_err(ss["prefill_s"], se["prefill_s"]),
        "decode_exec_s": float(se["decode_s"]),
        "decode_sim_s": float(ss["decode_s"]),
        "decode_rel_err": rel_err(ss["decode_s"], se["decode_s"]),
        "step_abs_err_median": _quantile(abs_err, 0.5),
        "step_abs_err_p90": _quantile(abs_err, 0.9),
        "step_err_median": _quantile(steps["rel_err"].to_numpy(), 0.5),
        "decode_step_abs_err_median": _quantile(abs_err[decode], 0.5),
        "decode_tokens_per_s_exec": float(se["decode_tokens_per_s"]),
        "decode_tokens_per_s_sim": float(ss["decode_tokens_per_s"]),
        "prefill_tokens_per_s_exec": float(se["prefill_tokens_per_s"]),
        "prefill_tokens_per_s_sim": float(ss["prefill_tokens_per_s"]),
        # the executor's host work per layer visit (decisions + bookkeeping), added to the simulated time
        "overhead_s": overhead_s,
        "sim_plus_overhead_s": makespan_s + overhead_s,
        "sim_plus_overhead_rel_err": rel_err(makespan_s + overhead_s, makespan_e),
        "idle_exec_s": idle_seconds(executed.intervals, makespan_e),
        "idle_sim_s": idle_seconds(simulated.intervals, makespan_s),
        "exact": exact,
        "expected_exact": expected_exact(executed.config["system"]),
        "counters_differ": differ,
        **runtime_count_columns(se, ss),
    }
    counters = {k: {"exec": se[k], "sim": ss[k]} for k in (*SHOWN_COUNTERS, *RATES)}
    be, bs = busy_by_kind(executed.intervals), busy_by_kind(simulated.intervals)
    busy = {k: {"exec_n": be[k][0], "sim_n": bs[k][0], "exec_s": be[k][1], "sim_s": bs[k][1],
                "rel_err": None if k in UNLIKE_KINDS else rel_err(bs[k][1], be[k][1])}
            for k in KINDS if be[k][0] or bs[k][0]}
    return {"row": row, "counters": counters, "busy": busy, "overhead": dict(se.get("overhead", {})),
            "steps": steps}


@dataclass(frozen=True)
class Thresholds:
    """When a validation fails (docs/validation.md, "Verdict"): a system's total time off by more than
    ``total`` (relative), its per-step |error| 90th percentile above ``step_p90`` (None: not checked), two
    systems whose measured times differ by more than ``order_margin`` ordered the other way round by the
    simulator, or counters that must match and do not (among them the CPU lane's hand-overs to its worker and
    the prefetches that waited for a buffer)."""

    total: float = 0.15
    step_p90: float | None = None
    order_margin: float = 0.10

    def __post_init__(self) -> None:
        for name in ("total", "step_p90", "order_margin"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"threshold {name} must be a finite number >= 0, got {v!r}")


def verdict(rows: list[dict[str, Any]], thresholds: Thresholds = Thresholds()) -> dict[str, Any]:
    """``{"ok": bool, "failures": [one line each], "thresholds": {...}}`` for the compared systems' rows."""
    failures = []
    for r in rows:
        err = r["total_rel_err"]
        if not math.isfinite(err) or abs(err) > thresholds.total:
            failures.append(f"{r['system']}: total time error {100 * err:+.1f}% exceeds "
                            f"+-{100 * thresholds.total:.0f}% (executed {r['exec_s']:.3f} s, simulated {r['sim_s']:.3f} s)")
        p90 = r["step_abs_err_p90"]
        if thresholds.step_p90 is not None and (not math.isfinite(p90) or p90 > thresholds.step_p90):
            failures.append(f"{r['system']}: per-step |error| p90 {100 * p90:.1f}% exceeds "
                            f"{100 * thresholds.step_p90:.0f}%")
        if r["expected_exact"] and not r["exact"]:
            failures.append(f"{r['system']}: counters differ ({', '.join(r['counters_differ'])}) where they must match")
        for key, what, rule in (("cpu_lane_handoffs", "the CPU lane was handed to its sleeping worker", "cpu_lane_wakes"),
                                ("prefetches_waited", "prefetches waited for a buffer", "prefetch_buffers")):
            e, s = r.get(f"{key}_exec"), r.get(f"{key}_sim")
            if r["expected_exact"] and None not in (e, s) and e != s:
                failures.append(f"{r['system']}: {what} {e} times executed, {s} simulated (the implementation's "
                                f"{rule} rule does not describe this run)")
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            ea, eb, sa, sb = a["exec_s"], b["exec_s"], a["sim_s"], b["sim_s"]
            if min(ea, eb) <= 0 or abs(ea - eb) / min(ea, eb) <= thresholds.order_margin:
                continue  # too close to call
            if (ea < eb) != (sa < sb):
                fast, slow = (a, b) if ea < eb else (b, a)
                failures.append(f"order: {fast['system']} is faster than {slow['system']} measured "
                                f"({fast['exec_s']:.3f} vs {slow['exec_s']:.3f} s), slower simulated "
                                f"({fast['sim_s']:.3f} vs {slow['sim_s']:.3f} s)")
    return {"ok": not failures, "failures": failures, "thresholds": dataclasses.asdict(thresholds)}


def rank_agreement(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Do executor and simulator order the systems the same way by total time? Kendall's tau over all
    pairs (ties count as neither concordant nor discordant) and the two orders."""
    names = [r["system"] for r in rows]
    e = np.array([r["exec_s"] for r in rows])
    s = np.array([r["sim_s"] for r in rows])
    conc = disc = 0
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            d = np.sign(e[i] - e[j]) * np.sign(s[i] - s[j])
            conc += d > 0
            disc += d < 0
    pairs = len(rows) * (len(rows) - 1) // 2
    return {"exec_order": [names[i] for i in np.argsort(e, kind="stable")],
            "sim_order": [names[i] for i in np.argsort(s, kind="stable")],
            "kendall_tau": float((conc - disc) / pairs) if pairs else float("nan"),
            "discordant_pairs": int(disc), "pairs": int(pairs)}


__all__ = ["KINDS", "RATES", "RUNTIME_COUNTS", "SHOWN_COUNTERS", "UNLIKE_KINDS", "Thresholds", "activity_kind",
           "busy_by_kind", "compare", "counters_equal", "expected_exact", "idle_seconds", "lanes_overlap_seconds",
           "rank_agreement", "rel_err", "runtime_count_columns", "speedup_error", "step_table", "verdict"]
