"""The result store of a sweep: ``OUT/results.parquet`` (one row per configuration) and
``OUT/manifests/<config_hash>.json`` (everything a run used and gave).

Rows are kept by configuration hash. :meth:`ResultStore.flush` rewrites the whole table to a temporary
file and renames it into place (signals held meanwhile), so the file on disk is always a complete
table of finished configurations, whatever interrupts the sweep. Row order: the spec's configurations
in the spec's order, then rows of configurations the spec no longer has (kept, never dropped), in the
order they were stored. The columns are in docs/sweeps.md ("Store").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from dali_sim.files import atomic_output, deferred_signals, write_text_atomic
from dali_sim.jsonsafe import json_safe
from dali_sim.sim.counters import COUNTERS
from dali_sim.sweep.spec import RunConfig, SweepError
from dali_sim.sweep.worker import Outcome

RESULTS_FILE = "results.parquet"
MANIFESTS = "manifests"
#: the configuration columns every row has, first
CONFIG_COLUMNS = ("config_hash", "status", "error", "trace", "model", "precision", "hardware", "system",
                  "batch_size", "prefill_chunk", "seed", "timing", "profile_share")
WORKLOAD_METRICS = ("steps", "prefill_steps", "decode_steps", "batches", "sequences", "tokens")
DERIVED_METRICS = ("hit_rate", "gpu_fraction", "prefetch_precision", "prefetch_recall", "transfers", "bytes_h2d")
TIME_METRICS = ("makespan_s", "prefill_s", "decode_s", "prefill_tokens_per_s", "decode_tokens_per_s",
                "prefill_throughput", "decode_throughput", "ttft_s", "tpot_s")
BUSY_LANES = ("gpu", "cpu", "pcie", "host")
#: every metric of docs/metrics.md that a run's summary has, in this order (NaN / null where it has none)
METRIC_COLUMNS = (WORKLOAD_METRICS + COUNTERS + DERIVED_METRICS + TIME_METRICS
                  + tuple(f"busy_{lane}" for lane in BUSY_LANES) + ("events", "bounds", "oracles", "gpu_budget_gib",
                                                                    "cache_slots"))
_INT = ("batch_size", "prefill_chunk", "seed", "events", "transfers", "bytes_h2d") + WORKLOAD_METRICS + COUNTERS
_FLOAT = ("profile_share", "hit_rate", "gpu_fraction", "prefetch_precision", "prefetch_recall", "gpu_budget_gib") + TIME_METRICS \
    + tuple(f"busy_{lane}" for lane in BUSY_LANES)
_STRING = ("config_hash", "status", "error", "trace", "model", "precision", "hardware", "system", "overrides",
           "system_config", "trace_sha256", "bounds", "oracles", "cache_slots")


def _labels(families: dict[str, str] | None) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted((families or {}).items()))


def metrics(summary: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
    """The :data:`METRIC_COLUMNS` of one run's summary and manifest."""
    from dali_sim.cli.sim_compare import slots_text

    out: dict[str, Any] = {k: summary.get(k) for k in WORKLOAD_METRICS + COUNTERS + DERIVED_METRICS + TIME_METRICS}
    busy = summary.get("busy") or {}
    out |= {f"busy_{lane}": busy.get(lane) for lane in BUSY_LANES}
    out["events"] = summary.get("events")
    out["bounds"], out["oracles"] = _labels(summary.get("bounds")), _labels(summary.get("oracles"))
    memory = manifest.get("memory") or {}
    out["gpu_budget_gib"] = memory.get("budget_gib")
    out["cache_slots"] = slots_text(memory.get("cache_slots_per_layer"))
    return out


def result_row(run: RunConfig, outcome: Outcome) -> dict[str, Any]:
    """One row of the results table: the configuration's resolved settings, its status and its metrics."""
    row: dict[str, Any] = {"config_hash": run.hash, "status": outcome.status, "error": outcome.error,
                           "trace": run.trace, "model": run.model, "precision": run.precision_name,
                           "hardware": run.hardware, "system": run.system, "batch_size": run.batch_size,
                           "prefill_chunk": run.prefill_chunk, "seed": run.seed, "timing": run.timing,
                           "profile_share": run.profile_share}
    row |= {k: v for k, v in run.grid.items() if k not in row}
    row |= {"overrides": json.dumps(run.overrides, sort_keys=True),
            "system_config": json.dumps(run.system_config, sort_keys=True), "trace_sha256": run.trace_sha256}
    empty = dict.fromkeys(METRIC_COLUMNS)
    return row | (metrics(outcome.summary, outcome.manifest) if outcome.status == "ok" else empty)


def _arrow_type(name: str, values: list[Any]):
    import pyarrow as pa

    if name in _INT:
        return pa.int64()
    if name in _FLOAT:
        return pa.float64()
    if name in _STRING:
        return pa.string()
    if name == "timing":
        return pa.bool_()
    try:
        typ = pa.array(values).type
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None  # mixed kinds: stored as text
    return pa.string() if pa.types.is_null(typ) else typ


def results_table(rows: list[dict[str, Any]]):
    """The Arrow table of ``rows`` (missing cells null; typed columns as documented)."""
    import pyarrow as pa

    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(k for k in row if k not in METRIC_COLUMNS))
    columns = list(names) + list(METRIC_COLUMNS)
    arrays, fields = [], []
    for name in columns:
        values = [row.get(name) for row in rows]
        if name in _INT:  # counts a run does not have (a time bound's cache counters) are NaN: null
            values = [None if isinstance(v, float) and v != v else v for v in values]
        typ = _arrow_type(name, values)
        if typ is None:
            values, typ = [None if v is None else str(v) for v in values], pa.string()
        arrays.append(pa.array(values, type=typ))
        fields.append(pa.field(name, typ))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


class ResultStore:
    """The rows and manifests of one output folder (see the module docstring)."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.path = self.out / RESULTS_FILE
        self.rows: dict[str, dict[str, Any]] = {}
        self._dirty = False
        if self.path.exists():
            self.rows = {r["config_hash"]: r for r in read_results(self.path).to_pylist()}

    def status(self) -> dict[str, str]:
        """Configuration hash -> ``ok`` / ``error`` of every stored row."""
        return {h: r["status"] for h, r in self.rows.items()}

    def add(self, run: RunConfig, outcome: Outcome) -> None:
        """Record one outcome: its manifest now, its row with the next :meth:`flush`."""
        manifest = {"config_hash": run.hash, "status": outcome.status, "error": outcome.error,
                    "traceback": outcome.traceback, "run": run.describe(), "config": outcome.config,
                    "manifest": outcome.manifest, "summary": outcome.summary, "wall_s": outcome.wall_s,
                    "worker": outcome.worker}
        write_text_atomic(self.out / MANIFESTS / f"{run.hash}.json",
                          json.dumps(json_safe(manifest), indent=2, sort_keys=True, allow_nan=False, default=str))
        self.rows[run.hash] = result_row(run, outcome)
        self._dirty = True

    def flush(self, order: Iterable[str], force: bool = False) -> None:
        """Write every row to ``results.parquet`` atomically: ``order``'s hashes first, in that order. Only
        when rows were added since the last write, or ``force``."""
        import pyarrow.parquet as pq

        if not (self._dirty or force):
            return
        order = [h for h in order if h in self.rows]
        first = set(order)
        rows = [self.rows[h] for h in order] + [r for h, r in self.rows.items() if h not in first]
        table = results_table(rows)
        with deferred_signals():
            with atomic_output(self.path) as tmp:
                pq.write_table(table, tmp, compression="zstd")
            self._dirty = False


def read_results(path: str | Path):
    """The results table of a sweep folder (or its ``results.parquet``) as Arrow; a one-line error if it
    is not one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    if not path.exists():
        raise SweepError(f"{path}: no such file (run `dali sweep SPEC -o {path.parent}` first)")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise SweepError(f"{path}: not a readable Parquet file: {exc}") from None
    missing = [c for c in ("config_hash", "status", "system") if c not in table.column_names]
    if missing:
        raise SweepError(f"{path}: not a dali sweep results table (no column {missing[0]!r})")
    return table


__all__ = ["CONFIG_COLUMNS", "METRIC_COLUMNS", "ResultStore", "metrics", "read_results", "result_row",
           "results_table"]
