"""Checks on trace rows, shared by the writer (per chunk) and the reader (whole file).

Every check finds the *first* offending row (lowest file row index) and raises a :class:`TraceError`
naming the file, the row and its (seq_id, pos, layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dali_sim.trace.schema import PHASES, TraceError, TraceMeta


@dataclass
class RowArrays:
    """Column arrays of a block of rows; ``offset`` is the file row index of the first one."""

    seq_id: np.ndarray
    phase: np.ndarray  # codes: 0 prefill, 1 decode
    pos: np.ndarray
    layer: np.ndarray
    experts: np.ndarray  # (n, top_k)
    weights: np.ndarray | None = None  # (n, top_k)
    float_columns: dict[str, np.ndarray] | None = None  # extra (n, E) float columns, NaN rows = null
    offset: int = 0

    def describe(self, i: int) -> str:
        return (
            f"row {self.offset + i} (seq_id={int(self.seq_id[i])}, phase={PHASES[int(self.phase[i])]}, "
            f"pos={int(self.pos[i])}, layer={int(self.layer[i])})"
        )


def _first(mask: np.ndarray) -> int | None:
    idx = np.flatnonzero(mask)
    return int(idx[0]) if idx.size else None


def check_rows(rows: RowArrays, meta: TraceMeta, where: str) -> None:
    """Row-local checks: ranges, duplicate ids in a row, finite weights."""
    n = len(rows.seq_id)
    k, e = meta.top_k, meta.num_experts
    if rows.experts.shape != (n, k):
        raise TraceError(f"{where}: experts must have shape (rows, top_k={k}), got {rows.experts.shape}")
    problems: list[tuple[int, str]] = []

    def add(mask: np.ndarray, text: str) -> None:
        i = _first(mask)
        if i is not None:
            problems.append((i, text))

    add(rows.seq_id < 0, "seq_id is negative")
    add(rows.pos < 0, "pos is negative")
    add((rows.phase < 0) | (rows.phase >= len(PHASES)), "phase is not prefill or decode")
    add(~np.isin(rows.layer, np.asarray(meta.layers)), f"layer is not an MoE layer of {meta.model.name} {list(meta.layers)}")
    bad_ids = (rows.experts < 0) | (rows.experts >= e)
    add(bad_ids.any(axis=1), f"expert id out of range 0..{e - 1}")
    if k > 1:
        s = np.sort(rows.experts, axis=1)
        add((s[:, 1:] == s[:, :-1]).any(axis=1), "duplicate expert id within the row")
    if rows.weights is not None:
        if rows.weights.shape != (n, k):
            raise TraceError(f"{where}: weights must have shape (rows, top_k={k}), got {rows.weights.shape}")
        add(~np.isfinite(rows.weights).all(axis=1), "gate weight is not finite")
        add((rows.weights < 0).any(axis=1), "gate weight is negative")
    for name, values in (rows.float_columns or {}).items():
        # a null row is all-NaN; a present row must be entirely finite
        present = ~np.isnan(values).all(axis=1)
        add(present & ~np.isfinite(values).all(axis=1), f"column {name!r} has a non-finite value")
    if problems:
        i, text = min(problems)
        raise TraceError(f"{where}: {rows.describe(i)}: {text}: experts={rows.experts[i].tolist()}"
                         + (f" weights={np.round(rows.weights[i], 4).tolist()}" if rows.weights is not None else ""))


def check_structure(rows: RowArrays, meta: TraceMeta, where: str, order: np.ndarray | None | str = "sort") -> None:
    """Whole-trace checks: each (seq_id, pos) has every MoE layer exactly once, one phase per token,
    and within a sequence every prefill position comes before every decode position.

    ``order``: the permutation that sorts the rows by (seq_id, pos, layer) if the caller has it
    (:attr:`Trace.row_order`; None = already sorted); by default it is computed here."""
    n = len(rows.seq_id)
    if n == 0:
        return
    layers = np.asarray(meta.layers)
    if isinstance(order, str):
        order = np.lexsort((rows.layer, rows.pos, rows.seq_id))  # MoE layers sort like their ordinals
    if order is None:
        s, p, ph = rows.seq_id, rows.pos, rows.phase
        lo = np.searchsorted(layers, rows.layer).astype(np.int16)
    else:
        s, p, ph = rows.seq_id[order], rows.pos[order], rows.phase[order]
        lo = np.searchsorted(layers, rows.layer[order]).astype(np.int16)

    def at(j: int) -> int:
        """File row index of sorted row ``j``."""
        return int(j) if order is None else int(order[j])

    same_token = (s[1:] == s[:-1]) & (p[1:] == p[:-1])
    dup = same_token & (lo[1:] == lo[:-1])
    if dup.any():
        j = int(np.flatnonzero(dup)[0])
        first, second = sorted((at(j), at(j + 1)))
        raise TraceError(f"{where}: {rows.describe(second)}: duplicate of row {rows.offset + first}")

    # token boundaries in sorted order
    starts = np.flatnonzero(np.concatenate(([True], ~same_token)))
    counts = np.diff(np.append(starts, n))
    bad_tokens = np.flatnonzero(counts != len(layers))
    if bad_tokens.size:
        # report the incomplete token whose earliest row comes first in the file
        first_rows = starts if order is None else np.minimum.reduceat(order, starts)
        t = bad_tokens[np.argmin(first_rows[bad_tokens])]
        a, b = starts[t], starts[t] + counts[t]
        present = layers[lo[a:b]]
        missing = sorted(set(layers.tolist()) - set(present.tolist()))
        raise TraceError(
            f"{where}: {rows.describe(int(first_rows[t]))}: token has {counts[t]} of {len(layers)} MoE layers; "
            f"missing layers {missing}"
        )
    mixed = same_token & (ph[1:] != ph[:-1])
    if mixed.any():
        j = int(np.flatnonzero(mixed)[0])
        raise TraceError(f"{where}: {rows.describe(at(j + 1))}: phase differs between layers of one token")

    # prefill before decode within each sequence (sorted by seq, pos: a prefill after a decode is wrong)
    same_seq = s[1:] == s[:-1]
    wrong = same_seq & (ph[:-1] == 1) & (ph[1:] == 0)
    if wrong.any():
        j = int(np.flatnonzero(wrong)[0])
        raise TraceError(
            f"{where}: {rows.describe(at(j + 1))}: prefill position after decode position {int(p[j])} "
            "of the same sequence"
        )
