"""Grouped expert computation: many experts of one device in one call, from a table of flat weight rows.

A *table* is a 2-D tensor whose rows are flat expert vectors (:mod:`.ffn` or the model's own layout):
the accelerator's slot buffer (rows = slots) or one layer of the host store (rows = experts). A group
is a set of table rows with the token rows each one computes; its (pair) rows are sorted by table row,
and ``offs`` (one int32 per table row, cumulative) tells the grouped matrix product where each row's
tokens end (rows that compute nothing have none). One grouped product per projection replaces a
Python loop of products per expert: the host issues a handful of operations per group, whatever the
number of experts in it.

:class:`GroupIndex` builds a group's host-side indices from a layer's routing (vectorised, no loop per
expert); :func:`grouped_mm` is the product, ``torch.nn.functional.grouped_mm`` where torch has it for
the device and dtype, else one ``mm`` per non-empty row (counts known on the host: no device sync).
Each row's output depends only on its own tokens and weights (checked in tests/test_exec_grouped.py),
so grouping does not change what an expert computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dali_exec.executor import kernels as _kernels
from dali_exec.executor.routing import LayerRouting

_NONE = np.zeros(0, np.int64)
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
#: (device type, dtype) pairs for which torch's grouped product failed once: the loop is used from then on
_UNSUPPORTED: set[tuple[str, torch.dtype]] = set()


def _loop_mm(x: torch.Tensor, w: torch.Tensor, counts: np.ndarray) -> torch.Tensor:
    """``x[rows of g] @ w[g]`` for every table row g with tokens (``w``: (R, K, N))."""
    out = x.new_empty((x.shape[0], w.shape[2]))
    a = 0
    for g in np.flatnonzero(counts).tolist():
        b = a + int(counts[g])
        torch.mm(x[a:b], w[g], out=out[a:b])
        a = b
    return out


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, counts: np.ndarray) -> torch.Tensor:
    """(S, K) x grouped (R, K, N) -> (S, N): rows ``offs[g-1]:offs[g]`` of ``x`` times ``w[g]``.
    ``counts`` are the same boundaries on the host (tokens per table row). On the CPU torch's grouped
    product costs about as much per table row as per non-empty one, so sparse tables take the loop."""
    key = (x.device.type, w.dtype)
    if _GROUPED_MM is not None and key not in _UNSUPPORTED and x.shape[0]:
        if x.device.type == "cpu":
            use = len(counts) <= 4 * np.count_nonzero(counts) + 4
        else:
            use = w.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
        if use:
            try:
                return _GROUPED_MM(x.to(w.dtype), w, offs=offs)
            except (RuntimeError, NotImplementedError, TypeError):  # layout or dtype this torch does not take
                _UNSUPPORTED.add(key)
    return _loop_mm(x.to(w.dtype), w, counts)


@dataclass
class GroupIndex:
    """Host-side indices of one group: ``pairs`` (flat (token, rank) positions, sorted by table row, each
    row's in routing order) and their gate ``weights``, ``rows`` (table row per expert of the group, in
    the pairs' order), ``experts`` (aligned), ``counts`` (tokens per expert, aligned). The group reads the
    table rows ``lo .. lo + len(table_counts) - 1`` only (the span of its rows): ``table_counts`` are the
    tokens of each row of that span, ``offs`` their cumulative sum (int32)."""

    pairs: np.ndarray
    weights: np.ndarray
    rows: np.ndarray
    experts: np.ndarray
    counts: np.ndarray
    lo: int
    table_counts: np.ndarray
    offs: np.ndarray
    tokens: np.ndarray | None = None  # token row of each pair (pairs // top_k), if built with them
    pair_rows: np.ndarray | None = None  # row of each pair within the span, if built with them
    #: built against a slot table (``build(..., slots=...)``) by the compiled loop: whether every row holds
    #: its expert with no copy in flight; None: not checked (``SlotPool.check_rows`` is the caller's)
    rows_ready: bool | None = None

    @classmethod
    def build(cls, routing: LayerRouting, seg: np.ndarray, rows: np.ndarray, slots: tuple | None = None
              ) -> "GroupIndex":
        """``seg``: indices into ``routing.experts`` (the group's experts), ``rows``: their table rows.
        ``slots``: (layer, hold_layer, hold_expert, inflight) of a slot table whose rows these are, to check
        their readiness in the same loop (``rows_ready``)."""
        kernel = _kernels.compiled("group_index")
        if kernel is not None:  # one compiled loop: the same indices as below, and the token rows
            layer, hold_layer, hold_expert, inflight = slots if slots is not None else (-1, _NONE, _NONE, _NONE)
            pairs, w, rows_s, experts, counts, lo, table_counts, offs, tok, pair_rows, ready = kernel(
                routing.ptr, routing.positions, routing.weights, routing.experts.astype(np.int64, copy=False),
                np.asarray(seg, np.int64), np.asarray(rows, np.int64), routing.top_k, layer, hold_layer,
                hold_expert, inflight)
            return cls(pairs, w, rows_s, experts, counts, int(lo), table_counts, offs, tok, pair_rows,
                       bool(ready) if slots is not None else None)
        if len(seg) == 1:  # one expert (a staging turn): its segment of the routing as it is
            i, row = int(seg[0]), int(rows[0])
            a, b = int(routing.ptr[i]), int(routing.ptr[i + 1])
            n = np.array([b - a], np.int64)
            return cls(routing.positions[a:b], routing.weights[a:b], rows, routing.experts[i:i + 1], n, row, n,
                       n.astype(np.int32))
        order = np.argsort(rows, kind="stable")
        seg, rows = seg[order], rows[order]
        starts, ends = routing.ptr[seg], routing.ptr[seg + 1]
        counts = ends - starts
        # positions starts[i] .. ends[i] - 1 of every expert, concatenated (no loop per expert)
        first = np.cumsum(counts) - counts
        take = np.repeat(starts - first, counts) + np.arange(int(first[-1] + counts[-1]))
        lo = int(rows[0])
        table_counts = np.zeros(int(rows[-1]) - lo + 1, np.int64)
        table_counts[rows - lo] = counts
        return cls(routing.positions[take], routing.weights[take], rows, routing.experts[seg], counts, lo,
                   table_counts, np.cumsum(table_counts).astype(np.int32))

    @classmethod
    def whole(cls, routing: LayerRouting) -> "GroupIndex":
        """Every expert of the routing, on a table whose rows are the expert ids (a layer of the host store):
        the routing's own order is the table's. Its arrays are new (not the routing's, which may be a
        workspace's views: the timeline keeps a group's experts)."""
        rows = routing.experts.astype(np.int64)  # (a copy)
        lo = int(rows[0])
        counts = np.diff(routing.ptr)
        table_counts = np.zeros(int(rows[-1]) - lo + 1, np.int64)
        table_counts[rows - lo] = counts
        return cls(routing.positions, routing.weights, rows, rows, counts, lo, table_counts,
                   np.cumsum(table_counts).astype(np.int32))

    def token_rows(self, top_k: int) -> np.ndarray:
        """The token row of every pair."""
        return self.tokens if self.tokens is not None else self.pairs // top_k

    def __len__(self) -> int:
        return len(self.rows)

    def span(self, table: torch.Tensor) -> torch.Tensor:
        """The table rows this group reads."""
        return table[self.lo:self.lo + len(self.table_counts)]

    def row_of_pairs(self) -> np.ndarray:
        """The row of every pair within :meth:`span` (for per-row biases)."""
        return self.pair_rows if self.pair_rows is not None else np.repeat(self.rows - self.lo, self.counts)


__all__ = ["GroupIndex", "grouped_mm"]
