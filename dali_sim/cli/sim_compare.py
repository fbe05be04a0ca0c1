"""What `dali sim compare` prints: which system wins here, by how much, and why.

A header with the setting (model, precision, hardware, GPU budget, cache slots per layer, batch,
tokens), one row per system, a one-line legend of the columns, and the winner: the achievable system
(bounds excluded) with the most decode tokens per second per sequence (prefill when the trace has no
decode), with its speedup over the baseline and the hit and GPU shares that explain it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

COMPARE_COLUMNS = ["hit_rate", "gpu_fraction", "on_demand", "bytes_h2d", "prefill_s", "decode_s",
                   "prefill_tokens_per_s", "decode_tokens_per_s"]
_HEADERS = {"cache_slots": "slots/layer", "hit_rate": "hit %", "gpu_fraction": "GPU %", "on_demand": "on-demand",
            "bytes_h2d": "H2D GiB", "prefill_tokens_per_s": "prefill tok/s", "decode_tokens_per_s": "decode tok/s",
            "prefill_speedup": "prefill x", "decode_speedup": "decode x"}
_DIGITS = {"hit_rate": 1, "gpu_fraction": 1, "on_demand": 0, "bytes_h2d": 2, "prefill_s": 3, "decode_s": 3,
           "prefill_tokens_per_s": 2, "decode_tokens_per_s": 2, "prefill_speedup": 2, "decode_speedup": 2}


def slots_text(caps: list[int] | None) -> str:
    """Cache slots per MoE layer: ``8``, or ``0-32`` when layers differ (llama.cpp's whole layers); ``any``
    for a time bound (expert buffers in any layout)."""
    if caps is None:
        return "any"
    return str(caps[0]) if len(set(caps)) == 1 else f"{min(caps)}-{max(caps)}"


def label_lines(summary: dict) -> list[str]:
    """The BOUND / ORACLE lines of a result: what its bounds bound, and which policies read the future."""
    from dali_sim.policies.systems import FAMILIES

    lines = []
    for family, name in summary.get("bounds", {}).items():
        what = ("time: no system is faster with this cost model, GPU memory and batching" if family == "time"
                else FAMILIES[family].get(name).bound_of or "an exact optimum")
        lines.append(f"BOUND: {family} {name} bounds {what}; it is not an achievable system")
    for family, name in summary.get("oracles", {}).items():
        lines.append(f"ORACLE HEURISTIC: {family} {name} reads the future: a reference point, neither achievable "
                     "nor a bound")
    return lines


def compare_table(results: Mapping[str, Any], baseline: str):
    """One row per system: slots, hit and GPU shares, copies, times, per-sequence tok/s, speedups."""
    import pandas as pd

    rows = {}
    for name, r in results.items():
        rows[name] = {"cache_slots": slots_text(r.manifest["memory"]["cache_slots_per_layer"]),
                      **{c: r.summary.get(c, float("nan")) for c in COMPARE_COLUMNS}}
    df = pd.DataFrame.from_dict(rows, orient="index")
    df.index.name = "system"
    if "decode_s" in results[baseline].summary:
        base = df.loc[baseline]
        for phase in ("prefill", "decode"):
            df[f"{phase}_speedup"] = base[f"{phase}_s"] / df[f"{phase}_s"]
    return df


def _same_or(values: list[str], what: str) -> str:
    return values[0] if len(set(values)) == 1 else f"{what} by system"


def header(results: Mapping[str, Any]) -> str:
    """The setting every row shares: model, precision, hardware, GPU budget, cache slots, batch, tokens."""
    first = next(iter(results.values()))
    s = first.summary
    budgets = [f"{r.manifest['memory']['budget_gib']:.1f} GiB" for r in results.values()]
    slots = [slots_text(r.manifest["memory"]["cache_slots_per_layer"]) for r in results.values()]
    slot_text = (f"{slots[0]} cache slots per MoE layer" if len(set(slots)) == 1
                 else "cache slots per MoE layer by system (column slots/layer)")
    return (f"{s['model']} ({first.config['precision']}) on {s['hardware']}: GPU budget "
            f"{_same_or(budgets, 'budget')}, {slot_text}, batch {s['batch_size']}, {s['sequences']} sequences, "
            f"{s['tokens']:,} tokens")


def legend(baseline: str, timed: bool) -> str:
    text = ("legend: slots/layer = GPU cache slots per MoE layer (range when layers differ); hit % = activated "
            "experts found in the GPU cache; GPU % = activated experts computed on the GPU (the rest on the CPU); "
            "on-demand = experts copied when needed")
    if timed:
        text += (f"; tok/s = tokens per second per sequence; x = speedup over {baseline} "
                 "(its phase time / this system's)")
    return text


def _score(r) -> tuple[str, float]:
    s = r.summary
    for phase in ("decode", "prefill"):
        v = s.get(f"{phase}_tokens_per_s", float("nan"))
        if isinstance(v, float) and not math.isnan(v):
            return phase, v
    return "", float("nan")


def _unranked(r) -> bool:
    """A bound or an oracle heuristic: not an achievable system, never the winner."""
    return bool(r.summary["bounds"] or r.summary.get("oracles"))


def winner(results: Mapping[str, Any], baseline: str) -> dict[str, Any] | None:
    """The achievable system with the most tokens per second per sequence (decode, else prefill); None
    without times or when no system is achievable (bounds and oracle heuristics are not ranked)."""
    scored = {n: _score(r) for n, r in results.items() if not _unranked(r)}
    scored = {n: v for n, v in scored.items() if v[0] and not math.isnan(v[1])}
    if not scored:
        return None
    phase = "decode" if any(p == "decode" for p, _ in scored.values()) else "prefill"
    scored = {n: v for n, v in scored.items() if v[0] == phase}
    name = max(scored, key=lambda n: (scored[n][1], n == baseline))
    base = results[baseline].summary
    s = results[name].summary
    base_rate = base.get(f"{phase}_tokens_per_s", float("nan"))
    ranked = sorted(scored, key=lambda n: -scored[n][1])
    return {"system": name, "phase": phase, "tokens_per_s": s[f"{phase}_tokens_per_s"],
            "speedup": s[f"{phase}_tokens_per_s"] / base_rate if base_rate else float("nan"),
            "runner_up": ranked[1] if len(ranked) > 1 else None}


def winner_line(results: Mapping[str, Any], baseline: str) -> str:
    w = winner(results, baseline)
    if w is None:
        timed = any("decode_s" in r.summary for r in results.values())
        return "winner: none named: " + ("no system is achievable" if timed else "no times (--no-timing)")
    name, phase = w["system"], w["phase"]
    s, b = results[name].summary, results[baseline].summary
    line = f"winner: {name}, {w['tokens_per_s']:,.2f} {phase} tok/s per sequence"
    if name != baseline:
        line += (f", {w['speedup']:.2f}x {baseline} (hit {100 * s['hit_rate']:.0f}% vs {100 * b['hit_rate']:.0f}%, "
                 f"GPU {100 * s['gpu_fraction']:.0f}% vs {100 * b['gpu_fraction']:.0f}% of experts)")
    else:
        line += " (the baseline itself)"
    if w["runner_up"] is not None:
        r = results[w["runner_up"]].summary
        line += f"; next {w['runner_up']} at {r[f'{phase}_tokens_per_s']:,.2f}"
    unranked = [n for n, r in results.items() if _unranked(r)]
    if unranked:
        line += f"; not ranked (bounds, oracle heuristics): {', '.join(unranked)}"
    return line


def format_compare(results: Mapping[str, Any], baseline: str, table) -> str:
    """Header, the profiling line, table, legend, notes and the winner, as printed by `dali sim compare`."""
    from dali_sim.workload.profiling import describe_profiling

    show = table.copy()
    show["hit_rate"] = 100 * show["hit_rate"]
    show["gpu_fraction"] = 100 * show["gpu_fraction"]
    show["bytes_h2d"] = show["bytes_h2d"] / 2**30
    formats = {c: (lambda d, x: lambda v: f"{v:,.{d}f}{x}")(d, "x" if c.endswith("speedup") else "")
               for c, d in _DIGITS.items() if c in show}
    timed = "decode_s" in next(iter(results.values())).summary
    if not timed:
        show = show.drop(columns=[c for c in show.columns if c.endswith(("_s", "_per_s", "speedup"))])
    first = next(iter(results.values())).manifest.get("profiling")
    lines = [header(results), *([describe_profiling(first)] if first else []),
             show.to_string(formatters=formats, na_rep="-", header=[_HEADERS.get(c, c) for c in show.columns]),
             legend(baseline, timed)]
    for name, r in results.items():
        lines += [f"note ({name}): {note}" for note in r.manifest["memory"]["notes"]]
        lines += [f"{name}: {line}" for line in label_lines(r.summary)]
    lines.append(winner_line(results, baseline))
    return "\n".join(lines)


__all__ = ["COMPARE_COLUMNS", "compare_table", "format_compare", "header", "label_lines", "legend", "slots_text", "winner",
           "winner_line"]
