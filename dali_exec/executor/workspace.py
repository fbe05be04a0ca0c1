"""Preallocated arrays the runtime's compiled per-layer loops write into, instead of making new ones.

After a layer's tensor work the host's caches are cold, and every array a compiled loop allocates and
returns costs an allocation, a Python object and its release (a few microseconds each there; a replay's
layer made about twenty). The loops of :mod:`.kernels` that a layer visit runs (``route_partition``:
grouping, checking and splitting the routing; ``group_index_into``: a group's indices) write these
buffers and return counts; the runtime takes views of them. Their contents live until the same loop runs
again: everything read from them is used within the layer visit (what outlives it, the timeline's
records, is copied into lists), and on CUDA the index arrays are copied into new pinned memory before
their transfer, as before.

On the CPU device the group buffers are also wrapped as tensors once (``torch.from_numpy``), so a group's
index tensors are ``narrow`` views of them, not new tensors per group.
"""

from __future__ import annotations

import numpy as np
import torch

from dali_exec.executor import kernels as _kernels


class RouteWorkspace:
    """The buffers of ``kernels._route_partition`` (rows ``kernels.W_*``), grown when a layer has more pairs.
    ``device``: the accelerator; on the CPU device ``tensors`` wrap the sorted pairs, their tokens and their
    weights (a column) once, for the layer's routing on the accelerator (``OffloadRuntime._droute``), and
    then the staged pairs' positions, tokens and weights in staging order (``turn_views``). ``pairs``: the
    (token, rank) pairs of a typical layer visit; the staged pairs' views of every length up to them are made
    with the tensors, not at their first use within a layer visit (the staged pairs vary from visit to visit:
    a new length cost 3-5 us per visit on average on the development VM, benchmarks/README.md). ``experts``: the
    model's experts per layer; every row is longer than that, so the route call's scratch row
    (``kernels.W_SCRATCH``) holds a slot per expert id and the call allocates nothing."""

    __slots__ = ("wi", "wf", "tensors", "_wrap", "_views", "_turn_views", "_cached", "_eager", "_experts")

    def __init__(self, device: torch.device = torch.device("cpu"), pairs: int = 0, experts: int = 0):
        self._wrap = device.type == "cpu"
        self._eager = pairs
        self._experts = experts
        self.wi = np.zeros((_kernels.W_ROWS, 0), np.int64)
        self.wf = np.zeros((2, 0), np.float32)
        self.tensors = None
        self._views: dict[int, tuple] = {}
        self._turn_views: dict[int, tuple] = {}
        self._cached: dict[tuple, tuple] = {}  # layer_views by their lengths
        self.fit(pairs, 0)

    def fit(self, pairs: int, evicted: int) -> "RouteWorkspace":
        """Room for ``pairs`` (token, rank) pairs and ``evicted`` evictions (twice the need when it grows), and the
        scratch row's slot per expert id."""
        need = max(pairs + 1, evicted, self._experts + 1)
        if need > self.wi.shape[1]:
            cap = 2 * need
            self.wi = np.zeros((_kernels.W_ROWS, cap), np.int64)
            self.wf = np.zeros((2, cap), np.float32)
            if self._wrap:
                wi, t, col = self.wi, _kernels.W_TURNS, torch.from_numpy(self.wf).view(2, -1, 1)
                self.tensors = (torch.from_numpy(wi[_kernels.W_ORDER]), torch.from_numpy(wi[_kernels.W_TOKENS]), col[0],
                                torch.from_numpy(wi[t + 2]), torch.from_numpy(wi[t + 3]), col[1])
            self._views.clear()
            self._turn_views.clear()
            self._cached.clear()
            if self._wrap:
                for q in range(min(self._eager, cap) + 1):
                    self.turn_views(q)
        return self

    def layer_views(self, m: int, n: int, c: int, g: int, cols: int) -> tuple:
        """What the route call wrote for ``m`` experts, ``n`` pairs, ``c`` CPU and ``g`` accelerator experts, as
        views of the buffers: the grouped routing (experts, ptr, pairs per expert, order, sorted weights) and the
        lane split (CPU experts, the lane's five rows (``cols`` columns), its order); made once per lengths and
        kept until the buffers grow (the runtime writes the lane's slot rows into them)."""
        key = (m, n, c, g, cols)
        v = self._cached.get(key)
        if v is None:
            wi, K = self.wi, _kernels
            v = self._cached[key] = (wi[K.W_EXPERTS, :m], wi[K.W_PTR, :m + 1], wi[K.W_PER, :m], wi[K.W_ORDER, :n],
                                     self.wf[0, :n], wi[K.W_CPU, :c], wi[K.W_LANE:K.W_LANE + 5, :cols],
                                     wi[K.W_LANE_ORDER, :g])
        return v

    def views(self, n: int) -> tuple:
        """``tensors``' first ``n`` rows (sorted pairs, their tokens, their weights), made once per ``n`` (a
        replay's layers have one number of pairs) and kept until the buffers grow."""
        v = self._views.get(n)
        if v is None:
            v = self._views[n] = tuple(t.narrow(0, 0, n) for t in self.tensors[:3])
        return v

    def turn_views(self, q: int) -> tuple:
        """The CPU device's tensors of the first ``q`` staged pairs in staging order (flat positions, tokens,
        weights as a column), made once per ``q`` and kept until the buffers grow."""
        v = self._turn_views.get(q)
        if v is None:
            v = self._turn_views[q] = tuple(t.narrow(0, 0, q) for t in self.tensors[3:])
        return v

    def turn_arrays(self, q: int) -> tuple:
        """The same as arrays (for a copy to another device)."""
        t = _kernels.W_TURNS
        return self.wi[t + 2, :q], self.wi[t + 3, :q], self.wf[1, :q]


class GroupWorkspace:
    """The buffers of ``kernels._group_index_into`` for the accelerator lane's groups: pairs, their tokens
    and rows within the span (``ints``), their gate weights (``w``), the group's sorted rows, experts and
    counts (``small``), the tokens per table row of the span (``table_counts``) and their offsets (``offs``,
    int32). ``rows``: the slot table's rows (a group's span and experts are at most that many). The int64
    buffers are the rows of one array ``gi`` (``ints`` 0-2, ``small`` 3-5, ``table_counts`` 6), so the route
    call can write a layer's first group with three arguments (``kernels._route_partition``)."""

    __slots__ = ("rows", "gi", "ints", "w", "small", "table_counts", "offs", "tensors", "_wrap", "_views",
                 "_offs_views", "_eager")

    def __init__(self, rows: int, device: torch.device, pairs: int = 0):
        """``pairs``: the (token, rank) pairs of a typical layer visit (batch x top-k; 0: none known). The buffers
        have room for them and, on the CPU device, the views of every group length up to them and of every span
        are made now, not at their first use within a layer visit, where each set cost 20-60 us on the
        development VM (benchmarks/README.md, "Views made at set-up"); longer groups' views are made when first
        used."""
        self.rows = rows
        self.offs = np.zeros(rows, np.int32)
        self.tensors = None
        self._wrap = device.type == "cpu"
        self._views: dict[int, tuple] = {}  # pairs -> the pair tensors' views
        self._offs_views: dict[int, torch.Tensor] = {}  # span -> the offsets' view
        self._eager = pairs
        self._alloc(0)
        self.fit(pairs)

    def _alloc(self, cap: int) -> None:
        """Buffers for ``cap`` pairs (and at least the slot table's rows); on the CPU device their tensors."""
        self.gi = np.zeros((7, max(cap, self.rows)), np.int64)
        self.ints, self.small, self.table_counts = self.gi[0:3], self.gi[3:6], self.gi[6]
        self.w = np.zeros(self.gi.shape[1], np.float32)
        self._views.clear()
        self._offs_views.clear()
        if self._wrap:  # (pairs, tokens, pair rows), weights as a column, offsets
            ints = torch.from_numpy(self.ints)
            self.tensors = (ints[0], ints[1], ints[2], torch.from_numpy(self.w).view(-1, 1), torch.from_numpy(self.offs))
            if self._eager:  # (the views a visit of that many pairs can ask for, made now)
                for n in range(min(self._eager, self.ints.shape[1]) + 1):
                    self.views(n, 0)
                for span in range(self.rows + 1):
                    self.views(0, span)

    def fit(self, pairs: int) -> "GroupWorkspace":
        """Room for a group of ``pairs`` pairs (twice the need when it grows; the tensors re-made then)."""
        if pairs > self.ints.shape[1]:
            self._alloc(2 * pairs)
        return self

    def views(self, n: int, span: int) -> tuple:
        """On the CPU device, a group of ``n`` pairs over a span of ``span`` rows: ``tensors``' views (pairs,
        tokens, pair rows, weights: the first ``n``; offsets: the first ``span``), each made once per length
        and kept until the buffers grow (the tensor objects are reused; their contents are the last build's)."""
        v = self._views.get(n)
        if v is None:
            v = self._views[n] = tuple(t.narrow(0, 0, n) for t in self.tensors[:4])
        o = self._offs_views.get(span)
        if o is None:
            o = self._offs_views[span] = self.tensors[4].narrow(0, 0, span)
        return (*v, o)

    def build(self, kernel, routing, seg: np.ndarray, rows: np.ndarray, layer: int, state: np.ndarray) -> tuple:
        """The group of the experts ``seg`` (indices into ``routing.experts``) in table ``rows``, checked
        against a slot table's ``state`` (``SlotPool.state``; (3, 0): none, as the host store's rows) in the same
        loop by ``kernel`` (the compiled ``kernels._group_index_into``): (pairs, lo, span, ready)."""
        if len(routing.positions) > self.ints.shape[1]:
            self.fit(len(routing.positions))
        return kernel(routing.ptr, routing.positions, routing.weights, routing.experts, seg, rows, routing.top_k,
                      layer, state, self.ints, self.w, self.small, self.table_counts, self.offs)


__all__ = ["GroupWorkspace", "RouteWorkspace"]
