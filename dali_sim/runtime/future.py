"""Next-use times for policies that read the future (``belady``, ``optimal``): when is each expert
of a layer used next?

They depend on the batching (a batch-mate's later use counts) and on which sequences are evaluated
(the profiling split, ``dali_sim.workload.profiling``), so they are computed from the workload's step
stream, once per (trace, batch size, prefill chunk, profile share), by ``dali trace enrich``, and
stored in a sidecar Parquet file that the simulator loads (:func:`load_future`). The file names the
trace's SHA-256, the workload config and the evaluated sequences it was computed for; a stale or
mismatched file is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dali_sim import __version__
from dali_sim.files import atomic_output, check_input, check_output
from dali_sim.trace.checksum import CHECKSUM_KEY, checksum_record, digest, read_record, verify_columns
from dali_sim.trace.provenance import file_sha256
from dali_sim.trace.reader import Trace
from dali_sim.workload.builder import Workload, WorkloadConfig
from dali_sim.workload.profiling import (DEFAULT_PROFILE_SHARE, ProfileSpec, apply_profile, check_batch_size,
                                         seq_id_summary)

NEVER = np.iinfo(np.int64).max
FUTURE_KEY = b"dali.future"
FUTURE_FORMAT = 2  # 2: the evaluated sequences (profile split) in the header
COLUMNS = ("layer", "expert", "step", "next_step")


class FutureDemand:
    """Every activation as (layer, expert, step), sorted, with lookup of the next use after a step."""

    def __init__(self, layer: np.ndarray, expert: np.ndarray, step: np.ndarray, num_layers: int, num_experts: int):
        key = np.asarray(layer, np.int64) * num_experts + np.asarray(expert, np.int64)
        order = np.lexsort((step, key))  # by (layer, expert), then step
        self._steps = np.asarray(step, np.int64)[order]
        self._key = key[order]
        self._start = np.searchsorted(self._key, np.arange(num_layers * num_experts + 1))
        self.num_layers, self.num_experts = num_layers, num_experts

    @classmethod
    def from_workload(cls, workload: Workload) -> "FutureDemand":
        L, E = workload.num_layers, workload.num_experts
        seg = np.repeat(np.arange(workload.num_steps * L), np.diff(workload.actual.ptr))
        step, layer = np.divmod(seg, L)
        return cls(layer, workload.actual.expert, step, L, E)

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def num_steps(self) -> int:
        """One past the last step with an activation."""
        return int(self._steps.max()) + 1 if len(self._steps) else 0

    def layer_uses(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(experts, steps) of every activation at ``layer``, sorted by expert, then step."""
        lo, hi = self._start[layer * self.num_experts], self._start[(layer + 1) * self.num_experts]
        return self._key[lo:hi] - layer * self.num_experts, self._steps[lo:hi]

    def next_use(self, layer: int, experts: np.ndarray, step: int) -> np.ndarray:
        """For each expert, the first step after ``step`` at which it is activated at ``layer``
        (``NEVER`` if none)."""
        return self.next_uses(layer, experts, step, 1)[:, 0]

    def next_uses(self, layer: int, experts: np.ndarray, step: int, depth: int) -> np.ndarray:
        """(n, depth): for each expert its first ``depth`` steps of use after ``step`` at ``layer``,
        ``NEVER`` where there are fewer."""
        out = np.full((len(experts), depth), NEVER, dtype=np.int64)
        for i, e in enumerate(np.asarray(experts).tolist()):
            k = layer * self.num_experts + e
            lo, hi = self._start[k], self._start[k + 1]
            j = lo + np.searchsorted(self._steps[lo:hi], step, side="right")
            uses = self._steps[j:min(hi, j + depth)]
            out[i, :len(uses)] = uses
        return out

    def table(self) -> pa.Table:
        """One row per activation, sorted by (layer, expert, step), with its next use (-1: never)."""
        nxt = np.full(len(self._steps), -1, dtype=np.int64)
        same = self._key[1:] == self._key[:-1]
        nxt[:-1][same] = self._steps[1:][same]
        return pa.table({"layer": (self._key // self.num_experts).astype(np.int16),
                         "expert": (self._key % self.num_experts).astype(np.int16),
                         "step": self._steps.astype(np.int32), "next_step": nxt.astype(np.int32)})


def future_path(trace_path: str | Path, config: WorkloadConfig, share: float = DEFAULT_PROFILE_SHARE) -> Path:
    """Where ``dali trace enrich`` puts the next-use file of a trace for one workload config and profile
    share (``-p<share>`` in the name; none for share 0, every sequence evaluated)."""
    p = Path(trace_path)
    chunk = f"-c{config.prefill_chunk}" if config.prefill_chunk else ""
    split = f"-p{share:g}" if share else ""
    return p.with_name(f"{p.name.removesuffix('.parquet')}.future-b{config.batch_size}{chunk}{split}.parquet")


def enrich_command(trace_path: str | Path | None, config: WorkloadConfig, share: float = DEFAULT_PROFILE_SHARE) -> str:
    chunk = f" --prefill-chunk {config.prefill_chunk}" if config.prefill_chunk else ""
    split = f" --profile-share {share:g}" if share != DEFAULT_PROFILE_SHARE else ""
    return f"dali trace enrich {trace_path or 'TRACE'} --batch-size {config.batch_size}{chunk}{split}"


def write_future(trace: Trace, config: WorkloadConfig, out: str | Path | None = None,
                 command: str | None = None, share: float = DEFAULT_PROFILE_SHARE) -> Path:
    """Compute the next-use times of ``trace``'s evaluated sequences (the profile split with ``share``)
    under ``config`` and write them (atomically, with page checksums and a SHA-256 of the header and of
    every column)."""
    if trace.path is None:
        raise ValueError("next-use times are stored beside a trace file: write the trace to disk first")
    out = Path(out) if out is not None else future_path(trace.path, config, share)
    hidden = trace.path.with_name(trace.meta.hidden_states.file) if trace.meta.hidden_states else None
    check_output(out, (trace.path, hidden), "next-use file")
    evaluated = apply_profile(trace, ProfileSpec(share=share)).evaluated
    check_batch_size(config.batch_size, evaluated.num_sequences, str(trace.path))
    w = Workload(evaluated, config)
    future = FutureDemand.from_workload(w)
    meta = {"format": FUTURE_FORMAT, "trace": str(trace.path), "trace_sha256": file_sha256(trace.path),
            "batch_size": config.batch_size, "prefill_chunk": config.prefill_chunk, "profile_share": share,
            "evaluated_sequences": seq_id_summary(evaluated.seq_id), "num_steps": w.num_steps,
            "num_layers": w.num_layers, "num_experts": w.num_experts, "activations": len(future),
            "dali_version": __version__, "command": command or "(python API)"}
    table = future.table()
    header = json.dumps(meta).encode()
    record = checksum_record(header, {c: digest(table.column(c).to_numpy()) for c in COLUMNS})
    table = table.replace_schema_metadata({FUTURE_KEY: header, CHECKSUM_KEY: record})
    with atomic_output(out) as tmp:
        pq.write_table(table, tmp, compression="zstd", write_page_checksum=True)
    return out


def load_future(trace: Trace, config: WorkloadConfig, path: str | Path | None = None,
                *, needed_by: str = "a bound", share: float = DEFAULT_PROFILE_SHARE) -> FutureDemand:
    """The next-use times of ``trace`` (the evaluated sequences of a run whose profile split used ``share``)
    under ``config``; refuses a missing, stale or mismatched file."""
    command = enrich_command(trace.path, config, share)
    if path is None:
        if trace.path is None:
            raise ValueError(f"{needed_by} needs next-use times, which are stored beside a trace file: write the "
                             f"trace to disk and run `{enrich_command(None, config, share)}`")
        path = future_path(trace.path, config, share)
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{needed_by} needs next-use times for batch size {config.batch_size}, prefill chunk "
                         f"{config.prefill_chunk} and profile share {share:g}: {path} is missing; run `{command}`")
    check_input(path, "next-use file")
    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True)
        footer = pf.schema_arrow.metadata or {}
        record = read_record(footer, footer[FUTURE_KEY], str(path))
        meta = json.loads(footer[FUTURE_KEY])
        table = pf.read()
        if not isinstance(meta, dict) or table.column_names != list(COLUMNS):
            raise ValueError(f"columns {table.column_names}, expected {list(COLUMNS)}")
        cols = {c: table.column(c).to_numpy() for c in COLUMNS}
    except (OSError, KeyError, ValueError, pa.ArrowException) as exc:
        raise ValueError(f"{path}: not a next-use file written by `dali trace enrich` ({exc})") from None
    if record is not None:
        verify_columns(record, cols, str(path))
    want = {"batch_size": config.batch_size, "prefill_chunk": config.prefill_chunk}
    got = {k: meta.get(k) for k in want}
    if got != want:
        raise ValueError(f"{path}: computed for {got}, but this run uses {want}; run `{command}`")
    if trace.path is not None and meta.get("trace_sha256") != file_sha256(trace.path):
        raise ValueError(f"{path}: computed for a different version of {trace.path} (SHA-256 differs); "
                         f"run `{command}` again")
    evaluated = (meta.get("evaluated_sequences") or {}).get("sha256")
    if evaluated != seq_id_summary(trace.seq_id)["sha256"]:
        raise ValueError(f"{path}: computed for other evaluated sequences (profile share "
                         f"{meta.get('profile_share', 'unknown')}) than this run's {trace.num_sequences} (share "
                         f"{share:g}); run `{command}`")
    L, E = trace.model.num_moe_layers, trace.model.num_experts
    if (meta.get("num_layers"), meta.get("num_experts")) != (L, E) or table.num_rows != meta.get("activations"):
        raise ValueError(f"{path}: shape {meta.get('num_layers')} layers x {meta.get('num_experts')} experts, "
                         f"{table.num_rows} rows does not match the trace ({L} x {E}) or its own header")
    return FutureDemand(cols["layer"], cols["expert"], cols["step"], L, E)
