"""Which tokens go to which expert, with which weight: one layer's routing grouped by expert.

Input: ``ids`` (T x k, rank order) and ``weights`` (T x k) of the layer's tokens. Every (token, rank)
pair has a *flat position* ``t * k + rank``; each expert gets the flat positions routed to it (ascending,
so its tokens are in token order). The layer's output is combined in a (T * k, H) buffer written at
those positions and summed over ranks in rank order, so the result does not depend on which device
computed which expert or in what order: out[t] = sum_r weights[t, r] * expert_{ids[t, r]}(x[t]).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LayerRouting:
    num_tokens: int
    top_k: int
    experts: np.ndarray  # activated experts, ascending id
    ptr: np.ndarray  # (len(experts) + 1,) segment bounds into ``positions``
    positions: np.ndarray  # flat positions grouped by expert
    weights: np.ndarray  # float32 gate weight of each flat position (aligned with ``positions``)

    @classmethod
    def group(cls, ids: np.ndarray, weights: np.ndarray | None) -> "LayerRouting":
        ids = np.asarray(ids)
        T, k = ids.shape
        if weights is None:
            weights = np.full((T, k), 1.0 / k, np.float32)
        weights = np.asarray(weights, np.float32)
        if weights.shape != ids.shape:
            raise ValueError(f"routing weights {weights.shape} do not match expert ids {ids.shape}")
        flat = ids.reshape(-1).astype(np.int64)
        order = np.argsort(flat, kind="stable")
        sorted_ids = flat[order]
        new = np.empty(len(flat), bool)
        new[:1] = True
        np.not_equal(sorted_ids[1:], sorted_ids[:-1], out=new[1:])
        starts = np.flatnonzero(new)
        ptr = np.append(starts, len(flat))
        return cls(T, k, sorted_ids[starts], ptr, order, weights.reshape(-1)[order])

    def counts(self) -> np.ndarray:
        """Tokens per activated expert, aligned with ``experts``."""
        return np.diff(self.ptr)

    def matches(self, experts: np.ndarray, counts: np.ndarray) -> bool:
        """Are these exactly the activated experts with these workloads (any order)?"""
        order = np.argsort(experts)
        return np.array_equal(np.asarray(experts)[order], self.experts) and \
            np.array_equal(np.asarray(counts)[order], self.counts())

    def segment(self, expert: int) -> slice:
        i = int(np.searchsorted(self.experts, expert))
        if i >= len(self.experts) or self.experts[i] != expert:
            raise AssertionError(f"expert {expert} has no tokens in this layer's routing")
        return slice(int(self.ptr[i]), int(self.ptr[i + 1]))


class DeviceRouting:
    """``LayerRouting`` as index and weight tensors on one device, sliced per expert."""

    def __init__(self, r: LayerRouting, device: torch.device, dtype: torch.dtype):
        pos = torch.from_numpy(r.positions)
        self._index = torch.stack([pos, pos // r.top_k]).to(device, non_blocking=True)  # flat positions, tokens
        self._weights = torch.from_numpy(r.weights).to(device=device, dtype=dtype, non_blocking=True).unsqueeze(1)
        bounds = r.ptr.tolist()
        self._bounds = dict(zip(r.experts.tolist(), zip(bounds[:-1], bounds[1:])))

    def of(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(flat positions, token indices, weights (n x 1)) of ``expert``."""
        try:
            a, b = self._bounds[expert]
        except KeyError:
            raise AssertionError(f"expert {expert} has no tokens in this layer's routing") from None
        return self._index[0, a:b], self._index[1, a:b], self._weights[a:b]
