"""Which tokens go to which expert, with which weight: one layer's routing grouped by expert.

Input: ``ids`` (T x k, rank order) and ``weights`` (T x k) of the layer's tokens. Every (token, rank)
pair has a *flat position* ``t * k + rank``; each expert gets the flat positions routed to it (ascending,
so its tokens are in token order). The layer's output is combined in a (T * k, H) buffer written at
those positions and summed over ranks in rank order, so the result does not depend on which device
computed which expert or in what order: out[t] = sum_r weights[t, r] * expert_{ids[t, r]}(x[t]).

Two options serve drivers that run a real model (``dali_exec.generate``): ``counted`` marks the tokens
that are part of the workload (the others, e.g. padding, ride along with the experts the plan runs
anyway, so each expert multiplies exactly the rows the model itself would), and ``order`` gives the
order of the flat positions within each expert (the model's own sort, so the rows of an expert's
matrix product come in the model's order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dali_exec.executor import kernels as _kernels

_NO_ORDER = np.zeros(0, np.int64)
FLOAT32 = np.dtype(np.float32)  # (checked by identity: no conversion per call)
_NO_COUNTED = np.zeros(0, bool)


@dataclass
class LayerRouting:
    num_tokens: int
    top_k: int
    experts: np.ndarray  # activated experts, ascending id
    ptr: np.ndarray  # (len(experts) + 1,) segment bounds into ``positions``
    positions: np.ndarray  # flat positions grouped by expert
    weights: np.ndarray  # float32 gate weight of each flat position (aligned with ``positions``)
    counted: np.ndarray | None = None  # bool per flat position (aligned): part of the workload; None = all
    _counted_per_expert: np.ndarray | None = field(default=None, repr=False, compare=False)

    @classmethod
    def group(cls, ids: np.ndarray, weights: np.ndarray | None, *, counted: np.ndarray | None = None,
              order: np.ndarray | None = None) -> "LayerRouting":
        """``counted``: (T,) bool, the tokens that count in the workload (default: all). ``order``: a
        permutation of the flat positions that sorts them by expert id (default: the stable sort, i.e.
        token order within each expert)."""
        ids, weights = cls.checked(ids, weights)
        T, k = ids.shape
        if counted is not None:
            counted = np.asarray(counted, bool)
            if counted.shape != (T,):
                raise ValueError(f"counted must be a ({T},) bool mask, got shape {counted.shape}")
        kernel = _kernels.compiled("group_routing")
        if kernel is not None:  # one compiled loop (on the ids' own integer type); the same result as the NumPy code
            flat = ids.reshape(-1)
            status, order, ptr, experts, w, c, per = kernel(
                flat, _NO_ORDER if order is None else np.asarray(order, np.int64), weights.reshape(-1),
                _NO_COUNTED if counted is None else counted, k)
            if status == _kernels.NOT_PERMUTATION:
                raise ValueError(f"order must be a permutation of the {len(flat)} flat positions")
            if status == _kernels.NOT_SORTED:
                raise ValueError("order must sort the flat positions by expert id")
            if status == _kernels.NEGATIVE:
                raise ValueError("expert ids must be >= 0")
            return cls(T, k, experts, ptr, order, w, None if counted is None else c, per)
        return cls._group_numpy(T, k, ids.reshape(-1).astype(np.int64), weights, counted, order)

    @staticmethod
    def checked(ids: np.ndarray, weights: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(T, k) expert ids and float32 gate weights (default 1 / k), checked to match. (``OffloadRuntime._route``
        makes the same tests inline and calls this only where they fail: keep the two in step.)"""
        ids = np.asarray(ids)
        T, k = ids.shape
        if weights is None:
            weights = np.full((T, k), 1.0 / k, np.float32)
        elif type(weights) is not np.ndarray or weights.dtype is not FLOAT32:  # (identity: no dtype conversion per call)
            weights = np.asarray(weights, np.float32)
        if weights.shape != ids.shape:
            raise ValueError(f"routing weights {weights.shape} do not match expert ids {ids.shape}")
        return ids, weights

    @classmethod
    def _group_numpy(cls, T: int, k: int, flat: np.ndarray, weights: np.ndarray, counted: np.ndarray | None,
                     order: np.ndarray | None) -> "LayerRouting":
        """:meth:`group` in NumPy operations (without numba, and the reference of the compiled kernel)."""
        if len(flat) and flat.min() < 0:
            raise ValueError("expert ids must be >= 0")
        if order is None:
            order = np.argsort(flat, kind="stable")
        else:
            order = np.asarray(order, np.int64)
            if order.shape != flat.shape or (len(flat) and (order.min() < 0 or order.max() >= len(flat)
                                                            or np.bincount(order).max() > 1)):
                raise ValueError(f"order must be a permutation of the {len(flat)} flat positions")
        sorted_ids = flat[order]
        if np.any(sorted_ids[1:] < sorted_ids[:-1]):
            raise ValueError("order must sort the flat positions by expert id")
        new = np.empty(len(flat), bool)
        new[:1] = True
        np.not_equal(sorted_ids[1:], sorted_ids[:-1], out=new[1:])
        starts = np.flatnonzero(new)
        ptr = np.append(starts, len(flat))
        if counted is not None:
            counted = np.repeat(counted, k)[order]
        return cls(T, k, sorted_ids[starts], ptr, order, weights.reshape(-1)[order], counted)

    def counts(self) -> np.ndarray:
        """Tokens per expert, aligned with ``experts`` (counted tokens only: 0 for an expert that only
        uncounted tokens use)."""
        c = self._counted_per_expert
        if c is None:
            if self.counted is None:
                c = np.diff(self.ptr)
            elif not len(self.experts):
                c = np.zeros(0, np.int64)
            else:
                c = np.add.reduceat(self.counted.astype(np.int64), self.ptr[:-1])
            self._counted_per_expert = c
        return c

    def matches(self, experts: np.ndarray, counts: np.ndarray) -> bool:
        """Are these exactly the activated experts (those with counted tokens) with these workloads (any order)?"""
        experts, counts = np.asarray(experts, np.int64), np.asarray(counts, np.int64)
        own = self.counts()
        kernel = _kernels.compiled("matches")
        if kernel is not None:
            return kernel(self.experts, own, experts, counts)
        width = 1 + max(int(experts.max(initial=-1)), int(self.experts.max(initial=-1)))
        want, have = np.zeros(width, np.int64), np.zeros(width, np.int64)
        want[experts] = counts
        have[self.experts] = own
        return bool((counts > 0).all()) and np.array_equal(want, have)

    def segment(self, expert: int) -> slice:
        i = int(np.searchsorted(self.experts, expert))
        if i >= len(self.experts) or self.experts[i] != expert:
            raise AssertionError(f"expert {expert} has no tokens in this layer's routing")
        return slice(int(self.ptr[i]), int(self.ptr[i + 1]))
