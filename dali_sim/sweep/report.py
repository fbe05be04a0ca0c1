"""``dali sweep report``: pivot tables, speedups over a baseline, one plot per metric and an HTML page.

From ``OUT/results.parquet`` (rows with status ``ok``): for each metric a pivot table of its value by two
grid keys (``index`` rows x ``columns`` columns; further keys that vary become outer row levels and
plot panels; seeds are averaged), for speed metrics the speedup over a baseline system at the same
setting (times: baseline / system; rates: system / baseline), a PNG per metric and ``index.html`` with
every figure embedded (base64) and every table, plus the configurations that failed. Colours: one per
system, those of ``experiments/style.py`` where it can be imported, else derived from the name.
"""

from __future__ import annotations

import base64
import html
import importlib.util
import io
import tomllib
import zlib
from pathlib import Path
from typing import Any, Callable

from dali_sim.files import atomic_output, write_text_atomic
from dali_sim.sweep.spec import SweepError
from dali_sim.sweep.store import METRIC_COLUMNS, read_results

DEFAULT_METRICS = ("decode_tokens_per_s", "prefill_tokens_per_s", "hit_rate", "gpu_fraction", "bytes_h2d",
                   "makespan_s")
#: speed metrics: higher is faster (rates) or lower is faster (times); speedups are reported for these
RATES = ("prefill_tokens_per_s", "decode_tokens_per_s", "prefill_throughput", "decode_throughput")
TIMES = ("makespan_s", "prefill_s", "decode_s", "ttft_s", "tpot_s")
#: configuration columns that are not grid keys of a report
NOT_KEYS = ("config_hash", "status", "error", "overrides", "system_config", "trace_sha256", "timing")
LABELS = {"decode_tokens_per_s": "decode tokens/s per sequence", "prefill_tokens_per_s": "prefill tokens/s per sequence",
          "hit_rate": "GPU cache hit rate", "gpu_fraction": "share of experts run on the GPU",
          "bytes_h2d": "bytes copied host-to-GPU", "makespan_s": "makespan (s)"}
_FALLBACK = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
             "#17becf")


def _style_color() -> Callable[[str], str]:
    """``experiments/style.py``'s colour per system when the repository has it (the figures of the paper
    use the same), else a colour derived from the name (stable across reports)."""
    path = Path(__file__).resolve().parents[2] / "experiments" / "style.py"
    try:
        spec = importlib.util.spec_from_file_location("_dali_experiment_style", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.color
    except (OSError, ImportError, AttributeError, SyntaxError):
        return lambda name: _FALLBACK[zlib.crc32(str(name).encode()) % len(_FALLBACK)]


def grid_keys(df) -> list[str]:
    """The configuration columns of a results frame (the keys a report can pivot by)."""
    keys = [c for c in df.columns if c not in METRIC_COLUMNS and c not in NOT_KEYS]
    if "trace" in keys and "model" in keys:
        keys.remove("model")  # a function of the trace
    return keys


def _varying(df, keys: list[str]) -> list[str]:
    return [k for k in keys if df[k].astype(str).nunique() > 1]


def _spec_baseline(out: Path) -> str | None:
    try:
        return tomllib.loads((out / "spec.toml").read_text(encoding="utf-8")).get("baseline")
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None


def _with_variants(df, columns: str, keys: list[str]):
    """With per-system grid keys (``SYSTEM:section.key``) and ``columns == "system"``: the system column
    names the variant (``dali (prefetch.k=2)``), so a table never averages over a system's own axis."""
    own = [k for k in keys if ":" in k]
    if not own:
        return df, keys
    df = df.copy()
    for k in own:  # text, "-" for the other systems (a table level or plot panel can then group by it)
        df[k] = [_text(v) for v in df[k]]
    if columns != "system":
        return df, keys

    def label(row) -> str:
        parts = [f"{k.partition(':')[2]}={row[k]}" for k in own if row[k] != "-"]
        return f"{row['system']} ({', '.join(parts)})" if parts else row["system"]

    df["base_system"] = df["system"]
    df["system"] = df.apply(label, axis=1)
    return df, [k for k in keys if k not in own]


def _text(value) -> str:
    if value is None or value != value:
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


def speedups(ok, metric: str, baseline: str, keys: list[str]):
    """Per row: the speedup of ``metric`` over the baseline system's row at the same setting (every key
    but the system and the systems' own keys); NaN where the baseline has no such row."""
    match = [k for k in keys if k != "system" and ":" not in k] + ["_all"]
    system = "base_system" if "base_system" in ok else "system"
    ok = ok.assign(_all=0)
    base = ok[ok[system] == baseline][match + [metric]].rename(columns={metric: "_base"})
    merged = ok.merge(base.drop_duplicates(match), on=match, how="left")
    value = merged[metric].astype(float)
    ratio = merged["_base"].astype(float) / value if metric in TIMES else value / merged["_base"].astype(float)
    merged[metric] = ratio
    return merged


def pivot(ok, metric: str, index: str, columns: str, facets: list[str]):
    """Mean of ``metric`` by (facets..., index) x columns (the mean is over seeds and anything else left)."""
    return ok.pivot_table(index=facets + [index], columns=columns, values=metric, aggfunc="mean", sort=True,
                          dropna=False)


def _plot(table, metric: str, index: str, columns: str, facets: list[str], color) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [((), table)] if not facets else list(table.groupby(level=list(range(len(facets))), sort=True))
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    legend_rows = -(-len(table.columns) // 4)
    legend_in = 0.45 + 0.25 * legend_rows  # room under the panels for the legend
    height = 3.4 * nrows + legend_in
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.8 * ncols, height), squeeze=False)
    for ax, (key, part) in zip(axes.flat, panels):
        part = part.droplevel(list(range(len(facets)))) if facets else part
        x = list(range(len(part.index)))
        for i, name in enumerate(part.columns):
            y = part[name].astype(float).to_numpy()
            base = str(name).split(" (")[0]
            ax.plot(x, y, marker="os^vD<>"[i % 7], label=str(name), color=color(base) if columns == "system" else
                    color(str(name)), linestyle="-" if base == str(name) else "--")
        ax.set_xticks(x, [str(v) for v in part.index], rotation=30 if len(x) > 6 else 0)
        ax.set_xlabel(index)
        ax.set_ylabel(LABELS.get(metric, metric))
        key = key if isinstance(key, tuple) else (key,)
        ax.set_title(", ".join(f"{k}={v}" for k, v in zip(facets, key)) or metric, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8, title=columns,
               bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0, legend_in / height, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _check_key(key: str, keys: list[str], option: str) -> None:
    if key not in keys:
        raise SweepError(f"{option} {key!r}: not a grid key of these results; keys: {', '.join(keys)}")


def write_report(out: str | Path, report_dir: str | Path, *, index: str | None = None, columns: str = "system",
                 baseline: str | None = None, metrics: list[str] | None = None) -> dict[str, Any]:
    """Write the tables (CSV), figures (PNG) and ``index.html`` of ``out``'s results into ``report_dir``;
    returns their paths."""
    out, report_dir = Path(out), Path(report_dir)
    df = read_results(out).to_pandas()
    ok, errors = df[df["status"] == "ok"], df[df["status"] != "ok"]
    if ok.empty:
        raise SweepError(f"{out}: no configuration finished without error; nothing to report")
    keys = grid_keys(df)
    _check_key(columns, keys, "--columns")
    ok, keys = _with_variants(ok, columns, keys)
    varying = _varying(ok, keys)
    if index is None:
        index = next((k for k in varying if k not in (columns, "seed")), next(k for k in keys if k != columns))
    _check_key(index, keys, "--index")
    if index == columns:
        raise SweepError(f"--index and --columns are both {index!r}: give two different grid keys")
    facets = [k for k in varying if k not in (index, columns, "seed")]
    systems = list(dict.fromkeys(ok.get("base_system", ok["system"])))
    baseline = baseline or _spec_baseline(out) or systems[0]
    if baseline not in systems:
        raise SweepError(f"--baseline {baseline!r}: not a system of these results ({', '.join(systems)})")
    wanted = metrics or [m for m in DEFAULT_METRICS if m in ok and ok[m].notna().any()]
    for m in wanted:
        if m not in ok:
            raise SweepError(f"--metric {m!r}: not a column of the results; metrics: {', '.join(METRIC_COLUMNS)}")
    color = _style_color()
    seeds = ok["seed"].nunique() if "seed" in ok else 1
    written: dict[str, Any] = {"tables": [], "figures": [], "html": report_dir / "index.html"}
    sections = []
    for metric in wanted:
        table = pivot(ok, metric, index, columns, facets)
        written["tables"].append(_write_csv(table, report_dir / "tables" / f"{metric}.csv"))
        parts = [f"<h2>{html.escape(LABELS.get(metric, metric))} <code>{html.escape(metric)}</code></h2>"]
        if table.notna().any().any():
            png = _plot(table, metric, index, columns, facets, color)
            with atomic_output(report_dir / "figures" / f"{metric}.png") as tmp:
                tmp.write_bytes(png)
            written["figures"].append(report_dir / "figures" / f"{metric}.png")
            parts.append(f'<img alt="{html.escape(metric)}" src="data:image/png;base64,'
                         f'{base64.b64encode(png).decode()}">')
        note = f" (mean over {seeds} seeds)" if seeds > 1 else ""
        parts.append(f"<h3>{html.escape(metric)} by {html.escape(index)} x {html.escape(columns)}{note}</h3>"
                     + table.to_html(float_format=lambda v: f"{v:,.4g}", na_rep="-"))
        if metric in RATES + TIMES and columns == "system":
            speed = pivot(speedups(ok, metric, baseline, keys), metric, index, columns, facets)
            written["tables"].append(_write_csv(speed, report_dir / "tables" / f"{metric}_speedup_over_{baseline}.csv"))
            parts.append(f"<h3>speedup over {html.escape(baseline)} ({'baseline / system' if metric in TIMES else 'system / baseline'})</h3>"
                         + speed.to_html(float_format=lambda v: f"{v:,.2f}x", na_rep="-"))
        sections.append("\n".join(parts))
    if not errors.empty:
        cols = [c for c in ["config_hash", *keys, "error"] if c in errors]
        sections.append(f"<h2>Failed configurations ({len(errors)})</h2>" + errors[cols].to_html(index=False))
    head = (f"<h1>dali sweep report: {html.escape(str(out))}</h1><p>{len(df)} configurations: {len(ok)} ok, "
            f"{len(errors)} failed; rows {html.escape(index)}, columns {html.escape(columns)}"
            + (f", panels by {html.escape(', '.join(facets))}" if facets else "")
            + f"; speedups over {html.escape(baseline)}.</p>")
    page = ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>dali sweep report</title><style>"
            "body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;font-size:12px;"
            "margin-bottom:1em}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}img{max-width:100%}"
            "</style></head><body>" + head + "\n".join(sections) + "</body></html>")
    write_text_atomic(written["html"], page)
    return written


def _write_csv(table, path: Path) -> Path:
    write_text_atomic(path, table.to_csv())
    return path


__all__ = ["DEFAULT_METRICS", "grid_keys", "pivot", "speedups", "write_report"]
