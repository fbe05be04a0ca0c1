"""Prefetch policies: none, and the oracle (an oracle heuristic: it reads the true routing)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dali_sim.policies.base import PREFETCHERS, LayerView, PolicyConfig, PrefetchPolicy, registered


@registered(PREFETCHERS)
class NoPrefetch(PrefetchPolicy):
    name = "none"
    description = "no prefetching: experts move only on demand"

    def prefetch(self, view: LayerView) -> list[tuple[int, int]]:
        return []


@dataclass(frozen=True)
class OracleConfig(PolicyConfig):
    k: int = field(default=0, metadata={
        "help": "prefetch the k experts of the next layer with the largest true workload; 0 = all activated"})
    worth_only: bool = field(default=False, metadata={
        "help": "only experts whose true workload makes the GPU after the copy faster than the CPU "
                "(the worth-prefetch rule, with overlap 0.5); the oracle-heuristic preset sets it"})


@registered(PREFETCHERS)
class OraclePrefetch(PrefetchPolicy[OracleConfig]):
    name = "oracle"
    description = ("ORACLE HEURISTIC (reads the true routing; not a bound: a perfect prediction copied at the wrong "
                   "time still costs time): prefetch the next layer's truly activated experts, largest workload first")
    Config = OracleConfig
    reads_future = True

    def prefetch(self, view: LayerView) -> list[tuple[int, int]]:
        target = view.layer + 1
        if target >= view.num_layers:
            return []
        counts = view.true_counts(target)
        order = np.lexsort((np.arange(view.num_experts), -counts))  # largest workload, then lower id
        wanted = order[counts[order] > 0]
        if self.config.k > 0:
            wanted = wanted[: self.config.k]
        if self.config.worth_only:
            from dali_sim.policies.prefetch_gated import worth_copying  # noqa: PLC0415 (module order)

            wanted = [e for e in wanted if worth_copying(view.costs, int(counts[e]), 0.5)]
        return [(target, int(e)) for e in wanted]
