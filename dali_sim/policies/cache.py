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


class _Stamps:
    """Use stamps: a clock ticking at every touch, each layer's (E,) last ticks, and the keyed form's rows.
    The clock lives in a (1,) array so that the controller's compiled path can advance it in place."""

    def _setup_stamps(self, ctx: SetupContext) -> None:
        self._clock = np.zeros(1, np.int64)
        # initial contents count as touched before everything else, in id order
        self.stamp = np.full((ctx.num_layers, ctx.num_experts), -1, dtype=np.int64)
        self._no_key = np.zeros(ctx.num_experts, np.int64)  # the primary key of a policy ordering by age alone

    @property
    def clock(self) -> int:
        return int(self._clock[0])

    def _touch(self, layer: int, expert: int) -> None:
        self._clock[0] += 1
        self.stamp[layer, expert] = self._clock[0]

    def touched(self, layer: int, experts: np.ndarray, admitted: np.ndarray, view: LayerView) -> None:
        n = len(experts)
        c = int(self._clock[0])
        self.stamp[layer, experts] = np.arange(c + 1, c + n + 1)
        self._clock[0] = c + n


@registered(CACHES)
class LRU(_Stamps, CachePolicy):
    name = "lru"
    description = "least recently used: evict the evictable entry touched longest ago; always admit"

    def setup(self, ctx: SetupContext) -> None:
        self._setup_stamps(ctx)

    def on_hit(self, layer: int, expert: int, view: LayerView) -> None:
        self._touch(layer, expert)

    def on_admit(self, layer: int, expert: int, view: LayerView) -> None:
        self._touch(layer, expert)

    def victim(self, layer: int, expert: int, view: LayerView, evictable: np.ndarray) -> int | None:
        return _oldest(self.stamp[layer], evictable)

    # batch forms: stamps of evictable entries do not change during a visit (they are not activated)
    def victim_order(self, layer: int, view: LayerView, evictable: np.ndarray) -> np.ndarray:
        return _by_age(self.stamp[layer], evictable)

    touched = _Stamps.touched  # (named in the class: its batch hooks are its own)
    keyed_per_layer = True

    def keyed_form(self, layer: int, view: LayerView):
        return True, True, self._no_key, self.stamp[layer], self._clock


@dataclass(frozen=True)
class LFUConfig(PolicyConfig):
    count: str = field(default="tokens", metadata={
        "help": "what a use adds to an expert's frequency: 'tokens' (its workload) or 'activations' (1)"})


@registered(CACHES)
class LFU(_Stamps, CachePolicy[LFUConfig]):
    name = "lfu"
    description = "least frequently used (frequencies since the start, counted at each layer visit); always admit"
    Config = LFUConfig

    def setup(self, ctx: SetupContext) -> None:
        if self.config.count not in ("tokens", "activations"):
            raise ValueError(f"cache.count must be 'tokens' or 'activations', got {self.config.count!r}")
        self.freq = np.zeros((ctx.num_layers, ctx.num_experts), dtype=np.int64)
        self._setup_stamps(ctx)

    def observe(self, view: LayerView) -> None:
        add = view.counts if self.config.count == "tokens" else 1
        self.freq[view.layer, view.experts] += add

    def on_hit(self, layer: int, expert: int, view: LayerView) -> None:
        self._touch(layer, expert)

    on_admit = on_hit

    def victim(self, layer: int, expert: int, view: LayerView, evictable: np.ndarray) -> int | None:
        return int(self.victim_order(layer, view, evictable)[0])

    def victim_order(self, layer: int, view: LayerView, evictable: np.ndarray) -> np.ndarray:
        # lowest frequency; ties: least recently used, then lower id (frequencies change in observe only)
        return evictable[np.lexsort((evictable, self.stamp[layer, evictable], self.freq[layer, evictable]))]

    touched = _Stamps.touched
    keyed_per_layer = True

    def keyed_form(self, layer: int, view: LayerView):
        return True, True, self.freq[layer], self.stamp[layer], self._clock


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

    def setup(self, ctx: SetupContext) -> None:
        self._no_key = np.zeros(ctx.num_experts, np.int64)

    keyed_per_layer = True

    def keyed_form(self, layer: int, view: LayerView):
        return False, False, self._no_key, self._no_key, None
