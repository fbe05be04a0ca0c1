"""Belady's optimal replacement (a BOUND): evict the entry used farthest in the future.

With the shared cache semantics (victims among entries not activated in the step, a declined expert
is staged), evicting the evictable entry whose next use is farthest, and declining (bypassing) an
incoming expert whose own next use is farther still, minimises misses for a given demand stream.
The next-use times come from ``dali trace enrich`` (``SetupContext.future``, given to bounds only),
computed from the workload's steps, so they are exact for the batch size they were computed for.
"""

from __future__ import annotations

import numpy as np

from dali_sim.policies.base import CACHES, CachePolicy, LayerView, SetupContext, registered


@registered(CACHES)
class Belady(CachePolicy):
    name = "belady"
    description = ("BOUND: evict the evictable entry used farthest in the future, and bypass an incoming expert "
                   "used later than all of them (reads the future demand stream)")
    is_bound = True
    needs_future = True

    def setup(self, ctx: SetupContext) -> None:
        if ctx.future is None:
            raise ValueError("cache 'belady' needs next-use times (`dali trace enrich`), which the runtime gives "
                             "to bounds only")
        self.future = ctx.future

    def victim(self, layer: int, expert: int, view: LayerView, evictable: np.ndarray) -> int | None:
        nxt = self.future.next_use(layer, evictable, view.step)
        far = int(np.max(nxt))
        incoming = int(self.future.next_use(layer, np.array([expert]), view.step)[0])
        if incoming >= far:
            return None  # bypass: the incoming expert is needed no sooner than any candidate
        return int(evictable[np.flatnonzero(nxt == far)[0]])  # ties: lower id (evictable is sorted)
