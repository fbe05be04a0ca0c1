"""Baseline cache policies: LRU, LFU and a static resident set (semantics in docs/policies.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dali_sim.policies.base import CACHES, CachePolicy, LayerView, PolicyConfig, SetupContext, registered


def _oldest(stamp: np.ndarray, candidates: np.ndarray) -> int:
    """Candidate with the smallest stamp; ties: lower id (candidates are sorted)."""
    return int(candidates[np.argmin(stamp[candidates])])


def _by_age(stamp: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Candidates oldest first, ties by lower id (candidates are sorted): successive :func:`_oldest`."""
    return candidates[np.argsort(stamp[candidates], kind="stable")]


@registered(CACHES)
class LRU(CachePolicy):
    name = "lru"
    description = "least recently used: evict the evictable entry touched longest ago; always admit"

    def setup(self, ctx: SetupContext) -> None:
        self.clock = 0
        # initial contents count as touched before everything else, in id order
        self.stamp = np.full((ctx.num_layers, ctx.num_experts), -1, dtype=np.int64)

    def _touch(self, layer: int, expert: int) -> None:
        self.clock += 1
        self.stamp[layer, expert] = self.clock

    def on_hit(self, layer: int, expert: int, view: LayerView) -> None:
        self._touch(layer, expert)

    def on_admit(self, layer: int, expert: int, view: LayerView) -> None:
        self._touch(layer, expert)

    def victim(self, layer: int, expert: int, view: LayerView, evictable: np.ndarray) -> int | None:
        return _oldest(self.stamp[layer], evictable)

    # batch forms: stamps of evictable entries do not change during a visit (they are not activated)
    def victim_order(self, layer: int, view: LayerView, evictable: np.ndarray) -> np.ndarray:
        return _by_age(self.stamp[layer], evictable)

    def touched(self, layer: int, experts: np.ndarray, admitted: np.ndarray, view: LayerView) -> None:
        n = len(experts)
        self.stamp[layer, experts] = np.arange(self.clock + 1, self.clock + n + 1)
        self.clock += n


@dataclass(frozen=True)
class LFUConfig(PolicyConfig):
    count: str = field(default="tokens", metadata={
        "help": "what a use adds to an expert's frequency: 'tokens' (its workload) or 'activations' (1)"})


@registered(CACHES)
class LFU(CachePolicy[LFUConfig]):
    name = "lfu"
    description = "least frequently used (frequencies since the start, counted at each layer visit); always admit"
    Config = LFUConfig

    def setup(self, ctx: SetupContext) -> None:
        if self.config.count not in ("tokens", "activations"):
            raise ValueError(f"cache.count must be 'tokens' or 'activations', got {self.config.count!r}")
        self.freq = np.zeros((ctx.num_layers, ctx.num_experts), dtype=np.int64)
        self.clock = 0
        self.stamp = np.full((ctx.num_layers, ctx.num_experts), -1, dtype=np.int64)

    def observe(self, view: LayerView) -> None:
        add = view.counts if self.config.count == "tokens" else 1
        self.freq[view.layer, view.experts] += add

    def on_hit(self, layer: int, expert: int, view: LayerView) -> None:
        self.clock += 1
        self.stamp[layer, expert] = self.clock

    on_admit = on_hit

    def victim(self, layer: int, expert: int, view: LayerView, evictable: np.ndarray) -> int | None:
        return int(self.victim_order(layer, view, evictable)[0])

    def victim_order(self, layer: int, view: LayerView, evictable: np.ndarray) -> np.ndarray:
        # lowest frequency; ties: least recently used, then lower id (frequencies change in observe only)
        return evictable[np.lexsort((evictable, self.stamp[layer, evictable], self.freq[layer, evictable]))]

    def touched(self, layer: int, experts: np.ndarray, admitted: np.ndarray, view: LayerView) -> None:
        n = len(experts)
        self.stamp[layer, experts] = np.arange(self.clock + 1, self.clock + n + 1)
        self.clock += n


@registered(CACHES)
class Static(CachePolicy):
    name = "static"
    description = "a fixed resident set (memory.cache_init: frequency or random with the seed); never admits"

    def accepts(self, layer: int, expert: int, view: LayerView) -> bool:
        return False

    def victim(self, layer: int, expert: int, view: LayerView, evictable: np.ndarray) -> int | None:
        return None

    def victim_order(self, layer: int, view: LayerView, evictable: np.ndarray) -> np.ndarray:
        return evictable[:0]  # declines every fetched expert
