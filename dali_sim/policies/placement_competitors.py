"""Placements of competing systems (sources and readings in docs/policies.md).

* ``resident-gpu`` (KTransformers, SOSP 2025): routed experts run on the CPU, attention and shared
  experts on the GPU (the dense device), and optionally a static set of experts stays resident on the
  GPU (kt-kernel + SGLang: ``--kt-num-gpu-experts`` per layer and ``--kt-expert-placement-strategy``,
  ``kvcache-ai/sglang`` ``python/sglang/srt/layers/moe/kt_utils.py``): an activated expert runs on the GPU
  iff its weights are there (resident, or prefetched), else on the CPU. Never fetches. Use with the
  ``static`` cache; ``memory.cache_init=frequency`` picks each layer's most frequent experts.
* ``fiddler`` (Fiddler, Kamahori et al., ICLR 2025; ``efeslab/fiddler`` ``src/fiddler/mixtral.py``,
  ``FiddlerMixtral.mixtral_forward``): a static popular set stays resident; per activated expert: resident
  -> GPU; else GPU iff ``gpu_time(n) + transfer <= cpu_time(n)``. The code scores every CPU/GPU split of
  the layer's experts by the *sum* of per-expert costs (``n * latency_cpu`` on the CPU, ``latency_gpu``
  for a missing expert on the GPU, 0 for a resident one) and keeps the first minimum, which decides each
  expert on its own and sends ties to the GPU; the copy is not overlapped with that expert's compute.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from dali_sim.policies import kernels
from dali_sim.policies.base import (
    PLACEMENTS,
    LayerView,
    PlacementPolicy,
    PlacementRule,
    PolicyConfig,
    SetupContext,
    registered,
)


@registered(PLACEMENTS)
class ResidentGpu(PlacementPolicy):
    name = "resident-gpu"
    description = ("KTransformers: an activated expert runs on the GPU iff its weights are there (resident or "
                   "prefetched), else on the CPU; never fetches")
    may_fetch = False

    def place(self, view: LayerView) -> np.ndarray:
        return np.asarray(view.resident[view.experts] | view.pending[view.experts], dtype=bool)

    def rule_form(self, ctx: SetupContext) -> PlacementRule:
        return PlacementRule.constant(ctx.num_layers, False, resident=True, pending=True)


@dataclass(frozen=True)
class FiddlerConfig(PolicyConfig):
    pending_resident: bool = field(default=True, metadata={
        "help": "a prefetched expert (in flight or landed) counts as on the GPU (no copy needed)"})


def fiddler_rule(counts, on_gpu_already, costs) -> np.ndarray:
    """Fiddler's per-expert choice: GPU iff the weights are there, or ``t_gpu(n) + transfer <= t_cpu(n)``
    (ties to the GPU, as the code's first minimum over the splits)."""
    n = np.asarray(counts).astype(np.int64)
    gpu = np.asarray(costs.expert_time("gpu", n), dtype=float).reshape(n.shape)
    cpu = np.asarray(costs.expert_time("cpu", n), dtype=float).reshape(n.shape)
    return np.asarray(on_gpu_already, dtype=bool) | (gpu + float(costs.expert_transfer_time()) <= cpu)


def _fiddler_place(experts, counts, resident, pending, pending_resident, lut_gpu, lut_cpu, xfer):
    """:func:`fiddler_rule` on a layer's experts in one loop (compiled by numba), from the cost model's tables:
    ``(True, mask)``, or ``(False, empty)`` when a count lies beyond the tables."""
    n = experts.shape[0]
    top = min(lut_gpu.shape[0], lut_cpu.shape[0])
    out = np.zeros(n, np.bool_)
    for j in range(n):
        c = counts[j]
        if c < 0 or c >= top:
            return False, np.zeros(0, np.bool_)
        e = experts[j]
        out[j] = resident[e] or (pending_resident and pending[e]) or lut_gpu[c] + xfer <= lut_cpu[c]
    return True, out


_COMPILED: list = []


def _compiled_fiddler():
    """The compiled :func:`_fiddler_place` (None without numba)."""
    if not _COMPILED:
        _COMPILED.append(kernels.jit(_fiddler_place))
    return _COMPILED[0]


@registered(PLACEMENTS)
class Fiddler(PlacementPolicy[FiddlerConfig]):
    name = "fiddler"
    description = ("Fiddler: resident experts on the GPU; a missing one is copied to the GPU iff transfer + GPU time "
                   "at its workload is no more than its CPU time, else it runs on the CPU")
    Config = FiddlerConfig

    def place(self, view: LayerView) -> np.ndarray:
        kernel = _compiled_fiddler()
        tables = kernels.cost_tables(self, view.costs) if kernel is not None else None
        if tables is not None:  # the same rule in one compiled call
            ok, out = kernel(view.experts, view.counts, view.resident, view.pending, self.config.pending_resident,
                             *tables)
            if ok:
                return out
        there = view.resident[view.experts]
        if self.config.pending_resident:
            there = there | view.pending[view.experts]
        return fiddler_rule(view.counts, there, view.costs)

    def rule_form(self, ctx: SetupContext) -> PlacementRule | None:
        """The rule by workload from the cost model's tables (:func:`_fiddler_place`'s comparison); a workload
        beyond them is left to :meth:`place`."""
        tables = kernels.cost_tables(self, ctx.costs)
        if tables is None:
            return None
        lut_gpu, lut_cpu, xfer = tables
        top = min(lut_gpu.shape[0], lut_cpu.shape[0])
        by_count = np.append((lut_gpu[:top] + xfer <= lut_cpu[:top]).astype(np.int8), np.int8(-1))
        rule = PlacementRule.constant(ctx.num_layers, False, resident=True, pending=self.config.pending_resident)
        return dataclasses.replace(rule, by_count=by_count)
