"""Belady's replacement (an ORACLE HEURISTIC, not a bound): evict the entry used farthest in the future.

One request at a time, evicting the entry whose next use is farthest and bypassing an incoming one
used later still minimises misses. Here a step activates several experts of a layer at once and all
of them are protected while it runs (the shared cache semantics), so equal next uses are common: two
experts both needed at the next step cannot both hit with one slot, and the one used again soonest
after that is the one worth keeping. Candidates are therefore compared by their next ``depth`` uses,
lexicographically (the farthest first use, then the farthest second use, ...). The next-use times come
from ``dali trace enrich`` (``SetupContext.future``, given to policies that read the future only),
computed from the workload's steps, so they are exact for the batch size they were computed for.

Under these semantics Belady is *not* optimal: a free slot always admits (even an expert never used
again) and a step's misses are decided one at a time. Steps ``[0,2] [2,1] [1,2]`` with one slot: belady
1 hit, the optimum 2 (tests/test_cache_optimal.py). The exact optimum is the ``optimal`` cache.
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
    description = ("ORACLE HEURISTIC (reads next-use times; not a bound: `optimal` can get more hits): evict the "
                   "evictable entry used farthest in the future (ties by the following uses), and bypass an incoming "
                   "expert used later than all of them")
    Config = BeladyConfig
    reads_future = True
    needs_future = True

    def setup(self, ctx: SetupContext) -> None:
        self.future = self.next_use_times(ctx)

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
