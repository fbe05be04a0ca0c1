"""Baseline prefetch policy: none."""

from __future__ import annotations

from dali_sim.policies.base import PREFETCHERS, LayerView, PrefetchPolicy, registered


@registered(PREFETCHERS)
class NoPrefetch(PrefetchPolicy):
    name = "none"
    description = "no prefetching: experts move only on demand"

    def prefetch(self, view: LayerView) -> list[tuple[int, int]]:
        return []
