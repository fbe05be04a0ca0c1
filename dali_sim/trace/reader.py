"""Reading traces: validation on load and a :class:`Trace` with NumPy views of its columns."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dali_sim.files import PathError, check_input
from dali_sim.trace.checksum import read_record, verify_columns
from dali_sim.trace.schema import (
    META_KEY,
    PHASES,
    STATUS_PARTIAL,
    TraceError,
    TraceMeta,
    arrow_schema,
    meta_from_mapping,
    partial_path,
)
from dali_sim.trace.validate import RowArrays, check_rows, check_structure

if TYPE_CHECKING:
    import pandas as pd  # the methods that return frames import it: `dali trace info` needs no pandas


def fixed_list_to_numpy(column: pa.ChunkedArray | pa.Array, width: int, dtype=None) -> np.ndarray:
    """Fixed-size-list column -> (n, width) array; null rows become NaN (float) rows."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(arr)
    if arr.null_count:
        values = arr.fill_null(pa.scalar([np.nan] * width, type=arr.type)).flatten()
    else:
        values = arr.flatten()
    out = values.to_numpy(zero_copy_only=False).reshape(n, width)
    return out.astype(dtype, copy=False) if dtype is not None else out


class Trace:
    """A loaded trace: metadata plus an Arrow table; column accessors return (cached) NumPy arrays."""

    def __init__(self, table: pa.Table, meta: TraceMeta, path: Path | None = None, checksum: dict | None = None):
        self.table = table
        self.meta = meta
        self.path = path
        #: the footer's checksum record, verified on load (None: a file written before checksums)
        self.checksum = checksum
        self._lookahead: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return self.table.num_rows

    def __repr__(self) -> str:
        return (f"Trace({self.path or '<memory>'}: {len(self)} rows, model={self.meta.model.name}, "
                f"{self.num_sequences} sequences, status={self.meta.status})")

    # ---- shape --------------------------------------------------------------------------------
    @property
    def model(self):
        return self.meta.model

    @property
    def top_k(self) -> int:
        return self.meta.top_k

    @property
    def num_experts(self) -> int:
        return self.meta.num_experts

    @property
    def layers(self) -> tuple[int, ...]:
        return self.meta.layers

    @property
    def num_sequences(self) -> int:
        return int(np.unique(self.seq_id).size)

    # ---- columns ------------------------------------------------------------------------------
    @functools.cached_property
    def seq_id(self) -> np.ndarray:
        return self.table.column("seq_id").to_numpy()

    @functools.cached_property
    def pos(self) -> np.ndarray:
        return self.table.column("pos").to_numpy()

    @functools.cached_property
    def layer(self) -> np.ndarray:
        return self.table.column("layer").to_numpy()

    @functools.cached_property
    def layer_index(self) -> np.ndarray:
        """MoE-layer ordinal (0..num_moe_layers-1) of each row."""
        return np.searchsorted(np.asarray(self.layers), self.layer).astype(np.int16)

    @functools.cached_property
    def phase(self) -> np.ndarray:
        """Phase codes: 0 = prefill, 1 = decode (see :data:`PHASES`)."""
        col = self.table.column("phase").combine_chunks()
        if isinstance(col, pa.DictionaryArray):
            names = col.dictionary.to_pylist()
            remap = np.array([PHASES.index(x) if x in PHASES else -1 for x in names], dtype=np.int8)
            return remap[col.indices.to_numpy(zero_copy_only=False)]
        return np.array([PHASES.index(x) if x in PHASES else -1 for x in col.to_pylist()], dtype=np.int8)

    @functools.cached_property
    def experts(self) -> np.ndarray:
        """(rows, top_k) expert ids in rank order."""
        return fixed_list_to_numpy(self.table.column("experts"), self.top_k, np.int16)

    @functools.cached_property
    def weights(self) -> np.ndarray | None:
        if not self.meta.has_weights:
            return None
        return fixed_list_to_numpy(self.table.column("weights"), self.top_k, np.float32)

    @functools.cached_property
    def router_logits(self) -> np.ndarray | None:
        if not self.meta.has_router_logits:
            return None
        return fixed_list_to_numpy(self.table.column("router_logits"), self.num_experts, np.float32)

    def lookahead(self, predictor: str) -> np.ndarray:
        """(rows, num_experts) predicted router logits of ``predictor``; NaN rows where there is no target."""
        if predictor not in self.meta.predictors:
            known = ", ".join(sorted(self.meta.predictors)) or "none"
            raise TraceError(
                f"{self.path or 'trace'}: no lookahead column {predictor!r} (this trace has: {known}); "
                "`dali trace record` records real ones (next-gate; residual with --residual; gate2 and gate3 "
                "with --next-gates 3), `dali trace synth --lookahead NAME=ACCURACY[@OFFSET]` makes synthetic ones"
            )
        if predictor not in self._lookahead:
            col = self.meta.predictors[predictor].column
            self._lookahead[predictor] = fixed_list_to_numpy(self.table.column(col), self.num_experts, np.float32)
        return self._lookahead[predictor]

    def column_arrays(self) -> dict[str, np.ndarray]:
        """Every column as the accessors return it, by column name (what the checksums cover)."""
        cols = {"seq_id": self.seq_id, "phase": self.phase, "pos": self.pos, "layer": self.layer,
                "experts": self.experts}
        if self.meta.has_weights:
            cols["weights"] = self.weights
        if self.meta.has_router_logits:
            cols["router_logits"] = self.router_logits
        for p in self.meta.predictors.values():
            cols[p.column] = self.lookahead(p.name)
        return cols

    def row_arrays(self) -> RowArrays:
        floats = {p.column: self.lookahead(p.name) for p in self.meta.predictors.values()}
        if self.meta.has_router_logits:
            floats["router_logits"] = self.router_logits
        return RowArrays(self.seq_id, self.phase, self.pos, self.layer, self.experts, self.weights, floats)

    # ---- views --------------------------------------------------------------------------------
    def sorted(self) -> "Trace":
        """Rows ordered by (seq_id, pos, layer)."""
        order = np.lexsort((self.layer, self.pos, self.seq_id))
        if np.all(order[1:] > order[:-1]):
            return self
        return Trace(self.table.take(pa.array(order)), self.meta, self.path)

    def to_pandas(self) -> pd.DataFrame:
        """One row per (seq, pos, layer); list columns become arrays per cell."""
        df = self.table.to_pandas()
        df["phase"] = df["phase"].astype(str)
        return df

    def hidden_states(self) -> tuple[pd.DataFrame, np.ndarray]:
        """(keys DataFrame with seq_id/pos/layer, (n, dim) float16 array) from the sidecar file."""
        info = self.meta.hidden_states
        if info is None:
            raise TraceError(f"{self.path or 'trace'}: has no hidden states (record with --hidden-states)")
        if self.path is None:
            raise TraceError("hidden states live beside a trace file; this trace was not read from a file")
        side = self.path.with_name(info.file)
        if not side.exists() and partial_path(side).exists():
            side = partial_path(side)
        footer = _read_footer(side)
        table = _read_parquet(side)
        hidden = fixed_list_to_numpy(table.column("hidden"), info.dim, np.float16)
        record = read_record(footer, footer.get(META_KEY.encode(), b""), str(side))
        if record is not None:
            keys = {c: table.column(c).to_numpy() for c in ("seq_id", "pos", "layer")}
            verify_columns(record, {**keys, "hidden": hidden}, str(side))
        return table.select(["seq_id", "pos", "layer"]).to_pandas(), hidden


def _check_exists(path: Path) -> None:
    if not path.exists():
        hint = f"; a partial trace exists at {partial_path(path)}" if partial_path(path).exists() else ""
        raise TraceError(f"{path}: no such file{hint}")
    try:
        check_input(path, "trace")
    except PathError as exc:
        raise TraceError(str(exc)) from None


def _read_parquet(path: Path, columns: Sequence[str] | None = None) -> pa.Table:
    _check_exists(path)
    try:
        return pq.read_table(path, columns=list(columns) if columns is not None else None,
                             page_checksum_verification=True)
    except (pa.ArrowException, OSError) as exc:
        raise TraceError(
            f"{path}: not a readable Parquet file (truncated or corrupt; a writer killed mid-way leaves "
            f"a .partial file without footer): {exc}"
        ) from None


def _read_footer(path: Path) -> dict[bytes, bytes]:
    """The footer's key-value metadata."""
    _check_exists(path)
    try:
        return dict(pq.read_metadata(path).metadata or {})
    except (pa.ArrowException, OSError) as exc:
        raise TraceError(f"{path}: not a readable Parquet file (truncated or corrupt): {exc}") from None


def read_meta_and_checksum(path: str | Path) -> tuple[TraceMeta, dict | None]:
    """The metadata (checked against the footer's checksum record) and that record (None: no checksum)."""
    path = Path(path)
    footer = _read_footer(path)
    meta = footer.get(META_KEY.encode())
    record = read_record(footer, meta, str(path)) if meta is not None else None
    return meta_from_mapping(footer, str(path)), record


def read_meta(path: str | Path) -> TraceMeta:
    """Only the metadata (cheap: reads the footer), checked against its checksum."""
    return read_meta_and_checksum(path)[0]


def read_trace(path: str | Path, *, validate: bool = True, allow_partial: bool = False) -> Trace:
    """Load and (by default) validate a trace.

    Validation: the checksums (Parquet pages; metadata and every column against the footer's SHA-256
    record, when the file has one), known schema version, the expected columns and types, ids in
    range, no duplicate ids within a row, finite weights and predictions, every MoE layer present
    exactly once for every token, prefill before decode. A partial trace is refused unless
    ``allow_partial``; its last token may lack layers, so only the row checks run on it.
    ``validate=False`` skips the column checksums and the row checks (for benchmarks).
    """
    path = Path(path)
    where = str(path)
    meta, record = read_meta_and_checksum(path)
    if meta.status == STATUS_PARTIAL and not allow_partial:
        raise TraceError(
            f"{where}: partial trace (writer stopped: {meta.partial_reason or 'unknown reason'}); "
            f"its {meta.num_rows} rows can be read with allow_partial=True (--allow-partial)"
        )
    table = _read_parquet(path)
    expected = arrow_schema(meta)
    for field in expected:
        if field.name not in table.column_names:
            raise TraceError(f"{where}: missing column {field.name!r} (required by its metadata)")
        got = table.schema.field(field.name).type
        if not got.equals(field.type):
            raise TraceError(f"{where}: column {field.name!r} has type {got}, expected {field.type}")
    if table.num_rows != meta.num_rows:
        raise TraceError(f"{where}: {table.num_rows} rows but the metadata says {meta.num_rows}")
    trace = Trace(table.select(expected.names), meta, path, record)
    if validate and record is not None:
        verify_columns(record, trace.column_arrays(), where)
    if validate:
        for c in ("seq_id", "pos", "layer", "phase", "experts", "weights"):
            if c in table.column_names and table.column(c).null_count:
                raise TraceError(f"{where}: column {c!r} has nulls")
        rows = trace.row_arrays()
        check_rows(rows, meta, where)
        if meta.status != STATUS_PARTIAL:
            check_structure(rows, meta, where)
    return trace
