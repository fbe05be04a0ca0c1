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
    """Accumulates :data:`COUNTERS` per MoE layer from a stream of :class:`LayerPlan`.

    :meth:`add` runs once per (step, layer) in the simulator and the executor, so it keeps one tuple of
    Python ints per plan and adds them up in bulk; ``c`` (a dict of per-layer arrays, one per counter,
    that may be changed in place) takes them in when it is read."""

    _FLUSH = 4096  # plans kept as tuples before they are added up

    def __init__(self, num_layers: int):
        self._table = np.zeros((len(COUNTERS), num_layers), dtype=np.int64)
        self._c = {name: self._table[i] for i, name in enumerate(COUNTERS)}
        self._rows: list[tuple[int, ...]] = []

    @property
    def c(self) -> dict[str, np.ndarray]:
        self._flush()
        return self._c

    def _flush(self) -> None:
        if self._rows:
            rows = np.array(self._rows, dtype=np.int64)
            np.add.at(self._table.T, rows[:, 0], rows[:, 1:])
            self._rows.clear()

    def add(self, p: LayerPlan) -> None:
        if p.tally is not None:  # counted by the controller's compiled path, in this order
            self._rows.append(p.tally)
            if len(self._rows) >= self._FLUSH:
                self._flush()
            return
        source, nz = p.source, np.count_nonzero
        n = len(source)
        by_source = np.bincount(source, minlength=4).tolist()
        tokens = np.bincount(source, weights=p.counts, minlength=4).tolist()  # exact: integers below 2**53
        cpu, fetch, prefetched = by_source[CPU], by_source[FETCH], by_source[PREFETCHED]
        cpu_tokens = int(tokens[CPU])
        self._rows.append((
            p.layer, n, nz(p.hit), n - cpu, cpu, fetch, prefetched, len(p.prefetches), len(p.prefetch_wasted),
            nz(p.admitted) if fetch or prefetched else 0,  # only experts that came to the GPU are admitted
            len(p.evicted), nz(p.staged) if fetch else 0, len(p.swaps), int(sum(tokens)) - cpu_tokens, cpu_tokens))
        if len(self._rows) >= self._FLUSH:
            self._flush()

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
