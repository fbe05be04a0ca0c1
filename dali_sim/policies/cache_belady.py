"""Belady's replacement (a BOUND): evict the entry used farthest in the future.

One request at a time, evicting the entry whose next use is farthest and bypassing an incoming one
used later still minimises misses. Here a step activates several experts of a layer at once and all
of them are protected while it runs (the shared cache semantics), so equal next uses are common: two
experts both needed at the next step cannot both hit with one slot, and the one used again soonest
after that is the one worth keeping. Candidates are therefore compared by their next ``depth`` uses,
lexicographically (the farthest first use, then the farthest second use, ...). The next-use times come
from ``dali trace enrich`` (``SetupContext.future``, given to bounds only), computed from the
workload's steps, so they are exact for the batch size they were computed for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dali_sim.policies.base import CACHES, CachePolicy, LayerView, PolicyConfig, SetupContext, registered


@dataclass(frozen=True)
class BeladyConfig(PolicyConfig):
    depth: int = field(default=8, metadata={"help": "future uses compared per candidate (1 = classic Belady, "
                                                    "ties by lower id)"})

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"cache.depth must be >= 1, got {self.depth}")


@registered(CACHES)
class Belady(CachePolicy[BeladyConfig]):
    name = "belady"
    description = ("BOUND: evict the evictable entry used farthest in the future (ties by the following uses), "
                   "and bypass an incoming expert used later than all of them (reads next-use times)")
    Config = BeladyConfig
    is_bound = True
    needs_future = True

    def setup(self, ctx: SetupContext) -> None:
        if ctx.future is None:
            raise ValueError("cache 'belady' needs next-use times (`dali trace enrich`), which the runtime gives "
                             "to bounds only")
        self.future = ctx.future

    def victim(self, layer: int, expert: int, view: LayerView, evictable: np.ndarray) -> int | None:
        depth = self.config.depth
        uses = self.future.next_uses(layer, evictable, view.step, depth)
        # np.lexsort's last key is the primary one: first use, then second use, ...; identical futures
        # put the lower id last, so it is the one evicted
        far = int(np.lexsort((-np.asarray(evictable), *uses.T[::-1]))[-1])
        incoming = self.future.next_uses(layer, np.array([expert]), view.step, depth)[0]
        if tuple(incoming) >= tuple(uses[far]):
            return None  # bypass: the incoming expert is worth no more than any candidate
        return int(evictable[far])
