"""Reading traces: validation on load and a :class:`Trace` with NumPy views of its columns.

``read_trace(path)`` loads every column. ``read_trace(path, needs=Needs(...))`` reads only what a run
needs (docs/trace-format.md, "Reading what a run needs"): the routing columns, gate weights or router
logits only if asked, and the named lookahead columns streamed block by block and packed to each
row's predicted top-k experts, so memory grows with the rows' routing, not with the logits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dali_sim.files import PathError, check_input
from dali_sim.trace.checksum import ContentHasher, read_record, verify_columns, verify_digests
from dali_sim.trace.lookahead import pack_top_k
from dali_sim.trace.provenance import file_sha256
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


def phase_codes(col: pa.Array) -> np.ndarray:
    """A phase column (dictionary or plain strings) -> int8 codes: 0 prefill, 1 decode, -1 anything else."""
    if isinstance(col, pa.DictionaryArray):
        names = col.dictionary.to_pylist()
        remap = np.array([PHASES.index(x) if x in PHASES else -1 for x in names] or [-1], dtype=np.int8)
        return remap[col.indices.to_numpy(zero_copy_only=False)]
    return np.array([PHASES.index(x) if x in PHASES else -1 for x in col.to_pylist()], dtype=np.int8)


def check_predictor(meta: TraceMeta, predictor: str, path: Path | None) -> None:
    """The uniform error for a lookahead column the trace does not have."""
    if predictor not in meta.predictors:
        known = ", ".join(sorted(meta.predictors)) or "none"
        raise TraceError(
            f"{path or 'trace'}: no lookahead column {predictor!r} (this trace has: {known}); "
            "`dali trace record` records real ones (next-gate; residual with --residual; gate2 and gate3 "
            "with --next-gates 3), `dali trace synth --lookahead NAME=ACCURACY[@OFFSET]` makes synthetic ones"
        )


@dataclass(frozen=True)
class Needs:
    """The columns a run reads (``read_trace(path, needs=...)``): the routing (seq_id, phase, pos, layer,
    experts) always; gate weights and router logits only if asked; the named lookahead columns only as
    each row's predicted top-k experts (:meth:`Trace.predicted_top_k`: all the simulator uses of them)."""

    weights: bool = False
    router_logits: bool = False
    predictors: tuple[str, ...] = ()


class Trace:
    """A loaded trace: metadata plus an Arrow table; column accessors return (cached) NumPy arrays."""

    def __init__(self, table: pa.Table, meta: TraceMeta, path: Path | None = None, checksum: dict | None = None,
                 packed: dict[str, np.ndarray] | None = None):
        self.table = table
        self.meta = meta
        self.path = path
        #: the footer's checksum record, verified on load (None: a file written before checksums)
        self.checksum = checksum
        self._lookahead: dict[str, np.ndarray] = {}
        #: lookahead columns read packed (``needs``): predictor -> (rows, top_k) int16 predicted top-k
        self._packed: dict[str, np.ndarray] = dict(packed or {})

    def __len__(self) -> int:
        return self.table.num_rows

    def rows(self, keep: np.ndarray, meta: TraceMeta) -> "Trace":
        """The rows where ``keep`` (a boolean mask) is true, described by ``meta``: the same file (``path``
        kept, checksum record dropped); lookahead columns read packed stay packed for those rows."""
        packed = {name: top_k[keep] for name, top_k in self._packed.items()}
        return Trace(self.table.filter(pa.array(keep)), meta, self.path, packed=packed)

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
        return phase_codes(self.table.column("phase").combine_chunks())

    @functools.cached_property
    def experts(self) -> np.ndarray:
        """(rows, top_k) expert ids in rank order."""
        return fixed_list_to_numpy(self.table.column("experts"), self.top_k, np.int16)

    @functools.cached_property
    def weights(self) -> np.ndarray | None:
        if not self.meta.has_weights:
            return None
        return fixed_list_to_numpy(self._column("weights"), self.top_k, np.float32)

    @functools.cached_property
    def router_logits(self) -> np.ndarray | None:
        if not self.meta.has_router_logits:
            return None
        return fixed_list_to_numpy(self._column("router_logits"), self.num_experts, np.float32)

    def _column(self, name: str) -> pa.ChunkedArray:
        if name not in self.table.column_names:
            raise TraceError(f"{self.path or 'trace'}: column {name!r} was not read (read_trace(..., needs=...) "
                             "reads only the columns a run needs)")
        return self.table.column(name)

    def lookahead(self, predictor: str) -> np.ndarray:
        """(rows, num_experts) predicted router logits of ``predictor``; NaN rows where there is no target."""
        check_predictor(self.meta, predictor, self.path)
        if predictor not in self._lookahead:
            col = self.meta.predictors[predictor].column
            self._lookahead[predictor] = fixed_list_to_numpy(self._column(col), self.num_experts, np.float32)
        return self._lookahead[predictor]

    def predicted_top_k(self, predictor: str) -> np.ndarray:
        """(rows, top_k) int16: the experts ``predictor``'s logits rank highest in each row, best first
        (:func:`dali_sim.trace.lookahead.predicted_top_k`); -1 rows where it predicts nothing. From the
        packed column when the trace was read with ``needs``, else computed from the logits."""
        check_predictor(self.meta, predictor, self.path)
        if predictor not in self._packed:
            self._packed[predictor] = pack_top_k(self.lookahead(predictor), self.top_k)
        return self._packed[predictor]

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

    def row_arrays(self, lookahead: bool = True) -> RowArrays:
        """The columns as :mod:`dali_sim.trace.validate` checks them (``lookahead=False``: the routing only)."""
        if not lookahead:
            return RowArrays(self.seq_id, self.phase, self.pos, self.layer, self.experts)
        floats = {p.column: self.lookahead(p.name) for p in self.meta.predictors.values()}
        if self.meta.has_router_logits:
            floats["router_logits"] = self.router_logits
        return RowArrays(self.seq_id, self.phase, self.pos, self.layer, self.experts, self.weights, floats)

    # ---- views --------------------------------------------------------------------------------
    @functools.cached_property
    def row_order(self) -> np.ndarray | None:
        """The permutation that orders the rows by (seq_id, pos, layer); None when they already are."""
        s, p, layer = self.seq_id, self.pos, self.layer
        if len(s) < 2:
            return None
        ordered = (s[1:] > s[:-1]) | ((s[1:] == s[:-1]) & ((p[1:] > p[:-1]) | ((p[1:] == p[:-1]) & (layer[1:] >= layer[:-1]))))
        if ordered.all():
            return None
        del ordered
        return np.lexsort((layer, p, s))

    @functools.cached_property
    def sha256(self) -> str | None:
        """SHA-256 of the file the trace was read from (None: an in-memory trace), computed once."""
        return file_sha256(self.path) if self.path is not None else None

    def sorted(self) -> "Trace":
        """Rows ordered by (seq_id, pos, layer)."""
        order = self.row_order
        if order is None:
            return self
        return Trace(self.table.take(pa.array(order)), self.meta, self.path,
                     packed={name: top[order] for name, top in self._packed.items()})

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


def unreadable(where: str, exc: Exception, hint: str = "") -> TraceError:
    """The one-line error for a file pyarrow cannot read. One known cause is no damage: pyarrow before 26
    cannot read null rows of a fixed-size list (the lookahead rows of traces written by dali before it
    stored them as NaN rows: apache/arrow#35692)."""
    if "Expected all lists to be of size" in str(exc):
        return TraceError(
            f"{where}: this pyarrow ({pa.__version__}) cannot read the trace's null lookahead rows (null rows of a "
            f"fixed-size list, apache/arrow#35692, fixed in pyarrow 26): install pyarrow>=26, or rewrite the trace "
            f"with dali on pyarrow>=26 (it writes them as NaN rows, which every pyarrow reads): {exc}")
    return TraceError(f"{where}: not a readable Parquet file (truncated or corrupt{hint}): {exc}")


def _read_parquet(path: Path, columns: Sequence[str] | None = None) -> pa.Table:
    _check_exists(path)
    try:
        return pq.read_table(path, columns=list(columns) if columns is not None else None,
                             page_checksum_verification=True)
    except (pa.ArrowException, OSError) as exc:
        raise unreadable(str(path), exc, "; a writer killed mid-way leaves a .partial file without footer") from None


def _read_footer(path: Path) -> dict[bytes, bytes]:
    """The footer's key-value metadata."""
    _check_exists(path)
    try:
        return dict(pq.read_metadata(path).metadata or {})
    except (pa.ArrowException, OSError) as exc:
        raise unreadable(str(path), exc) from None


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


def read_trace(path: str | Path, *, validate: bool = True, allow_partial: bool = False,
               needs: Needs | None = None) -> Trace:
    """Load and (by default) validate a trace.

    Validation: the checksums (Parquet pages; metadata and every column against the footer's SHA-256
    record, when the file has one), known schema version, the expected columns and types, ids in
    range, no duplicate ids within a row, finite weights and predictions, every MoE layer present
    exactly once for every token, prefill before decode. A partial trace is refused unless
    ``allow_partial``; its last token may lack layers, so only the row checks run on it.
    ``validate=False`` skips the column checksums and the row checks (for benchmarks).

    ``needs``: read only those columns (:class:`Needs`), streamed in blocks of :data:`READ_ROWS` rows;
    the checks and checksums cover every column read, the columns not read are neither loaded nor
    checked. Default: every column, as stored.
    """
    path = Path(path)
    where = str(path)
    meta, record = read_meta_and_checksum(path)
    if meta.status == STATUS_PARTIAL and not allow_partial:
        raise TraceError(
            f"{where}: partial trace (writer stopped: {meta.partial_reason or 'unknown reason'}); "
            f"its {meta.num_rows} rows can be read with allow_partial=True (--allow-partial)"
        )
    if needs is not None:
        return _read_needed(path, meta, record, needs, validate)
    table = _read_parquet(path)
    expected = arrow_schema(meta)
    _check_columns(table.schema, table.num_rows, meta, where)
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
            check_structure(rows, meta, where, order=trace.row_order)
    return trace


def _check_columns(schema: pa.Schema, num_rows: int, meta: TraceMeta, where: str) -> None:
    """Every column the metadata implies is present with its type, and the row count is the metadata's."""
    for field in arrow_schema(meta):
        if field.name not in schema.names:
            raise TraceError(f"{where}: missing column {field.name!r} (required by its metadata)")
        got = schema.field(field.name).type
        if not got.equals(field.type):
            raise TraceError(f"{where}: column {field.name!r} has type {got}, expected {field.type}")
    if num_rows != meta.num_rows:
        raise TraceError(f"{where}: {num_rows} rows but the metadata says {meta.num_rows}")


#: rows converted, checked and hashed at once by the streaming reader (``needs``)
READ_ROWS = 1 << 17
ROUTING_COLUMNS = ("seq_id", "phase", "pos", "layer", "experts")


def _read_needed(path: Path, meta: TraceMeta, record: dict | None, needs: Needs, validate: bool) -> Trace:
    """:func:`read_trace` with ``needs``: one pass over the file's row groups, each block of rows converted
    into preallocated arrays, checked (:func:`check_rows`) and hashed; lookahead logits packed to their
    top-k per block and dropped. A checksum mismatch is reported before a row problem (as a full read does)."""
    where = str(path)
    for name in needs.predictors:
        check_predictor(meta, name, path)
    _check_exists(path)
    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True)
    except (pa.ArrowException, OSError) as exc:
        raise unreadable(where, exc) from None
    _check_columns(pf.schema_arrow, pf.metadata.num_rows, meta, where)
    expected = arrow_schema(meta)
    if record is not None and set(record["columns"]) != set(expected.names):
        raise TraceError(f"{where}: columns {sorted(expected.names)} do not match the checksummed columns "
                         f"{sorted(record['columns'])}: the file was changed or damaged after it was written")
    n, k, e = meta.num_rows, meta.top_k, meta.num_experts
    dense = list(ROUTING_COLUMNS) + (["weights"] if needs.weights and meta.has_weights else []) \
        + (["router_logits"] if needs.router_logits and meta.has_router_logits else [])
    width = {"experts": k, "weights": k, "router_logits": e}
    dtypes = {"seq_id": np.int32, "phase": np.int8, "pos": np.int32, "layer": np.int16, "experts": np.int16,
              "weights": np.float32, "router_logits": np.float32}
    arrays = {c: np.empty((n, width[c]) if c in width else n, dtypes[c]) for c in dense}
    looks = {meta.predictors[name].column: name for name in needs.predictors}
    packed = {name: np.empty((n, k), np.int16) for name in needs.predictors}
    hasher = ContentHasher(dense + list(looks)) if validate and record is not None else None
    problem: TraceError | None = None
    offset = 0
    try:
        for batch in pf.iter_batches(batch_size=READ_ROWS, columns=dense + list(looks)):
            rows = slice(offset, offset + batch.num_rows)
            for c in dense:
                col = batch.column(c)
                if col.null_count:
                    raise TraceError(f"{where}: column {c!r} has nulls")
                arrays[c][rows] = phase_codes(col) if c == "phase" else \
                    fixed_list_to_numpy(col, width[c], dtypes[c]) if c in width else col.to_numpy()
            logits = {col: fixed_list_to_numpy(batch.column(col), e, np.float32) for col in looks}
            if hasher is not None:
                for c in dense:
                    hasher.update(c, arrays[c][rows])
                for c, values in logits.items():
                    hasher.update(c, values)
            if validate and problem is None:
                block = RowArrays(*(arrays[c][rows] for c in ROUTING_COLUMNS),
                                  arrays["weights"][rows] if "weights" in arrays else None,
                                  {**logits, **({"router_logits": arrays["router_logits"][rows]}
                                                if "router_logits" in arrays else {})}, offset=offset)
                try:
                    check_rows(block, meta, where)
                except TraceError as exc:
                    problem = exc
            for c, values in logits.items():
                packed[looks[c]][rows] = pack_top_k(values, k)
            offset = rows.stop
    except (pa.ArrowException, OSError) as exc:
        raise unreadable(where, exc) from None
    if offset != n:
        raise TraceError(f"{where}: {offset} rows read but the metadata says {n}")
    if hasher is not None:
        verify_digests(record, hasher.digests(), where)
    if problem is not None:
        raise problem
    table = pa.Table.from_arrays([_arrow_column(arrays[c], c, expected.field(c).type) for c in dense],
                                 schema=pa.schema([expected.field(c) for c in dense]))
    trace = Trace(table, meta, path, record, packed)
    trace.__dict__.update(arrays)  # the column accessors (cached properties) answer with these arrays
    if validate and meta.status != STATUS_PARTIAL:
        check_structure(trace.row_arrays(lookahead=False), meta, where, order=trace.row_order)
    return trace


def _arrow_column(values: np.ndarray, name: str, typ: pa.DataType) -> pa.Array:
    """A numpy column back as the Arrow array of its trace type (zero-copy for the numeric ones)."""
    if name == "phase":
        return pa.DictionaryArray.from_arrays(pa.array(values), pa.array(list(PHASES)))
    if values.ndim == 2:
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])
    return pa.array(values)
