"""Per-layer counts of what the plans did: the timing-free metrics (docs/metrics.md)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from dali_sim.runtime.controller import CPU, FETCH, PREFETCHED, LayerPlan

COUNTERS = (
    "activated",  # (step, layer, expert) triples with workload > 0
    "hits",  # ... whose weights were in the layer's cache when the layer started
    "gpu_experts",  # ... run on the GPU
    "cpu_experts",  # ... run on the CPU
    "on_demand",  # GPU experts whose weights were copied after routing (blocking transfers)
    "prefetch_used",  # GPU experts whose weights came from a prefetch
    "prefetch_issued",  # prefetch transfers started
    "prefetch_wasted",  # prefetched experts never used at their target layer
    "admitted",  # fetched experts that entered the cache
    "evicted",
    "staged",  # on-demand copies used from a staging buffer (declined or no evictable entry)
    "swaps",  # cache-initiated transfers (policy rebalancing)
    "gpu_tokens",  # expert-token pairs computed on the GPU
    "cpu_tokens",  # ... on the CPU
)


class PlanCounters:
    """Accumulates :data:`COUNTERS` per MoE layer from a stream of :class:`LayerPlan`."""

    def __init__(self, num_layers: int):
        self.c = {name: np.zeros(num_layers, dtype=np.int64) for name in COUNTERS}

    def add(self, p: LayerPlan) -> None:
        c, l, nz = self.c, p.layer, np.count_nonzero
        n = len(p.experts)
        by_source = np.bincount(p.source, minlength=4)
        gpu = n - int(by_source[CPU])
        c["activated"][l] += n
        c["hits"][l] += nz(p.hit)
        c["gpu_experts"][l] += gpu
        c["cpu_experts"][l] += n - gpu
        c["on_demand"][l] += by_source[FETCH]
        c["prefetch_used"][l] += by_source[PREFETCHED]
        c["prefetch_issued"][l] += len(p.prefetches)
        c["prefetch_wasted"][l] += len(p.prefetch_wasted)
        c["admitted"][l] += nz(p.admitted)
        c["evicted"][l] += len(p.evicted)
        c["staged"][l] += nz(p.staged)
        c["swaps"][l] += len(p.swaps)
        total = int(p.counts.sum())
        gpu_tokens = total if gpu == n else (int(p.counts[p.on_gpu].sum()) if gpu else 0)
        c["gpu_tokens"][l] += gpu_tokens
        c["cpu_tokens"][l] += total - gpu_tokens

    def frame(self, layers: tuple[int, ...]) -> pd.DataFrame:
        df = pd.DataFrame(self.c, index=pd.Index(layers, name="layer"))
        return df

    def totals(self) -> dict[str, int]:
        return {k: int(v.sum()) for k, v in self.c.items()}


def ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else float("nan")


def derived(t: dict[str, int], expert_bytes: int) -> dict[str, float]:
    """Rates from counter totals (definitions in docs/metrics.md)."""
    transfers = t["on_demand"] + t["prefetch_issued"] + t["swaps"]
    return {
        "hit_rate": ratio(t["hits"], t["activated"]),
        "gpu_fraction": ratio(t["gpu_experts"], t["activated"]),
        "prefetch_precision": ratio(t["prefetch_used"], t["prefetch_issued"]),
        "prefetch_recall": ratio(t["prefetch_used"], t["prefetch_used"] + t["on_demand"]),
        "transfers": transfers,
        "bytes_h2d": transfers * expert_bytes,
    }
