"""The future demand stream, for bounds only (Belady): when is each expert of a layer used next?

Built from the workload's steps, so it is exact for any batching (batch-mates' later uses count).
"""

from __future__ import annotations

import numpy as np

from dali_sim.workload.builder import Workload

NEVER = np.iinfo(np.int64).max


class FutureDemand:
    def __init__(self, workload: Workload):
        L, E = workload.num_layers, workload.num_experts
        seg = np.repeat(np.arange(workload.num_steps * L), np.diff(workload.actual.ptr))
        step, layer = np.divmod(seg, L)
        key = layer * E + workload.actual.expert.astype(np.int64)
        order = np.lexsort((step, key))  # by (layer, expert), then step
        self._steps = step[order]
        self._start = np.searchsorted(key[order], np.arange(L * E + 1))
        self.num_experts = E

    def next_use(self, layer: int, experts: np.ndarray, step: int) -> np.ndarray:
        """For each expert, the first step after ``step`` at which it is activated at ``layer``
        (``NEVER`` if none)."""
        out = np.full(len(experts), NEVER, dtype=np.int64)
        for i, e in enumerate(np.asarray(experts).tolist()):
            k = layer * self.num_experts + e
            lo, hi = self._start[k], self._start[k + 1]
            j = lo + np.searchsorted(self._steps[lo:hi], step, side="right")
            if j < hi:
                out[i] = self._steps[j]
        return out
