"""Placements of competing systems (sources and readings in docs/policies.md).

* ``resident-gpu`` (KTransformers, SOSP 2025): routed experts run on the CPU, attention and shared
  experts on the GPU (the dense device), and optionally the N most frequent experts stay resident on
  the GPU: an activated expert runs on the GPU iff its weights are there (resident, or prefetched),
  else on the CPU. Never fetches. Use with the ``static`` cache and ``memory.cache_init=frequency``.
* ``fiddler`` (Fiddler, Kamahori et al., ICLR 2025): a static popular set stays resident; per
  activated expert: resident -> GPU; else GPU iff ``cpu_time(n) > gpu_time(n) + transfer`` (the
  copy is not overlapped with compute; equal times stay on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dali_sim.policies.base import PLACEMENTS, LayerView, PlacementPolicy, PolicyConfig, registered


@registered(PLACEMENTS)
class ResidentGpu(PlacementPolicy):
    name = "resident-gpu"
    description = ("KTransformers: an activated expert runs on the GPU iff its weights are there (resident or "
                   "prefetched), else on the CPU; never fetches")
    may_fetch = False

    def place(self, view: LayerView) -> np.ndarray:
        return np.asarray(view.resident[view.experts] | view.pending[view.experts], dtype=bool)


@dataclass(frozen=True)
class FiddlerConfig(PolicyConfig):
    pending_resident: bool = field(default=True, metadata={
        "help": "a prefetched expert (in flight or landed) counts as on the GPU (no copy needed)"})


def fiddler_rule(counts, on_gpu_already, costs) -> np.ndarray:
    """Fiddler's per-expert choice: GPU iff the weights are there, or ``t_cpu(n) > t_gpu(n) + transfer``."""
    xfer = float(costs.expert_transfer_time())
    out = np.asarray(on_gpu_already, dtype=bool).copy()
    for i, n in enumerate(np.asarray(counts).tolist()):
        if not out[i]:
            out[i] = costs.expert_time("cpu", int(n)) > costs.expert_time("gpu", int(n)) + xfer
    return out


@registered(PLACEMENTS)
class Fiddler(PlacementPolicy[FiddlerConfig]):
    name = "fiddler"
    description = ("Fiddler: resident experts on the GPU; a missing one is copied to the GPU iff its CPU time exceeds "
                   "transfer + GPU time at its workload, else it runs on the CPU")
    Config = FiddlerConfig

    def place(self, view: LayerView) -> np.ndarray:
        there = view.resident[view.experts]
        if self.config.pending_resident:
            there = there | view.pending[view.experts]
        return fiddler_rule(view.counts, there, view.costs)
