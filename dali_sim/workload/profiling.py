"""The profiling input: where frequency-based choices get their frequencies, kept apart from what is evaluated.

A system that profiles (``memory.cache_init = frequency``: the ``static`` cache's popular sets, KTransformers'
GPU experts, Fiddler's popular set, HybriMoE's warm cache) must not see the data it is evaluated on. Its
frequencies come from a profiling input distinct from the evaluated sequences (docs/simulator.md,
"Profiling input"):

* a separate trace of the same model (``ProfileSpec(trace=T)``, ``--profile-trace T``): the whole trace is
  evaluated;
* by default a deterministic split of the trace's sequences: the first ``share`` of them in ``seq_id``
  order (``ceil(share x N)``, at least one) profile, the rest are evaluated (``--profile-share``, default
  0.25). The split applies to every system of a run or comparison, whether it profiles or not, so all of
  them are evaluated on identical inputs;
* ``share = 0`` without a profile trace: no split; frequencies are then the evaluated trace's own (hindsight,
  recorded as such).

``memory.cache_init = frequency-hindsight`` always uses the evaluated sequences' own frequencies, by name.
This is a selection step before the :class:`~dali_sim.workload.builder.Workload` is built.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dali_sim.trace.provenance import file_sha256
from dali_sim.trace.reader import Trace, read_trace

DEFAULT_PROFILE_SHARE = 0.25
SPLIT, PROFILE_TRACE, HINDSIGHT = "split", "trace", "hindsight"


@dataclass(frozen=True)
class ProfileSpec:
    """The profiling input of a run. ``share`` None = the default: 0.25 of the sequences, or 0 when a
    profile ``trace`` (path or :class:`Trace`) is given; a share above 0 together with a trace is an error."""

    share: float | None = None
    trace: str | Path | Trace | None = None

    def __post_init__(self) -> None:
        s = self.share
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 <= float(s) < 1.0):
            raise ValueError(f"profile share must be a number in [0, 1), got {s!r}")
        if self.trace is not None and s:
            raise ValueError("give a profile trace or a profile share above 0, not both (the profile trace is the "
                             "profiling input; the evaluated trace is then not split)")

    @property
    def resolved_share(self) -> float:
        if self.share is not None:
            return float(self.share)
        return 0.0 if self.trace is not None else DEFAULT_PROFILE_SHARE


@dataclass(frozen=True)
class ProfiledTrace:
    """The evaluated sequences and the frequencies that frequency-based choices use."""

    evaluated: Trace
    frequencies: np.ndarray  # (L, E) total workload per expert in the profiling input
    record: dict[str, Any]  # what the manifest and the run's config record (source, share, sequences)

    @property
    def hindsight(self) -> bool:
        """Whether the frequencies are the evaluated sequences' own (no profiling input)."""
        return self.record["source"] == HINDSIGHT

    def description(self) -> str:
        return describe_profiling(self.record)

    def restricted(self, evaluated: Trace, num_layers: int) -> "ProfiledTrace":
        """The same profiling input for a reduced evaluated trace (the executor's first layers, sequences or
        tokens): the frequencies of its first ``num_layers`` MoE layers; the record notes the reduction."""
        record = dict(self.record, evaluated_sequences=seq_id_summary(evaluated.seq_id))
        freq = trace_frequencies(evaluated) if self.hindsight else self.frequencies[:num_layers]
        return ProfiledTrace(evaluated, freq, record)


def describe_profiling(record: dict[str, Any]) -> str:
    """One line from a profiling record: where frequency choices look and what is evaluated."""
    ev = record["evaluated_sequences"]["count"]
    if record["source"] == SPLIT:
        p = record["profile_sequences"]["count"]
        return f"profiling: the first {p} of {p + ev} sequences (share {record['share']:g}); {ev} evaluated"
    if record["source"] == PROFILE_TRACE:
        return (f"profiling: trace {record['trace']} ({record['profile_sequences']['count']} sequences); all {ev} "
                "sequences evaluated")
    return f"profiling: none (share 0): frequency choices see the {ev} evaluated sequences (hindsight)"


def profile_count(num_sequences: int, share: float) -> int:
    """Sequences the split profiles: ``ceil(share x N)``, at least one when ``share > 0``; 0 for share 0."""
    if share <= 0:
        return 0
    return max(1, math.ceil(share * num_sequences - 1e-9))


def total_sequences(evaluated: int, share: float = DEFAULT_PROFILE_SHARE) -> int:
    """The fewest sequences a trace needs so that the split leaves ``evaluated`` of them evaluated
    (for sizing synthetic traces: ``evaluated`` = batch size x batches)."""
    n = evaluated
    while n - profile_count(n, share) < evaluated:
        n += 1
    return n


def trace_frequencies(trace: Trace) -> np.ndarray:
    """(L, E) number of tokens routed to each expert of each MoE layer over the whole trace (the same
    totals as ``Workload.frequencies()``, which does not depend on the batching)."""
    L, E = len(trace.layers), trace.num_experts
    key = np.repeat(trace.layer_index.astype(np.int64), trace.top_k) * E + trace.experts.reshape(-1).astype(np.int64)
    return np.bincount(key, minlength=L * E).reshape(L, E).astype(np.int64)


def seq_id_summary(seq_ids: np.ndarray) -> dict[str, Any]:
    """Count, first and last id and SHA-256 of the sorted distinct sequence ids (how a record names a set)."""
    ids = np.unique(np.asarray(seq_ids, dtype=np.int64))
    return {"count": int(ids.size), "first": int(ids[0]) if ids.size else None,
            "last": int(ids[-1]) if ids.size else None,
            "sha256": hashlib.sha256(ids.astype("<i8").tobytes()).hexdigest()}


def select_sequences(trace: Trace, seq_ids: np.ndarray) -> Trace:
    """The rows of the sequences ``seq_ids`` (a view of the same file: ``path`` kept, checksum record dropped;
    lookahead columns read packed, ``read_trace(needs=...)``, stay packed for the kept rows)."""
    keep = np.isin(trace.seq_id, np.asarray(seq_ids))
    kept = set(np.asarray(seq_ids).tolist())
    meta = dataclasses.replace(trace.meta, num_rows=int(keep.sum()),
                               sequences=[s for s in trace.meta.sequences if s.seq_id in kept])
    return trace.rows(keep, meta)


def _check_same_shape(profile: Trace, trace: Trace, where: str) -> None:
    have = (tuple(profile.layers), profile.num_experts, profile.top_k)
    want = (tuple(trace.layers), trace.num_experts, trace.top_k)
    if have != want:
        raise ValueError(f"profile trace {where}: MoE layers {list(have[0])}, {have[1]} experts, top-{have[2]}; the "
                         f"evaluated trace has MoE layers {list(want[0])}, {want[1]} experts, top-{want[2]}: profile "
                         "with a trace of the same model")


def apply_profile(trace: Trace, spec: ProfileSpec | None = None) -> ProfiledTrace:
    """Split ``trace`` (or pair it with a profile trace) as ``spec`` says; see the module docstring."""
    spec = spec or ProfileSpec()
    share = spec.resolved_share
    where = trace.path or "the trace"
    if len(trace) == 0:
        raise ValueError(f"{where}: the trace has no rows; nothing to simulate")
    if spec.trace is not None:
        prof = spec.trace if isinstance(spec.trace, Trace) else read_trace(spec.trace)
        path = prof.path or "<memory>"
        _check_same_shape(prof, trace, str(path))
        record = {"source": PROFILE_TRACE, "share": 0.0, "trace": str(path),
                  "trace_sha256": file_sha256(prof.path) if prof.path else None,
                  "profile_sequences": seq_id_summary(prof.seq_id), "evaluated_sequences": seq_id_summary(trace.seq_id)}
        return ProfiledTrace(trace, trace_frequencies(prof), record)
    ids = np.unique(trace.seq_id)
    if share == 0:
        record = {"source": HINDSIGHT, "share": 0.0, "profile_sequences": seq_id_summary(ids[:0]),
                  "evaluated_sequences": seq_id_summary(ids)}
        return ProfiledTrace(trace, trace_frequencies(trace), record)
    p = profile_count(ids.size, share)
    if ids.size - p < 1:
        raise ValueError(f"{where}: {ids.size} sequence(s) cannot be split into profiling and evaluated sequences "
                         f"(profile share {share:g}); give a separate --profile-trace, or --profile-share 0 to let "
                         "frequency choices see the evaluated data (hindsight)")
    profile, evaluated = select_sequences(trace, ids[:p]), select_sequences(trace, ids[p:])
    record = {"source": SPLIT, "share": share, "profile_sequences": seq_id_summary(ids[:p]),
              "evaluated_sequences": seq_id_summary(ids[p:])}
    return ProfiledTrace(evaluated, trace_frequencies(profile), record)


def check_batch_size(batch_size: int, sequences: int, where: str = "the trace") -> None:
    """A batch larger than the sequences to run would silently run smaller: refuse it, naming both numbers."""
    if batch_size > sequences:
        raise ValueError(f"batch size {batch_size} exceeds the {sequences} sequence(s) evaluated from {where}: "
                         f"use --batch-size {sequences} or less, or a trace with more sequences")


__all__ = ["DEFAULT_PROFILE_SHARE", "HINDSIGHT", "PROFILE_TRACE", "SPLIT", "ProfileSpec", "ProfiledTrace",
           "apply_profile", "check_batch_size", "describe_profiling", "profile_count", "select_sequences",
           "seq_id_summary", "total_sequences", "trace_frequencies"]
