"""Streaming trace writer: bounded memory, and a file that is either complete or recognisably partial.

While writing, rows go in row groups to a temporary file of a unique name beside the output
(``.OUT.parquet.<random>.partial``, so two writers to one output never share a file).
:meth:`TraceWriter.close` writes the footer with ``status=complete`` and renames the file to
``OUT.parquet``. If the writing code raises (Ctrl-C, and SIGTERM in the ``dali`` command, included) or
:meth:`TraceWriter.abort` is called, the footer is written with ``status=partial`` and the reason and
the file is renamed to ``OUT.parquet.partial``: readable with ``allow_partial=True``, never mistaken for
a complete trace. If even that footer cannot be written (a full disk) the temporary file is removed.
Only a process killed outright (SIGKILL) leaves its temporary file, without a footer.

Every file carries Parquet page checksums and a SHA-256 of its metadata and of every column
(:mod:`dali_sim.trace.checksum`), which the reader verifies.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dali_sim.files import check_output, deferred_signals, temp_path, write_error
from dali_sim.models.spec import ModelSpec
from dali_sim.trace.checksum import CHECKSUM_KEY, ContentHasher, checksum_record, nan_null_rows
from dali_sim.trace.provenance import default_provenance
from dali_sim.trace.schema import (
    META_KEY,
    PHASES,
    STATUS_COMPLETE,
    STATUS_PARTIAL,
    HiddenStatesInfo,
    PredictorInfo,
    SequenceInfo,
    TraceMeta,
    arrow_schema,
    fixed_list,
    hidden_sidecar_name,
    partial_path,
)
from dali_sim.trace.validate import RowArrays, check_rows

DEFAULT_ROW_GROUP = 128 * 1024


def phase_codes(phase: str | Sequence[str] | np.ndarray, n: int) -> np.ndarray:
    """``"decode"`` / array of names / array of codes -> int8 codes of length n."""
    if isinstance(phase, str):
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        return np.full(n, PHASES.index(phase), dtype=np.int8)
    arr = np.asarray(phase)
    if arr.dtype.kind in "iu":
        codes = arr.astype(np.int8)
    else:
        lookup = {name: i for i, name in enumerate(PHASES)}
        try:
            codes = np.array([lookup[str(x)] for x in arr.reshape(-1)], dtype=np.int8).reshape(arr.shape)
        except KeyError as exc:
            raise ValueError(f"phase must be one of {PHASES}, got {exc.args[0]!r}") from None
    try:
        return np.broadcast_to(codes, (n,))
    except ValueError:
        raise ValueError(f"phase must be one name or {n} phases, got shape {arr.shape}") from None


def fixed_list_array(values: np.ndarray, arrow_type: pa.DataType) -> pa.Array:
    """(n, w) numpy -> Arrow fixed-size-list array, every row valid.

    A lookahead row without a prediction is stored as a row of NaN, never as an Arrow null (the reader
    returns both as NaN rows; the checksums see the same values). pyarrow before 26 cannot read a
    fixed-size list with null rows back from Parquet, nor write one whose null rows hold values
    (apache/arrow#35692, fixed by apache/arrow#50271 in pyarrow 26)."""
    n, w = values.shape
    flat = pa.array(np.ascontiguousarray(values).reshape(-1), type=arrow_type.value_type)
    return pa.FixedSizeListArray.from_arrays(flat, w)


class _PartialParquet:
    """A ParquetWriter on a unique temporary file, renamed to ``path`` (complete) or
    ``<path>.partial`` (aborted) when finished, and removed if it cannot be finished."""

    def __init__(self, path: Path, schema: pa.Schema, compression: str):
        self.final = check_output(path, what="trace")
        self.hasher = ContentHasher(schema.names)
        self.tmp = temp_path(path)
        try:
            self.writer = pq.ParquetWriter(self.tmp, schema, compression=compression, write_page_checksum=True)
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise
        self.target: Path | None = None

    def write(self, table: pa.Table) -> None:
        try:
            self.writer.write_table(table)
        except OSError as exc:
            raise write_error(self.final, exc) from None

    def finish(self, meta_json: str, complete: bool) -> Path:
        try:
            self.writer.add_key_value_metadata({META_KEY: meta_json,
                                                CHECKSUM_KEY: checksum_record(meta_json, self.hasher.digests())})
            self.writer.close()
            target = self.final if complete else partial_path(self.final)
            os.replace(self.tmp, target)
        except BaseException as exc:
            self.discard()
            if isinstance(exc, OSError):
                raise write_error(self.final, exc) from None
            raise
        self.target = target
        return target

    def discard(self) -> None:
        """Drop the temporary file (and a finished file of this writer)."""
        try:
            self.writer.close()
        except Exception:  # a broken writer (full disk): the file goes anyway
            pass
        self.tmp.unlink(missing_ok=True)
        if self.target is not None:
            self.target.unlink(missing_ok=True)


class TraceWriter:
    """Write a trace row block by row block; use as a context manager.

    >>> with TraceWriter("out.parquet", spec, provenance={"source": "synth"}) as w:
    ...     w.write(seq_id=..., phase="decode", pos=..., layer=..., experts=..., weights=...)
    """

    def __init__(
        self,
        path: str | Path,
        model: ModelSpec,
        *,
        provenance: Mapping | None = None,
        weights: bool = True,
        weights_note: str | None = None,
        router_logits: bool = False,
        predictors: Iterable[PredictorInfo] = (),
        hidden_dim: int | None = None,
        hidden_what: str | None = None,
        sequences: Iterable[SequenceInfo] = (),
        row_group_size: int = DEFAULT_ROW_GROUP,
        compression: str = "zstd",
    ):
        self.path = Path(path)
        preds = {p.name: p for p in predictors}
        hidden = None
        if hidden_dim:
            hidden = HiddenStatesInfo(file=hidden_sidecar_name(self.path), dim=int(hidden_dim))
            if hidden_what:
                hidden = dataclasses.replace(hidden, what=hidden_what)
        self.meta = TraceMeta(
            model=model,
            provenance=dict(provenance) if provenance is not None else default_provenance("python API"),
            has_weights=weights,
            has_router_logits=router_logits,
            predictors=preds,
            hidden_states=hidden,
            sequences=list(sequences),
        )
        if weights_note:
            self.meta.weights_note = weights_note
        self.schema = arrow_schema(self.meta)
        self.row_group_size = row_group_size
        self._buffer: list[pa.Table] = []
        self._buffered = 0
        self._rows = 0
        self._hidden_rows = 0
        self._closed = False
        self._main = _PartialParquet(self.path, self.schema, compression)
        self._hidden: _PartialParquet | None = None
        self._hidden_buffer: list[pa.Table] = []
        if hidden is not None:
            self._hidden_schema = pa.schema([
                pa.field("seq_id", pa.int32(), nullable=False),
                pa.field("pos", pa.int32(), nullable=False),
                pa.field("layer", pa.int16(), nullable=False),
                pa.field("hidden", fixed_list(pa.float16(), hidden.dim), nullable=False),
            ])
            try:
                self._hidden = _PartialParquet(self.path.with_name(hidden.file), self._hidden_schema, compression)
            except BaseException:
                self._main.discard()
                raise

    # ---- rows --------------------------------------------------------------------------------
    @property
    def rows_written(self) -> int:
        return self._rows + self._buffered

    def add_sequence(self, info: SequenceInfo) -> None:
        self.meta.sequences.append(info)

    def write(
        self,
        *,
        seq_id,
        phase,
        pos,
        layer,
        experts,
        weights=None,
        router_logits=None,
        lookahead: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Append rows. Scalars broadcast; ``lookahead`` maps predictor name -> (n, E) logits, NaN rows = no prediction."""
        if self._closed:
            raise RuntimeError(f"{self.path}: writer is closed")
        experts = np.asarray(experts)
        if experts.ndim != 2:
            raise ValueError(f"experts must be a 2-D array (rows, top_k), got shape {experts.shape}")
        n = experts.shape[0]
        cols = {
            "seq_id": np.broadcast_to(np.asarray(seq_id, dtype=np.int64), (n,)),
            "pos": np.broadcast_to(np.asarray(pos, dtype=np.int64), (n,)),
            "layer": np.broadcast_to(np.asarray(layer, dtype=np.int64), (n,)),
        }
        phases = phase_codes(phase, n)
        m = self.meta
        if m.has_weights:
            if weights is None:
                raise ValueError(f"{self.path}: this trace has a weights column; pass weights=")
            weights = np.asarray(weights, dtype=np.float32)
        elif weights is not None:
            raise ValueError(f"{self.path}: this trace was opened with weights=False")
        floats: dict[str, np.ndarray] = {}
        if m.has_router_logits:
            if router_logits is None:
                raise ValueError(f"{self.path}: this trace has a router_logits column; pass router_logits=")
            floats["router_logits"] = np.asarray(router_logits, dtype=np.float32)
        lookahead = dict(lookahead or {})
        unknown = sorted(set(lookahead) - set(m.predictors))
        if unknown:
            raise ValueError(f"{self.path}: lookahead columns {unknown} were not declared as predictors")
        for name, pred in m.predictors.items():
            if name not in lookahead:
                raise ValueError(f"{self.path}: missing lookahead values for predictor {name!r}")
            floats[pred.column] = np.asarray(lookahead[name], dtype=np.float32)
        for name, values in floats.items():
            if values.shape != (n, m.num_experts):
                raise ValueError(f"{self.path}: {name} must have shape ({n}, {m.num_experts}), got {values.shape}")
        too_big = [c for c, v in cols.items() if v.size and (v.max() > np.iinfo(np.int32).max)]
        if too_big:
            raise ValueError(f"{self.path}: {too_big} exceed int32")
        rows = RowArrays(cols["seq_id"], phases, cols["pos"], cols["layer"], experts, weights, floats,
                         offset=self.rows_written)
        check_rows(rows, m, str(self.path))

        arrays = [
            pa.array(cols["seq_id"], type=pa.int32()),
            pa.DictionaryArray.from_arrays(pa.array(phases, type=pa.int8()), pa.array(PHASES)),
            pa.array(cols["pos"], type=pa.int32()),
            pa.array(cols["layer"], type=pa.int16()),
            fixed_list_array(experts.astype(np.int16), self.schema.field("experts").type),
        ]
        if m.has_weights:
            arrays.append(fixed_list_array(weights, self.schema.field("weights").type))
        if m.has_router_logits:
            arrays.append(fixed_list_array(floats["router_logits"], self.schema.field("router_logits").type))
        for pred in m.predictors.values():
            arrays.append(fixed_list_array(floats[pred.column], self.schema.field(pred.column).type))
        table = pa.Table.from_arrays(arrays, schema=self.schema)
        with deferred_signals():  # the rows are buffered and checksummed, or neither
            self._buffer.append(table)
            self._hash(cols, phases, experts, weights, floats)
            self._buffered += n
        if self._buffered >= self.row_group_size:
            self._flush()

    def _hash(self, cols, phases, experts, weights, floats) -> None:
        """Feed the rows to the checksum as the reader will return them (its dtypes, null rows as NaN)."""
        h = self._main.hasher
        h.update("seq_id", cols["seq_id"].astype(np.int32))
        h.update("phase", np.ascontiguousarray(phases, dtype=np.int8))
        h.update("pos", cols["pos"].astype(np.int32))
        h.update("layer", cols["layer"].astype(np.int16))
        h.update("experts", experts.astype(np.int16))
        if weights is not None:
            h.update("weights", weights)
        if "router_logits" in floats:
            h.update("router_logits", floats["router_logits"])
        for pred in self.meta.predictors.values():
            h.update(pred.column, nan_null_rows(floats[pred.column]))

    def write_hidden(self, *, seq_id, pos, layer, hidden: np.ndarray) -> None:
        """Append hidden states (n, dim) for (seq_id, pos, layer) keys to the sidecar file."""
        if self._hidden is None:
            raise ValueError(f"{self.path}: open the writer with hidden_dim= to store hidden states")
        hidden = np.asarray(hidden, dtype=np.float16)
        n, dim = hidden.shape
        if dim != self.meta.hidden_states.dim:
            raise ValueError(f"{self.path}: hidden states have dim {dim}, expected {self.meta.hidden_states.dim}")
        if not np.isfinite(hidden).all():
            bad = int(np.flatnonzero(~np.isfinite(hidden).all(axis=1))[0])
            raise ValueError(f"{self.path}: hidden state row {self._hidden_rows + bad} is not finite (float16 overflow?)")
        keys = {"seq_id": np.broadcast_to(np.asarray(seq_id), (n,)).astype(np.int32),
                "pos": np.broadcast_to(np.asarray(pos), (n,)).astype(np.int32),
                "layer": np.broadcast_to(np.asarray(layer), (n,)).astype(np.int16)}
        table = pa.Table.from_arrays([
            pa.array(keys["seq_id"]), pa.array(keys["pos"]), pa.array(keys["layer"]),
            fixed_list_array(hidden, self._hidden_schema.field("hidden").type),
        ], schema=self._hidden_schema)
        with deferred_signals():  # written and checksummed, or neither
            self._hidden.write(table)
            for name, values in keys.items():
                self._hidden.hasher.update(name, values)
            self._hidden.hasher.update("hidden", hidden)
            self._hidden_rows += n

    def _flush(self, final: bool = False) -> None:
        """Write whole row groups; the remainder waits for more rows unless ``final``."""
        if not self._buffer:
            return
        table = pa.concat_tables(self._buffer)
        size = self.row_group_size
        whole = table.num_rows if final else (table.num_rows // size) * size
        for start in range(0, whole, size):
            with deferred_signals():  # a row group is written and counted, or neither
                part = table.slice(start, min(size, whole - start))
                self._main.write(part)
                self._rows += part.num_rows
                rest = table.slice(start + part.num_rows)
                self._buffer, self._buffered = ([rest] if rest.num_rows else []), rest.num_rows

    # ---- finishing ---------------------------------------------------------------------------
    def close(self) -> Path:
        """Finish a complete trace and return its final path."""
        return self._finish(complete=True, reason="")

    def abort(self, reason: str) -> Path:
        """Finish the rows written so far as a partial trace; returns the ``.partial`` path."""
        return self._finish(complete=False, reason=reason)

    def _finish(self, complete: bool, reason: str) -> Path:
        if self._closed:
            return self.path if complete else partial_path(self.path)
        self._closed = True
        files = [f for f in (self._hidden, self._main) if f is not None]  # the sidecar lands first
        try:
            self._flush(final=True)
            self.meta.num_rows = self._rows
            self.meta.status = STATUS_COMPLETE if complete else STATUS_PARTIAL
            self.meta.partial_reason = reason
            meta_json = self.meta.to_json()
            for f in files:
                path = f.finish(meta_json, complete)
        except BaseException:
            for f in files:  # nothing half-written stays, and no sidecar without its trace
                f.discard()
            raise
        return path

    def discard(self) -> None:
        """Stop without keeping anything (no partial trace)."""
        self._closed = True
        for f in (self._hidden, self._main):
            if f is not None:
                f.discard()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.abort(f"{exc_type.__name__}: {exc}")
        except Exception:  # cannot even keep a partial trace (full disk): the first error is the one to report
            pass
