"""The policy interface shared by the simulator and the executor (see docs/policies.md).

Three families, each with a registry: *placement* (GPU or CPU for each activated expert), *prefetch*
(experts of later layers to start moving to the GPU), *cache* (what stays resident per layer). A
policy sees a read-only :class:`LayerView` and returns decisions. It never reads a clock, never
touches a tensor and never imports torch; it may keep its own bookkeeping (LRU order, counters).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Generic, TypeVar

import numpy as np

from dali_sim.config import PolicyConfig
from dali_sim.hardware.cost import CostModel
from dali_sim.registry import Registry


def readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


@dataclass(frozen=True)
class LayerView:
    """What a policy may see at the start of one (step, MoE layer). Arrays are read-only.

    ``experts`` are the activated experts in touch order (see the cache semantics), ``counts`` their
    workloads (tokens routed), ``ranks`` their best rank among the step's tokens. ``resident`` is the
    layer's cache contents at the start of the layer, ``pending`` the experts prefetched for this
    layer (in flight or arrived). ``lookahead(name, layer)`` gives the predicted per-expert token
    counts of a later MoE layer, as known now.
    """

    step: int
    layer: int  # MoE-layer ordinal 0..num_layers-1
    phase: int  # 0 prefill, 1 decode
    tokens: int
    experts: np.ndarray
    counts: np.ndarray
    ranks: np.ndarray
    resident: np.ndarray  # (E,) bool
    pending: np.ndarray  # (E,) bool
    num_layers: int
    num_experts: int
    costs: CostModel
    lookahead: Callable[[str, int], np.ndarray]
    #: ``lookahead_rank(name, layer)``: (E,) best predicted rank per expert (top_k = not predicted),
    #: to break ties in predicted counts by the predictor's own scores
    lookahead_rank: Callable[[str, int], np.ndarray] | None = None
    #: the true (E,) workload of a later layer of this step: given only to policies that read the future
    true_counts: Callable[[int], np.ndarray] | None = None
    #: ``lookahead_segment(name, layer)``: the sparse form of ``lookahead`` and ``lookahead_rank``, (experts,
    #: predicted counts, best predicted ranks) of the experts predicted for at least one token (distinct, in no
    #: particular order); None where the workload does not keep predictions in that form
    lookahead_segment: Callable[[str, int], tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None

    def workload(self) -> np.ndarray:
        """(E,) tokens routed to each expert of this layer in this step."""
        out = np.zeros(self.num_experts, np.int64)
        out[self.experts] = self.counts
        return out


# ---- configs (PolicyConfig lives in dali_sim.config: the memory plan uses it without the policies) ----
@dataclass(frozen=True)
class NoConfig(PolicyConfig):
    pass


C = TypeVar("C", bound=PolicyConfig)


class Policy(ABC, Generic[C]):
    """Common base: a registered name, a typed config class and a config instance."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Config: ClassVar[type[PolicyConfig]] = NoConfig
    #: a bound: the exact optimum of something a run measures (``bound_of`` says what), so no policy
    #: of its family can do better on that measure; results list it under ``summary["bounds"]``
    is_bound: ClassVar[bool] = False
    #: what a bound bounds, in a few words (printed with the ``BOUND`` line)
    bound_of: ClassVar[str] = ""
    #: reads the run's future (``LayerView.true_counts`` or next-use times): not achievable by a running
    #: system. Such a policy that is not a bound is an *oracle heuristic*, a reference point that is
    #: neither achievable nor a limit; results list it under ``summary["oracles"]``
    reads_future: ClassVar[bool] = False
    #: reads next-use times (``SetupContext.future``), precomputed by ``dali trace enrich`` (implies
    #: ``reads_future``)
    needs_future: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.needs_future and not cls.reads_future:
            raise TypeError(f"policy {cls.name!r} needs next-use times, so it reads the future: set reads_future")

    def __init__(self, config: C | None = None):
        self.config: C = config if config is not None else self.Config()  # type: ignore[assignment]

    def setup(self, ctx: "SetupContext") -> None:
        """Called once before the run with static facts (shape, capacities, frequencies, seed)."""


@dataclass(frozen=True)
class SetupContext:
    num_layers: int
    num_experts: int
    top_k: int
    capacities: np.ndarray  # (L,) cache slots per layer
    #: (L, E) total workload per expert in the profiling input (frequency-based choices; docs/simulator.md)
    frequencies: np.ndarray
    costs: CostModel
    seed: int
    block_of_layer: tuple[int, ...]  # MoE ordinal -> block index
    staging_slots: int = 0  # expert buffers for fetched experts that are not admitted
    prefetch_slots: int = 0  # expert buffers for prefetched experts
    #: next-use times (``dali_sim.runtime.future.FutureDemand``): given only to policies that read the future
    future: Any = None
    #: (L, E) the evaluated workload's own totals: only ``memory.cache_init = frequency-hindsight`` reads them
    hindsight_frequencies: np.ndarray | None = None


@dataclass(frozen=True)
class PlacementRule:
    """A placement as data (:meth:`PlacementPolicy.rule_form`), for the controller's compiled path: at a step
    of ``T`` tokens, an activated expert ``e`` of layer ``l`` with workload ``c`` runs on the GPU iff
    ``gpu_layer[l]``, or ``T >= min_tokens[l]``, or ``resident`` and ``e`` is in the layer's cache, or
    ``pending`` and ``e`` is prefetched for the layer, or ``by_count[min(c, C - 1)] == 1`` (``C`` its
    length); an entry -1 leaves the expert undecided: the controller then asks :meth:`~PlacementPolicy.place`."""

    gpu_layer: np.ndarray  # (L,) bool
    min_tokens: np.ndarray  # (L,) int64 (a value above any step's tokens: never)
    resident: bool
    pending: bool
    by_count: np.ndarray  # (C,) int8: 1 GPU, 0 CPU, -1 undecided; the last entry holds for every c >= C - 1

    @classmethod
    def constant(cls, num_layers: int, on_gpu: bool, *, resident: bool = False,
                 pending: bool = False) -> "PlacementRule":
        """Every layer alike: the GPU (``on_gpu``) or the CPU, but resident / pending experts as asked."""
        return cls(np.full(num_layers, on_gpu), np.full(num_layers, NEVER, np.int64), resident, pending,
                   np.zeros(1, np.int8))


#: ``PlacementRule.min_tokens`` of a layer that never puts every expert on the GPU for its token count
NEVER = np.iinfo(np.int64).max


@dataclass(frozen=True)
class GreedyForm:
    """DALI's greedy assignment as data (:meth:`PlacementPolicy.greedy_form`), for the controller's compiled
    path: the times of an expert with workload ``c`` are ``gpu[c]`` and ``cpu[c]`` (``c`` below both tables'
    length; else the controller asks :meth:`~PlacementPolicy.place`), one expert's copy ``transfer``; the
    flags are ``dali-greedy``'s config (``placement_dali._greedy_place``)."""

    gpu: np.ndarray  # (C,) float64 seconds
    cpu: np.ndarray  # (C,) float64 seconds
    transfer: float
    overlap: bool
    pending_resident: bool


@dataclass(frozen=True)
class HSSForm:
    """HybriMoE's HSS schedule as data (:meth:`PlacementPolicy.hss_form`), for the controller's compiled path:
    times by workload as :class:`GreedyForm`; ``pending_resident``: a prefetched expert counts as cached;
    ``single_token``: a step of more than one token runs every activated expert on the GPU
    (``hybrimoe.HybriMoEPlacement``)."""

    gpu: np.ndarray  # (C,) float64 seconds
    cpu: np.ndarray  # (C,) float64 seconds
    transfer: float
    pending_resident: bool
    single_token: bool


class PlacementPolicy(Policy[C]):
    #: whether this policy can put a non-resident expert on the GPU (then staging buffers are needed)
    may_fetch: ClassVar[bool] = True

    def required_capacities(self, num_layers: int, num_experts: int) -> np.ndarray | None:
        """Cache slots per layer this placement depends on (None: the memory layout decides)."""
        return None

    def rule_form(self, ctx: "SetupContext") -> PlacementRule | None:
        """The placement as a :class:`PlacementRule` (after :meth:`setup`; speed only), for a policy whose
        choice of each expert depends only on the layer, the step's token count, the expert's workload and
        whether it is resident or pending, and which keeps no state: the controller then plans a layer
        without a :class:`LayerView` in one compiled call. None (the default): no rule form. Must agree
        with :meth:`place` (tests/test_plan_fast.py runs every preset both ways)."""
        return None

    def greedy_form(self, ctx: "SetupContext") -> GreedyForm | None:
        """The placement as a :class:`GreedyForm` (after :meth:`setup`; speed only): DALI's Algorithm 1 on the
        cost model's tables, keeping no state. None (the default): no such form. Must agree with
        :meth:`place`."""
        return None

    def hss_form(self, ctx: "SetupContext") -> HSSForm | None:
        """The placement as an :class:`HSSForm` (after :meth:`setup`; speed only), keeping no state. None (the
        default): no such form. Must agree with :meth:`place`."""
        return None

    @abstractmethod
    def place(self, view: LayerView) -> np.ndarray:
        """Bool mask aligned with ``view.experts``: True = run on the GPU, False = on the CPU."""


class PrefetchPolicy(Policy[C]):
    def required_predictors(self) -> tuple[str, ...]:
        """Lookahead columns this policy reads (the trace must have them)."""
        return ()

    @abstractmethod
    def prefetch(self, view: LayerView) -> list[tuple[int, int]] | np.ndarray:
        """(target MoE layer, expert) pairs to start moving to the GPU now, most wanted first: a list of
        pairs or an (m, 2) integer array (which the controller issues in one compiled call).
        Targets must be later layers of the same step; the runtime skips resident or pending ones
        and drops what does not fit the prefetch buffers."""

    def top_k_form(self) -> tuple[str, int] | None:
        """``(column, k)`` when :meth:`prefetch` is exactly the next layer's ``k`` experts (0 = all) with the
        largest predicted count in lookahead column ``column`` (ties: best rank, then lower id), keeping no
        state (speed only: the controller then issues them in its compiled call). None (the default)."""
        return None

    def impact_form(self, ctx: "SetupContext") -> tuple[np.ndarray, list[tuple[int, str]], float, int] | None:
        """``(seen, columns, threshold, k)`` when :meth:`prefetch` is HybriMoE's impact-driven prefetch under
        the HSS schedule on the cost model's tables (``kernels._impact_requests``): ``seen`` (L, E) bool, each
        layer's cache contents at its last visit (set in place at every call), ``columns`` the (distance,
        lookahead column) pairs. None (the default; speed only)."""
        return None


class CachePolicy(Policy[C]):
    """Eviction and admission for the per-layer GPU expert caches (semantics in docs/policies.md).

    The runtime owns the contents; the policy is told what happens and chooses victims.

    Batch form (optional, for speed; the results are the same): a policy whose :meth:`victim` depends
    neither on the incoming expert nor on anything that changes during a layer visit, and whose
    :meth:`accepts` does not depend on the expert, implements :meth:`victim_order`; the controller then
    plans a layer's admissions and evictions in one go and reports them with :meth:`touched` and
    :meth:`evicted` (defaults: the per-expert hooks, in touch order). A subclass that overrides a
    per-expert hook (``on_hit``, ``on_admit``, ``on_evict``, ``accepts``, ``victim``) without
    overriding any batch hook falls back to the per-expert protocol automatically.
    """

    _PER_EXPERT_HOOKS: ClassVar[tuple[str, ...]] = ("on_hit", "on_admit", "on_evict", "accepts", "victim")
    _BATCH_HOOKS: ClassVar[tuple[str, ...]] = ("victim_order", "touched", "evicted")
    _batch_form: ClassVar[bool] = True  # False: a per-expert hook was overridden after the batch forms
    _keyed: ClassVar[bool] = False  # whether keyed_form is the class's own or agrees with its hooks
    #: ``keyed_form(layer, view)`` reads neither the view nor the visit (its rows are views of the policy's
    #: tables): the controller may ask it once per layer, with ``view=None``. A subclass that defines its own
    #: ``keyed_form`` must say so again
    keyed_per_layer: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        if any(h in own for h in cls._BATCH_HOOKS):
            cls._batch_form = True
        elif any(h in own for h in cls._PER_EXPERT_HOOKS):
            cls._batch_form = False  # per-expert hooks changed, batch forms inherited: they may disagree
        if "keyed_form" in own:
            cls._keyed = True
            if "keyed_per_layer" not in own:
                cls.keyed_per_layer = False
        elif any(h in own for h in cls._PER_EXPERT_HOOKS + cls._BATCH_HOOKS):
            cls._keyed = False  # hooks changed, keyed form inherited: it may disagree

    @property
    def batched(self) -> bool:
        """Whether the controller may use the batch form (:meth:`victim_order` is implemented and agrees
        with the per-expert hooks)."""
        return self._batch_form and type(self).victim_order is not CachePolicy.victim_order

    def initial(self, layer: int, capacity: int, ctx: SetupContext, init: str, rng: np.random.Generator) -> list[int]:
        """Initial contents of a layer's cache (``init``: one of ``dali_sim.runtime.memory.CACHE_INITS``)."""
        return initial_contents(layer, capacity, ctx, init, rng)

    def next_use_times(self, ctx: SetupContext):
        """``ctx.future`` for a cache that needs next-use times, or the error that names the command."""
        if ctx.future is None:
            raise ValueError(f"cache {self.name!r} needs next-use times (`dali trace enrich`), which the runtime "
                             "gives to policies that read the future only")
        return ctx.future

    def observe(self, view: LayerView) -> None:
        """Start of every (step, layer), before any touch (frequency counters, windows)."""

    def on_hit(self, layer: int, expert: int, view: LayerView) -> None:
        """An activated expert was resident: refresh it."""

    def accepts(self, layer: int, expert: int, view: LayerView) -> bool:
        """Admit a fetched expert into a free slot? (LRU and LFU: always.)"""
        return True

    @abstractmethod
    def victim(self, layer: int, expert: int, view: LayerView, evictable: np.ndarray) -> int | None:
        """The cache is full: name a victim among ``evictable`` (resident, not activated this step),
        or None to decline ``expert`` (it is then used from a staging buffer)."""

    def on_admit(self, layer: int, expert: int, view: LayerView) -> None:
        """``expert`` entered the cache."""

    def on_evict(self, layer: int, expert: int) -> None:
        """``expert`` left the cache."""

    def victim_order(self, layer: int, view: LayerView, evictable: np.ndarray) -> np.ndarray:
        """Batch form of :meth:`victim`: every entry of ``evictable`` in the order successive
        :meth:`victim` calls would name them during this layer visit (empty: it declines every fetched
        expert). Only for policies that meet the conditions in the class docstring."""
        raise NotImplementedError(f"cache policy {self.name!r} has no batch form")

    @property
    def keyed(self) -> bool:
        """Whether the controller may use the keyed form (:meth:`keyed_form`, its compiled fast path)."""
        return self._keyed and self.batched

    def keyed_form(self, layer: int, view: LayerView) -> tuple[bool, bool, np.ndarray, np.ndarray, np.ndarray | None]:
        """The batch form as data, for the controller's compiled path (``dali_sim.runtime.plan_kernel``), for a
        policy whose victims are the evictable entries by ascending ``(primary[e], stamp[e], e)``, whose
        touches (hits and admissions, in touch order) set ``stamp[e]`` to the next ticks of a clock or do
        nothing, and which needs no notice of evictions. Called once per layer visit after :meth:`observe`;
        returns ``(accepts, evicts, primary, stamp, clock)``: ``accepts`` (:meth:`accepts` for this visit),
        ``evicts`` (False: :meth:`victim_order` is empty), the layer's (E,) ``primary`` and ``stamp`` rows
        (``stamp`` is written in place) and ``clock``, a (1,) int64 array of the last tick (advanced in
        place), or None when touches set nothing. Must agree with the batch form (tested for the shipped
        policies in tests/test_plan_fast.py)."""
        raise NotImplementedError(f"cache policy {self.name!r} has no keyed form")

    def touched(self, layer: int, experts: np.ndarray, admitted: np.ndarray, view: LayerView) -> None:
        """Batch form of :meth:`on_hit` / :meth:`on_admit`: the experts hit or admitted in this layer
        visit, in touch order; ``admitted`` (aligned bool) marks the admitted ones."""
        cls = type(self)
        if cls.on_hit is CachePolicy.on_hit and cls.on_admit is CachePolicy.on_admit:
            return  # nothing to tell
        for e, adm in zip(experts.tolist(), admitted.tolist()):
            (self.on_admit if adm else self.on_hit)(layer, e, view)

    def evicted(self, layer: int, experts: np.ndarray) -> None:
        """Batch form of :meth:`on_evict` (in eviction order)."""
        if type(self).on_evict is CachePolicy.on_evict:
            return
        for e in experts.tolist():
            self.on_evict(layer, e)

    def rebalance(self, view: LayerView, resident: np.ndarray) -> list[tuple[int, int]]:
        """After the layer's touches: (expert_in, expert_out) swaps the policy wants (each a PCIe
        transfer, resident from the next step's visit of this layer). Default: none."""
        return []

    def window_form(self) -> tuple[np.ndarray, int, int] | None:
        """``(state, w, u)`` when :meth:`observe` and :meth:`rebalance` are DALI's windowed sums
        (``cache_dali``): ``state`` (L, E + 1) int64, each layer's window sums of workloads and, in the last
        column, its visits in the window (updated in place by the controller's compiled call); at ``w``
        visits up to ``u`` swaps (``cache_dali._window_swaps``), then the window restarts. Needs
        :attr:`keyed_per_layer` and no swap notices. None (the default): no such form (speed only)."""
        return None

    def mrs_form(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, bool] | None:
        """``(score, stamp, clock, a, prefill_evicts)`` when :meth:`observe` is HybriMoE's MRS update of
        ``score`` (L, E) float64 with weight ``a`` (``kernels._mrs_update``) and the keyed form of a layer is
        ``(True, not prefill or prefill_evicts, score[layer], stamp[layer], clock)``, with no swaps or swap
        notices (``hybrimoe-mrs``). None (the default; speed only)."""
        return None


def initial_contents(layer: int, capacity: int, ctx: SetupContext, init: str, rng: np.random.Generator) -> list[int]:
    """``init``: one of ``dali_sim.runtime.memory.CACHE_INITS`` (docs/policies.md, "Initial contents")."""
    from dali_sim.runtime.memory import CACHE_INITS  # the memory settings own the vocabulary

    if init not in CACHE_INITS:
        raise ValueError(f"cache init must be one of {', '.join(CACHE_INITS)}, got {init!r}")
    if capacity <= 0 or init == "empty":
        return []
    if init == "random":
        return sorted(rng.choice(ctx.num_experts, size=min(capacity, ctx.num_experts), replace=False).tolist())
    if init == "lowest-ids":
        return list(range(min(capacity, ctx.num_experts)))
    if init == "highest-ids":
        return list(range(max(0, ctx.num_experts - capacity), ctx.num_experts))
    freq = ctx.frequencies if init == "frequency" else ctx.hindsight_frequencies
    if freq is None:
        raise ValueError(f"cache init {init!r}: this run has no evaluated-workload frequencies (online runs see "
                         "no future: use frequency with a profile trace)")
    order = np.lexsort((np.arange(ctx.num_experts), -freq[layer]))  # most used first, ties: lower id
    return sorted(order[:capacity].tolist())


PLACEMENTS: Registry[type[PlacementPolicy]] = Registry("placement policy")
PREFETCHERS: Registry[type[PrefetchPolicy]] = Registry("prefetch policy")
CACHES: Registry[type[CachePolicy]] = Registry("cache policy")


def registered(registry: Registry):
    """Class decorator: ``@registered(CACHES)`` adds the class under its ``name``."""

    def add(cls):
        registry.add(cls.name, cls)
        return cls

    return add
