"""The exact cache optimum (a BOUND): the most hits any cache that does not swap can get.

Under the shared cache semantics (docs/policies.md, *Cache semantics*) with every activated expert
offered for admission (a GPU-only placement), the decisions of a cache are which misses to admit,
which evictable entry each admission into a full cache replaces, and (optionally) the initial
contents. The maximum number of hits over all such decisions is a min-cost flow per layer
(:func:`optimal_cache_schedule`; formulation and proof in docs/policies.md, *The exact cache
optimum*), solved exactly with HiGHS. The ``optimal`` cache policy solves it once per layer from the
run's next-use times and then follows the schedule, repairing it where the controller's rules leave
an entry in the cache that the schedule let go; its counted hits equal the optimum (tests/test_cache_optimal.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dali_sim.flow import min_cost_flow
from dali_sim.policies.base import CACHES, CachePolicy, LayerView, PolicyConfig, SetupContext, initial_contents, \
    registered

INITS = ("given", "optimal")


@dataclass(frozen=True)
class CacheSchedule:
    """The optimum of one layer. ``keep[i]``: keep the expert of activation ``i`` resident from that use
    to its next one (activations in the order given to :func:`optimal_cache_schedule`); ``initial``:
    (E,) bool, resident at the start and kept to the first use; ``hits`` = keep.sum() + initial.sum()."""

    hits: int
    keep: np.ndarray
    initial: np.ndarray


def optimal_cache_schedule(experts: np.ndarray, steps: np.ndarray, num_experts: int, capacity: int,
                           initial: np.ndarray | None = None, time_limit_s: float = 600.0) -> CacheSchedule:
    """The most hits one layer's cache of ``capacity`` slots can get, and a schedule that gets them.

    ``experts``, ``steps``: every activation of the layer, each (expert, step) once, sorted by expert,
    then step. ``initial``: the (E,) bool initial contents (at most ``capacity``), or None to choose
    them as well. A min-cost flow: ``capacity`` units run along the layer's timeline of boundaries
    (before the first step, after each step); a unit at the node of activation (e, t) holds e in a slot
    at the end of step t; the arc from (e, t) to e's next use is a hit (cost -1)."""
    experts = np.asarray(experts, np.int64)
    steps = np.asarray(steps, np.int64)
    n = len(experts)
    if n and (np.any(np.diff(experts) < 0) or np.any((np.diff(experts) == 0) & (np.diff(steps) <= 0))):
        raise ValueError("activations must be sorted by expert, then step, each (expert, step) once")
    if initial is not None:
        initial = np.asarray(initial, bool)
        if initial.shape != (num_experts,) or initial.sum() > capacity:
            raise ValueError(f"initial contents must be {num_experts} flags with at most {capacity} set")
    empty = CacheSchedule(0, np.zeros(n, bool), np.zeros(num_experts, bool))
    if capacity <= 0 or n == 0:
        return empty

    first = np.ones(n, bool)
    first[1:] = experts[1:] != experts[:-1]
    last = np.ones(n, bool)
    last[:-1] = first[1:]
    used = np.unique(experts)
    init_experts = used if initial is None else used[initial[used]]
    m = len(init_experts)
    # timeline nodes 0..R+1: node i comes before boundary i (0 = before the first step, 1 + j = after
    # the j-th distinct step), node i + 1 after it; then one node per activation and per initial entry
    distinct = np.unique(steps)
    R = len(distinct)
    T = R + 2
    boundary = np.concatenate((1 + np.searchsorted(distinct, steps), np.zeros(m, np.int64)))
    node = T + np.arange(n + m)
    hold_src = np.flatnonzero(~last)  # activation i -> i + 1 of the same expert: a hit
    first_of = np.flatnonzero(first)[np.searchsorted(experts[first], init_experts)]
    idle = np.arange(R + 1)
    tail = np.concatenate((idle, boundary, node, T + hold_src, T + n + np.arange(m)))
    head = np.concatenate((idle + 1, node, boundary + 1, T + hold_src + 1, T + first_of))
    kinds = np.cumsum([0, R + 1, n + m, n + m, len(hold_src), m])  # idle | enter | leave | hold | initial hold
    cost = np.zeros(len(tail))
    cost[kinds[3]:] = -1.0
    upper = np.ones(len(tail))
    upper[: R + 1] = capacity
    supply = np.zeros(T + n + m)
    supply[0], supply[T - 1] = capacity, -capacity
    flow = min_cost_flow(tail, head, cost, upper, supply, time_limit_s=time_limit_s,
                         what=f"cache optimum ({n} activations, {capacity} slots)")
    keep = np.zeros(n, bool)
    keep[hold_src] = flow[kinds[3]:kinds[4]] > 0
    init = np.zeros(num_experts, bool)
    init[init_experts] = flow[kinds[4]:] > 0
    return CacheSchedule(int(keep.sum() + init.sum()), keep, init)


@dataclass(frozen=True)
class OptimalCacheConfig(PolicyConfig):
    init: str = field(default="given", metadata={
        "help": "initial contents: 'given' (memory.cache_init, as every other cache gets) or 'optimal' "
                "(chosen by the optimum as well; ignores memory.cache_init)"})
    time_limit_s: float = field(default=600.0, metadata={"help": "HiGHS time limit per layer; not proved optimal "
                                                                  "in time is an error"})

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ValueError(f"cache.init must be one of {', '.join(INITS)}, got {self.init!r}")
        if self.time_limit_s <= 0:
            raise ValueError(f"cache.time_limit_s must be > 0, got {self.time_limit_s}")


@registered(CACHES)
class OptimalCache(CachePolicy[OptimalCacheConfig]):
    """Follows each layer's :class:`CacheSchedule`. The schedule's *live* entries are those it keeps
    to their next use; the controller evicts only when admitting into a full cache, so entries the
    schedule let go may stay (*dead*). Every eviction takes a dead entry; a dead entry that is
    activated again is an extra hit, and when the entries it protects leave too few slots, that many
    planned admissions of the step are dropped (each costs the one hit it was planned for, never
    more than the extra hits gained): the counted hits are the optimum (docs/policies.md)."""

    name = "optimal"
    description = ("BOUND: the exact optimum of the cache semantics (min-cost flow, HiGHS): the most hits any cache "
                   "that does not swap can get when every miss is offered (reads next-use times)")
    bound_of = "hits: no cache that does not swap gets more (with every miss offered, e.g. gpu-only placement)"
    Config = OptimalCacheConfig
    is_bound = True
    reads_future = True
    needs_future = True

    def setup(self, ctx: SetupContext) -> None:
        self.future = self.next_use_times(ctx)
        L, E = ctx.num_layers, ctx.num_experts
        self.capacities = np.asarray(ctx.capacities)
        self.live = np.zeros((L, E), bool)  # kept by the schedule until the expert's next use
        self.keep_now = np.zeros((L, E), bool)  # this visit's activated experts to keep after it
        self._keys: list[np.ndarray] = [np.zeros(0, np.int64)] * L  # step * E + expert of each activation
        self._keep: list[np.ndarray] = [np.zeros(0, bool)] * L
        #: the optimum per layer (the counted hits equal its sum when every miss is offered)
        self.optimum = np.zeros(L, np.int64)
        self.dropped = np.zeros(L, np.int64)  # planned admissions dropped by the repair
        self.extra = np.zeros(L, np.int64)  # hits of dead entries (not planned)

    def initial(self, layer: int, capacity: int, ctx: SetupContext, init: str, rng: np.random.Generator) -> list[int]:
        start, given = None, None
        if self.config.init == "given":
            start = initial_contents(layer, capacity, ctx, init, rng)
            given = np.zeros(ctx.num_experts, bool)
            given[start] = True
        experts, steps = self.future.layer_uses(layer)
        sched = optimal_cache_schedule(experts, steps, ctx.num_experts, capacity, given, self.config.time_limit_s)
        self.optimum[layer] = sched.hits
        self.live[layer] = sched.initial
        key = steps * ctx.num_experts + experts
        order = np.argsort(key)
        self._keys[layer], self._keep[layer] = key[order], sched.keep[order]
        return start if start is not None else np.flatnonzero(sched.initial).tolist()

    def _planned(self, layer: int, step: int, experts: np.ndarray) -> np.ndarray:
        keys = self._keys[layer]
        want = step * self.live.shape[1] + np.asarray(experts, np.int64)
        i = np.searchsorted(keys, want)
        if np.any(i >= len(keys)) or np.any(keys[np.minimum(i, len(keys) - 1)] != want):
            raise ValueError(f"cache 'optimal': step {step} layer {layer} activates experts the next-use times do "
                             "not list: they were computed for another workload")
        return self._keep[layer][i]

    def observe(self, view: LayerView) -> None:
        layer, A = view.layer, view.experts
        resident, live = view.resident, self.live[layer]
        if np.any(live & ~resident):
            raise AssertionError(f"cache 'optimal': a kept entry of layer {layer} left the cache (swapped out?)")
        keep = self._planned(layer, view.step, A).copy()
        activated = np.zeros(len(resident), bool)
        activated[A] = True
        hits_now = int(np.count_nonzero(resident & activated))
        self.extra[layer] += int(np.count_nonzero(resident[A] & ~live[A]))
        missing = np.flatnonzero(keep & ~resident[A])  # planned admissions (positions in A)
        excess = hits_now + int(np.count_nonzero(live & ~activated)) + len(missing) - int(self.capacities[layer])
        if excess > 0:  # protected dead entries take slots the plan counted on: drop that many admissions
            nxt = self.future.next_use(layer, A[missing], view.step)
            drop = missing[np.lexsort((-A[missing], -nxt))[:excess]]  # farthest next use first, then higher id
            keep[drop] = False
            self.dropped[layer] += excess
        self.keep_now[layer] = False
        self.keep_now[layer, A] = keep
        live[A] = False  # set again for the ones kept (on_hit / on_admit)

    def on_hit(self, layer: int, expert: int, view: LayerView) -> None:
        if self.keep_now[layer, expert]:
            self.live[layer, expert] = True

    def accepts(self, layer: int, expert: int, view: LayerView) -> bool:
        return bool(self.keep_now[layer, expert])

    def victim(self, layer: int, expert: int, view: LayerView, evictable: np.ndarray) -> int | None:
        if not self.keep_now[layer, expert]:
            return None
        dead = evictable[~self.live[layer, evictable]]
        if not dead.size:
            raise AssertionError(f"cache 'optimal': step {view.step} layer {layer}: no entry the schedule let go "
                                 f"is evictable for expert {expert} (the schedule is infeasible)")
        nxt = self.future.next_use(layer, dead, view.step)
        return int(dead[np.lexsort((dead, -nxt))[0]])  # farthest next use, then lower id

    def on_admit(self, layer: int, expert: int, view: LayerView) -> None:
        self.live[layer, expert] = True

    def on_evict(self, layer: int, expert: int) -> None:
        self.live[layer, expert] = False
