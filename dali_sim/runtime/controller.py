"""The controller: turns policy decisions into a timing-free plan for each (step, MoE layer).

It owns the cache contents and the prefetch bookkeeping and applies the cache semantics of
docs/policies.md. The simulator times a plan, the executor performs it, the no-timing replay only
counts it: all three share this code, so they agree on every hit, admission and transfer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace

import numpy as np

from dali_sim.hardware.cost import CostModel
from dali_sim.policies import kernels
from dali_sim.policies.base import (
    CachePolicy,
    LayerView,
    PlacementPolicy,
    PrefetchPolicy,
    SetupContext,
    readonly,
)
from dali_sim.policies.prefetch import NoPrefetch
from dali_sim.runtime import plan_kernel
from dali_sim.runtime.future import FutureDemand
from dali_sim.runtime.plan_kernel import (
    TALLY_EVICTED,
    TALLY_FIRST_FETCH,
    TALLY_LEN,
    TALLY_PREFETCH_USED,
    TALLY_PREFETCHES,
    TALLY_STAGED,
    TALLY_SWAPS,
    TALLY_WASTED,
)
from dali_sim.trace.schema import PREFILL
from dali_sim.workload.builder import SparseCounts, Workload
from dali_sim.workload.online import OnlineWorkload

# where the weights of an activated expert come from
HIT, PREFETCHED, FETCH, CPU = 0, 1, 2, 3
SOURCE_NAMES = ("cache", "prefetched", "on-demand", "cpu")
#: source by (on_gpu << 2) | (resident << 1) | pending: CPU unless on the GPU, then HIT > PREFETCHED > FETCH
_SOURCE_OF = np.array([CPU, CPU, CPU, CPU, FETCH, PREFETCHED, HIT, HIT], dtype=np.int8)
_new = object.__new__


@dataclass
class LayerPlan:
    """Everything decided for one (step, layer), in the order the runtime must honour it."""

    step: int
    layer: int
    phase: int
    tokens: int
    experts: np.ndarray  # activated experts, touch order
    counts: np.ndarray  # their workloads
    on_gpu: np.ndarray  # bool, aligned with experts
    source: np.ndarray  # int8 HIT | PREFETCHED | FETCH | CPU, aligned with experts
    hit: np.ndarray  # bool: resident in the layer's cache at the start of the layer
    admitted: np.ndarray  # bool: entered the cache in this layer
    staged: np.ndarray  # bool: copied on demand but not admitted (used from a staging buffer)
    evicted: list[int] = field(default_factory=list)
    prefetches: list[tuple[int, int]] = field(default_factory=list)  # issued now: (target layer, expert)
    prefetch_used: list[int] = field(default_factory=list)  # experts prefetched for this layer and used on the GPU
    prefetch_wasted: list[int] = field(default_factory=list)  # prefetched for this layer, not used
    swaps: list[tuple[int, int]] = field(default_factory=list)  # cache-initiated (in, out) transfers
    #: the plan's row of counters (``PlanCounters``), when the controller's compiled path counted them
    tally: tuple[int, ...] | None = None
    #: the compiled path's int64 answer (``plan_kernel``), the victims after the tally and the first fetch:
    #: ``evicted`` as an array is ``answer[TALLY_LEN + 1:][:len(evicted)]`` (the executor's route call takes that view)
    answer: np.ndarray | None = None


class Controller:
    """Runs the three policies over a workload, one (step, layer) at a time, in order."""

    def __init__(self, workload: Workload, costs: CostModel, placement: PlacementPolicy, cache: CachePolicy,
                 prefetch: PrefetchPolicy, capacities: np.ndarray, *, cache_init: str = "empty",
                 prefetch_slots: int = 0, staging_slots: int = 1, seed: int = 0,
                 future: FutureDemand | None = None, frequencies: np.ndarray | None = None, fast: bool = True):
        """``frequencies``: (L, E) per-expert workloads of the profiling input, for frequency-based choices
        (``dali_sim.workload.profiling``); None = the workload's own (hindsight), as ``frequency-hindsight``.
        ``fast=False``: every plan by :meth:`plan_reference` (the same plans; for tests and comparisons)."""
        self.w = workload
        self.costs = costs
        self.placement, self.cache, self.prefetcher = placement, cache, prefetch
        L, E = workload.num_layers, workload.num_experts
        self._num_layers = L
        self.capacities = np.asarray(capacities, dtype=np.int64)
        if self.capacities.shape != (L,) or (self.capacities < 0).any() or (self.capacities > E).any():
            raise ValueError(f"cache capacities must be {L} values in 0..{E}, got {self.capacities.tolist()}")
        if prefetch.name != "none" and prefetch_slots < 1:
            raise ValueError(f"prefetch policy {prefetch.name!r} needs prefetch buffers: set memory.prefetch_slots >= 1")
        self.prefetch_slots = prefetch_slots
        self.staging_slots = staging_slots
        hindsight = workload.frequencies()
        if frequencies is not None and np.shape(frequencies) != (L, E):
            raise ValueError(f"profile frequencies must be ({L}, {E}) (MoE layers x experts), "
                             f"got {np.shape(frequencies)}")
        ctx = SetupContext(
            num_layers=L, num_experts=E, top_k=workload.top_k, capacities=readonly(self.capacities),
            frequencies=readonly(np.asarray(frequencies if frequencies is not None else hindsight, np.int64)),
            hindsight_frequencies=readonly(hindsight), costs=costs, seed=seed,
            block_of_layer=workload.model.moe_layers, staging_slots=staging_slots, prefetch_slots=prefetch_slots,
        )
        self.ctx = ctx
        rng = np.random.default_rng(seed)
        for policy in (placement, cache, prefetch):  # next-use times go to policies that read the future only
            policy.setup(dataclasses.replace(ctx, future=future) if policy.reads_future else ctx)
        # the cache contents and the prefetched experts of each layer, and their counts, as rows of one array
        # each (the view-free compiled plan takes them as two arguments)
        self._contents = np.zeros((2, L, E), dtype=bool)
        self._totals = np.zeros((2, L), dtype=np.int64)
        self.resident = self._contents[0]
        for layer in range(L):
            init = cache.initial(layer, int(self.capacities[layer]), ctx, cache_init, rng)
            if len(init) > self.capacities[layer] or len(set(init)) != len(init):
                raise ValueError(f"cache policy {cache.name!r} gave layer {layer} an invalid initial set {init}")
            self.resident[layer, init] = True
        self.initial_resident = self.resident.copy()
        self.n_resident = self._totals[0]
        self.n_resident[:] = self.resident.sum(axis=1)
        self.pending = self._contents[1]  # prefetched (in flight or arrived) for each layer
        self.n_pending = self._totals[1]
        self._pending_total = 0  # n_pending.sum(), kept as an int (asked at every layer)
        self._predictors = tuple(workload.predicted)
        families = (("placement", placement), ("cache", cache), ("prefetch", prefetch))
        #: the families whose policy is a bound (an exact optimum); results are labelled with it
        self.bounds = {family: p.name for family, p in families if p.is_bound}
        #: the families whose policy reads the future without being a bound (oracle heuristics)
        self.oracles = {family: p.name for family, p in families if p.reads_future and not p.is_bound}
        # (asked once: a policy's class does not change during a run)
        self._prefetching = self.prefetch_slots > 0
        self._swapping = type(cache).rebalance is not CachePolicy.rebalance
        cls = type(cache)
        self._observes = cls.observe is not CachePolicy.observe
        # (the default hooks do nothing: not called)
        self._told_of_swaps = cls.on_evict is not CachePolicy.on_evict or cls.on_admit is not CachePolicy.on_admit
        #: the compiled bookkeeping of :meth:`plan` (None: every plan takes :meth:`plan_reference`)
        self._kernel = plan_kernel.compiled() if cache.keyed and fast else None
        #: each layer's keyed form, asked once where it reads neither the view nor the visit (else None)
        self._keyed_rows = [cache.keyed_form(layer, None) for layer in range(L)] \
            if self._kernel is not None and cache.keyed_per_layer else None
        self._issue_kernel = plan_kernel.compiled_issue() if fast else None
        self._no_clock = np.zeros(1, np.int64)
        #: a built workload's segments (ptr as Python ints, read-only experts, counts and ranks, each step's
        #: phase and tokens), read without a call per plan; None: the workload is asked (an online one)
        self._segments = self._static_segments(workload)
        #: likewise each lookahead column's predictions (ptr as Python ints, read-only experts, counts, ranks)
        self._predicted = None if self._segments is None else {
            name: (sc.ptr.tolist(), *(readonly(a) for a in (sc.expert, sc.count, sc.rank)))
            for name, sc in workload.predicted.items()}
        self._online = isinstance(workload, OnlineWorkload)
        #: each lookahead column's sparse predictions as the compiled plans read them: a built workload's
        #: (segment ``step * L + layer``) or an online one's current step (segment ``layer``: the plans are
        #: given step 0); None (another workload): the plans that read them take a view
        self._columns = workload.predicted if self._segments is not None else \
            workload.step_predicted if self._online else None
        #: the view-free compiled plan (:meth:`_ruled_args`): the kernel and each layer's arguments, or None
        self._ruled = self._ruled_args()
        #: likewise for DALI's greedy placement (:meth:`_greedy_args`) or HybriMoE (:meth:`_impact_args`): the
        #: kernel, each layer's arguments and whether the step's phase and tokens come first; or None
        self._fused = None if self._ruled is not None else (self._greedy_args() or self._impact_args())

    @staticmethod
    def _static_segments(w) -> tuple | None:
        if not isinstance(w, Workload):
            return None
        a = w.actual
        arrays = [readonly(x) if x.flags.writeable else x for x in (a.expert, a.count, a.rank)]
        return (a.ptr.tolist(), *arrays, w.step_phase.tolist(), w.step_tokens.tolist())

    def _segment(self, step: int, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
        """(experts, counts, ranks, phase, tokens) of (step, layer); the arrays read-only."""
        seg = self._segments
        if seg is not None:
            ptr = seg[0]
            i = step * self._num_layers + layer
            lo, hi = ptr[i], ptr[i + 1]
            return seg[1][lo:hi], seg[2][lo:hi], seg[3][lo:hi], seg[4][step], seg[5][step]
        w = self.w
        if self._online:
            return w.layer_segment(step, layer)
        experts, counts, ranks = w.activated(step, layer)
        if experts.flags.writeable or counts.flags.writeable or ranks.flags.writeable:
            experts, counts, ranks = readonly(experts), readonly(counts), readonly(ranks)
        return experts, counts, ranks, int(w.step_phase[step]), int(w.step_tokens[step])

    def _ruled_args(self) -> tuple | None:
        """The view-free plan: for a placement with a rule form (``PlacementPolicy.rule_form``), a cache with a
        keyed form asked once per layer and nothing to observe, and no prefetches or swaps, every plan is one
        compiled call (``plan_kernel._ruled_plan``) on arguments made here, without a :class:`LayerView`."""
        cache, placement = self.cache, self.placement
        if self._kernel is None or self._observes or self._prefetching or self._swapping \
                or not cache.keyed_per_layer or placement.reads_future:
            return None
        rule = placement.rule_form(self.ctx)
        kernel = plan_kernel.compiled_ruled() if rule is not None else None
        if kernel is None:
            return None
        by_count = np.asarray(rule.by_count, np.int8)
        args = []
        for layer in range(self._num_layers):  # few arguments: each costs the call a typing and an unboxing
            accepts, evicts, primary, stamp, clock = self._keyed_rows[layer]
            params = np.array([layer, self.capacities[layer], accepts, evicts, clock is not None, rule.resident,
                               rule.pending, rule.gpu_layer[layer], rule.min_tokens[layer]], np.int64)
            args.append((self._contents, self._totals, params, primary, stamp,
                         self._no_clock if clock is None else clock, by_count))
        examples = self._segment_examples()
        if examples is not None:  # the arguments' types never change: the compiled function without the dispatcher
            kernel = kernels.entry(kernel, [examples + (0,) + a for a in args])
        return kernel, args

    def _segment_examples(self) -> tuple | None:
        """Empty arrays of the types of every plan's experts and counts (for ``kernels.entry``): a built
        workload's, or an online one's (read-only int16 and int32, as a built one's); None for another."""
        seg = self._segments
        if seg is not None:
            return seg[1][:0], seg[2][:0]
        if self._online:
            return readonly(np.zeros(0, np.int16)), readonly(np.zeros(0, np.int32))
        return None

    def _no_column(self) -> SparseCounts:
        """Sparse predictions of the types of a real column, for an unused argument of a compiled plan."""
        if self._segments is not None:
            return self.w.actual
        return SparseCounts(*(readonly(np.zeros(n, t)) for n, t in
                              ((self._num_layers + 1, np.int64), (0, np.int16), (0, np.int32), (0, np.int8))))

    def _greedy_args(self) -> tuple | None:
        """The view-free plan for a placement with a greedy form (``PlacementPolicy.greedy_form``: DALI's
        Algorithm 1 on the cost tables), a cache with a keyed form asked once per layer that observes and swaps
        nothing or has a window form (``CachePolicy.window_form``: dali-window), and no prefetcher or one with a
        top-k form (``PrefetchPolicy.top_k_form``: lookahead, dali-residual): every plan is one compiled call
        (``plan_kernel._greedy_plan``) without a :class:`LayerView`, as :meth:`_ruled_args`."""
        cache, placement, prefetcher = self.cache, self.placement, self.prefetcher
        if self._kernel is None or self._columns is None or not cache.keyed_per_layer or placement.reads_future:
            return None
        window = cache.window_form()
        if window is None and (self._observes or self._swapping):
            return None
        if window is not None and self._told_of_swaps:
            return None
        prefetching = self._prefetching and type(prefetcher).prefetch is not NoPrefetch.prefetch
        top_k = prefetcher.top_k_form() if prefetching else None
        if prefetching and (top_k is None or top_k[0] not in self._predictors
                            or self.w.predictor_offsets[top_k[0]] < 1):
            return None  # (a column not loaded or not one layer ahead: the view path names the error)
        form = placement.greedy_form(self.ctx)
        kernel = plan_kernel.compiled_greedy() if form is not None else None
        if kernel is None:
            return None
        times = self._time_tables(form)
        state, w, u = window if window is not None else (np.zeros((1, 1), np.int64), 0, 0)
        pred = self._columns[top_k[0]] if top_k is not None else self._no_column()  # (unread without prefetches)
        pred = (pred.ptr, *(readonly(x) if x.flags.writeable else x for x in (pred.expert, pred.count, pred.rank)))
        args = []
        L = self._num_layers
        for layer in range(L):
            accepts, evicts, primary, stamp, clock = self._keyed_rows[layer]
            params = np.array([layer, self.capacities[layer], accepts, evicts, clock is not None, form.overlap,
                               form.pending_resident, w, u, top_k is not None and layer + 1 < L,
                               top_k[1] if top_k is not None else 0, self.prefetch_slots], np.int64)
            args.append((self._contents, self._totals, params, primary, stamp,
                         self._no_clock if clock is None else clock, times, float(form.transfer), state, *pred))
        kernel = kernels.entry(kernel, [self._segment_examples() + (0,) + a for a in args])
        return kernel, args, False

    @staticmethod
    def _time_tables(form) -> np.ndarray:
        """(2, C) float64: a form's GPU and CPU times by workload, cut to the shorter table."""
        C = min(len(form.gpu), len(form.cpu))
        return np.stack([np.asarray(form.gpu[:C], np.float64), np.asarray(form.cpu[:C], np.float64)])

    def _impact_args(self) -> tuple | None:
        """The view-free plan for HybriMoE: a placement with an HSS form (``PlacementPolicy.hss_form``), a cache
        with an MRS form (``CachePolicy.mrs_form``) and no prefetcher or one with an impact form
        (``PrefetchPolicy.impact_form``): every plan is one compiled call (``plan_kernel._impact_plan``)."""
        cache, placement, prefetcher = self.cache, self.placement, self.prefetcher
        if self._kernel is None or self._columns is None or placement.reads_future or self._swapping:
            return None
        mrs = cache.mrs_form()
        form = placement.hss_form(self.ctx) if mrs is not None else None
        prefetching = self._prefetching and type(prefetcher).prefetch is not NoPrefetch.prefetch
        impact = prefetcher.impact_form(self.ctx) if prefetching and form is not None else None
        if form is None or (prefetching and impact is None):
            return None
        columns = impact[1] if impact is not None else []
        if len(columns) > 3 or any(name not in self._predictors or self.w.predictor_offsets[name] < d
                                   for d, name in columns):
            return None  # (a column not loaded, or not that far ahead: the view path names the error)
        kernel = plan_kernel.compiled_impact()
        if kernel is None:
            return None
        score, stamp, clock, a, prefill_evicts = mrs
        times = self._time_tables(form)
        seen, _, threshold, k = impact if impact is not None else (np.zeros((1, 1), bool), None, 0.0, 0)
        fparams = np.array([a, threshold, form.transfer], np.float64)
        unused = self._no_column()
        sparse = []
        for slot in range(3):  # each column's sparse predictions (unread for an unused slot)
            sc = self._columns[columns[slot][1]] if slot < len(columns) else unused
            sparse += [readonly(x) if x.flags.writeable else x for x in (sc.ptr, sc.expert, sc.count)]
        L = self._num_layers
        args = []
        for layer in range(L):
            dists = [columns[s][0] if s < len(columns) and layer + columns[s][0] < L else 0 for s in range(3)]
            params = np.array([layer, self.capacities[layer], True, prefill_evicts, PREFILL, form.pending_resident,
                               form.single_token, impact is not None, k, self.prefetch_slots, *dists],
                              np.int64)
            args.append((self._contents, self._totals, params, fparams, times, score, stamp, clock, seen, *sparse))
        kernel = kernels.entry(kernel, [self._segment_examples() + (0, 0, 0) + a for a in args])
        return kernel, args, True

    def _lookahead(self, step: int, layer: int, what: str, name: str, target: int) -> np.ndarray:
        """``LayerView.lookahead`` (``what="counts"``), ``lookahead_rank`` (``"ranks"``) and ``lookahead_segment``
        (``"segment"``: read-only slices) of (step, layer), bound to them with ``functools.partial`` (made
        without a Python call at every view)."""
        if name not in self._predictors:
            known = ", ".join(self._predictors) or "none"
            raise ValueError(f"prefetch needs lookahead column {name!r}; loaded: {known}. "
                             "`dali trace record` records real ones; `dali trace synth --lookahead` makes synthetic ones")
        offset = self.w.predictor_offsets[name]
        if not layer < target <= layer + offset:
            raise ValueError(f"lookahead {name!r} made at layer {target - offset} is not known at layer {layer}")
        if what == "segment":
            ptr, experts, counts, ranks = self._predicted[name]
            i = step * self._num_layers + target
            lo, hi = ptr[i], ptr[i + 1]
            return experts[lo:hi], counts[lo:hi], ranks[lo:hi]
        read = self.w.predicted_counts if what == "counts" else self.w.predicted_ranks
        return readonly(read(name, step, target))

    def _true_counts(self, step: int, layer: int):
        def get(target: int) -> np.ndarray:
            if not layer < target < self.w.num_layers:
                raise ValueError(f"true counts of layer {target} asked at layer {layer}: later layers only")
            e, c, _ = self.w.activated(step, target)
            out = np.zeros(self.w.num_experts, np.int64)
            out[e] = c
            return readonly(out)
        return get

    def view(self, step: int, layer: int) -> LayerView:
        """The policies' view of the start of (step, layer)."""
        w = self.w
        # built without the frozen dataclass's per-field checks (it runs once per (step, layer)) and with as
        # few Python calls as it can: the workload's arrays read-only, the cache's rows as read-only copies
        experts, counts, ranks, phase, tokens = self._segment(step, layer)
        resident, pending = self.resident[layer].copy(), self.pending[layer].copy()
        resident.flags.writeable = pending.flags.writeable = False
        view = _new(LayerView)
        view.__dict__.update(
            step=step, layer=layer, phase=phase, tokens=tokens,
            experts=experts, counts=counts, ranks=ranks, resident=resident, pending=pending,
            num_layers=w.num_layers, num_experts=w.num_experts, costs=self.costs,
            lookahead=partial(self._lookahead, step, layer, "counts"),
            lookahead_rank=partial(self._lookahead, step, layer, "ranks"), true_counts=None,
            lookahead_segment=None if self._predicted is None else partial(self._lookahead, step, layer, "segment"),
        )
        return view

    def _view_for(self, policy, view: LayerView) -> LayerView:
        """Policies that read the future get the true later workloads; every other policy the plain view."""
        if not policy.reads_future:
            return view
        return dataclasses.replace(view, true_counts=self._true_counts(view.step, view.layer))

    def plan(self, step: int, layer: int) -> LayerPlan:
        """The plan of (step, layer); layers must be planned in order (:meth:`plans`).

        With a cache policy that has a keyed form and numba installed, everything after the placement but
        the prefetches and swaps runs as one compiled call (``dali_sim.runtime.plan_kernel``), which also
        counts the plan; with a placement's rule form and nothing else to ask the policies, the whole plan is
        one compiled call without a view (:meth:`_ruled_args`); otherwise (and as the reference)
        :meth:`plan_reference`: the same plans."""
        ruled = self._ruled
        if ruled is not None:
            experts, counts, _, phase, tokens = self._segment(step, layer)
            source, flags, out = ruled[0](experts, counts, tokens, *ruled[1][layer])
            row = out.tolist()  # as the keyed path's below; nothing prefetched, so the victims end it
            if row:  # (empty: the rule left an expert to the placement's place(), nothing changed)
                if (row[TALLY_FIRST_FETCH] >= 0 and not self.placement.may_fetch) or \
                        (self.staging_slots < 1 and row[TALLY_STAGED]):
                    self._refuse(step, layer, experts, row)
                return LayerPlan(step, layer, phase, tokens, experts, counts, flags[3], source, flags[0], flags[1],
                                 flags[2], row[TALLY_LEN + 1:], [], [], [], [], tuple(row[:TALLY_LEN]), out)
        fused = self._fused
        if fused is not None:
            experts, counts, _, phase, tokens = self._segment(step, layer)
            row_step = 0 if self._online else step  # (the step's segments of the prediction columns)
            if fused[2]:
                source, flags, out = fused[0](experts, counts, row_step, phase, tokens, *fused[1][layer])
            else:
                source, flags, out = fused[0](experts, counts, row_step, *fused[1][layer])
            row = out.tolist()
            if row:  # (empty: a workload beyond the cost tables, left to the policies with a view; nothing changed)
                return self._fused_plan(step, layer, phase, tokens, experts, counts, source, flags, row, out)
        kernel = self._kernel
        if kernel is None:
            return self.plan_reference(step, layer)
        view = self.view(step, layer)
        cache = self.cache
        if self._observes:
            cache.observe(view)
        experts = view.experts
        on_gpu = self._place(view)
        keyed = self._keyed_rows
        accepts, evicts, primary, stamp, clock = keyed[layer] if keyed is not None else cache.keyed_form(layer, view)
        source, flags, out = kernel(
            experts, view.counts, on_gpu, self.resident[layer], self.pending[layer], layer,
            int(self.capacities[layer]), self.n_resident, self.n_pending, bool(accepts), bool(evicts), primary, stamp,
            self._no_clock if clock is None else clock, clock is not None)
        row = out.tolist()  # the tally, the first expert fetched on demand, the lists (plan_kernel)
        if (row[TALLY_FIRST_FETCH] >= 0 and not self.placement.may_fetch) or \
                (self.staging_slots < 1 and row[TALLY_STAGED]):
            self._refuse(step, layer, experts, row)
        n_evicted, n_used = row[TALLY_EVICTED], row[TALLY_PREFETCH_USED]
        self._pending_total -= n_used + row[TALLY_WASTED]  # the layer's prefetches were used or wasted
        prefetches = self._issue_prefetches(view) if self._prefetching else []
        swaps = self._apply_swaps(view, layer) if self._swapping else []
        row[TALLY_PREFETCHES] = len(prefetches)
        row[TALLY_SWAPS] = len(swaps)
        lists = TALLY_LEN + 1 + n_evicted  # where the prefetches used start
        return LayerPlan(step, layer, view.phase, view.tokens, experts, view.counts, on_gpu, source, flags[0],
                         flags[1], flags[2], row[TALLY_LEN + 1:lists], prefetches, row[lists:lists + n_used],
                         row[lists + n_used:], swaps, tuple(row[:TALLY_LEN]), out)

    def _fused_plan(self, step, layer, phase, tokens, experts, counts, source, flags, row, out) -> LayerPlan:
        """The :class:`LayerPlan` of ``plan_kernel._greedy_plan``'s or ``_impact_plan``'s answer (its checks as
        :meth:`plan`'s)."""
        if (row[TALLY_FIRST_FETCH] >= 0 and not self.placement.may_fetch) or \
                (self.staging_slots < 1 and row[TALLY_STAGED]):
            self._refuse(step, layer, experts, row)
        n_evicted, n_used, n_wasted = row[TALLY_EVICTED], row[TALLY_PREFETCH_USED], row[TALLY_WASTED]
        n_issued = row[TALLY_PREFETCHES]
        lists = TALLY_LEN + 1 + n_evicted  # where the prefetches used start
        issued = lists + n_used + n_wasted  # where the issued prefetches start
        if n_issued < 0:
            self._pending_total -= n_used + n_wasted
            self._bad_prefetch(SimpleNamespace(layer=layer), row[issued], row[issued + 1])
        self._pending_total += n_issued - n_used - n_wasted
        swapped = issued + 2 * n_issued
        # (most visits issue nothing and swap nothing: their empty lists without the slices and zips)
        return LayerPlan(step, layer, phase, tokens, experts, counts, flags[3], source, flags[0], flags[1], flags[2],
                         row[TALLY_LEN + 1:lists],
                         list(zip(row[issued:swapped:2], row[issued + 1:swapped:2])) if n_issued else [],
                         row[lists:lists + n_used], row[lists + n_used:issued],
                         list(zip(row[swapped::2], row[swapped + 1::2])) if len(row) > swapped else [],
                         tuple(row[:TALLY_LEN]), out)

    def _place(self, view: LayerView) -> np.ndarray:
        """The placement's (n,) bool mask, checked."""
        placement = self.placement
        on_gpu = np.asarray(placement.place(self._view_for(placement, view) if placement.reads_future else view),
                            dtype=bool)
        n = len(view.experts)
        if on_gpu.shape != (n,):
            raise ValueError(f"placement {self.placement.name!r} returned shape {on_gpu.shape}, expected ({n},)")
        return on_gpu

    def _refuse(self, step: int, layer: int, experts: np.ndarray, row: list[int]):
        """The compiled path's plan breaks a rule (an expert fetched by a placement that never fetches, or
        staged without staging buffers): the reference's error."""
        if row[TALLY_FIRST_FETCH] >= 0 and not self.placement.may_fetch:
            self._never_fetches(layer, int(experts[row[TALLY_FIRST_FETCH]]))
        raise ValueError(f"step {step} layer {layer}: an expert must be staged but memory.staging_slots is 0")

    def _never_fetches(self, layer: int, expert: int):
        raise ValueError(f"placement {self.placement.name!r} never fetches, but it put expert {expert} of layer "
                         f"{layer} on the GPU while it is not resident: the cache must hold every expert this "
                         "placement runs on the GPU (check memory.layout and memory.cache_init)")

    def plan_reference(self, step: int, layer: int) -> LayerPlan:
        """:meth:`plan` in NumPy and the policies' batch or per-expert hooks: the reference of the compiled
        path, and the path of every cache policy without a keyed form."""
        view = self.view(step, layer)
        cache = self.cache
        cache.observe(view)
        experts = view.experts
        n = len(experts)
        on_gpu = self._place(view)
        resident = self.resident[layer]
        pending = self.pending[layer]
        n_pending = self.n_pending[layer]
        hit = resident[experts]  # fancy indexing copies: the contents at the start of the layer
        nz = np.count_nonzero
        if not nz(on_gpu):  # (no expert on the GPU: nothing moves)
            source = np.full(n, CPU, np.int8)
            admitted, staged = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
            evicted: list[int] = []
            if nz(hit):  # resident experts run on the CPU: the cache is told of the touches
                if cache.batched:
                    cache.touched(layer, experts[hit], admitted[hit], view)
                else:
                    for e in experts[hit].tolist():
                        cache.on_hit(layer, e, view)
        else:
            miss = on_gpu & ~hit  # weights must come to the GPU: prefetched or fetched on demand
            code = (on_gpu.view(np.uint8) << 2) | (hit.view(np.uint8) << 1)
            if n_pending:
                code |= pending[experts].view(np.uint8)
            source = _SOURCE_OF[code]
            fetch = source == FETCH
            if not self.placement.may_fetch and nz(fetch):
                self._never_fetches(layer, int(experts[fetch][0]))
            if cache.batched:
                admitted, evicted = self._admit_batched(view, layer, experts, hit, miss)
            else:
                admitted, evicted = self._admit_each(view, layer, experts, hit, source)
            staged = fetch & ~admitted  # a declined prefetched expert is used from its prefetch buffer
            if self.staging_slots < 1 and nz(staged):
                raise ValueError(f"step {step} layer {layer}: an expert must be staged but memory.staging_slots is 0")

        prefetch_used: list[int] = []
        prefetch_wasted: list[int] = []
        if n_pending:
            was = np.flatnonzero(pending)
            used = np.zeros(self.w.num_experts, dtype=bool)
            used[experts[source == PREFETCHED]] = True
            prefetch_used, prefetch_wasted = was[used[was]].tolist(), was[~used[was]].tolist()
            pending[:] = False
            self._pending_total -= int(self.n_pending[layer])
            self.n_pending[layer] = 0

        prefetches = self._issue_prefetches(view) if self._prefetching else []
        swaps = self._apply_swaps(view, layer) if self._swapping else []
        return LayerPlan(step, layer, view.phase, view.tokens, experts, view.counts, on_gpu, source, hit,
                         admitted, staged, evicted, prefetches, prefetch_used, prefetch_wasted, swaps)

    def _activated(self, experts: np.ndarray) -> np.ndarray:
        activated = np.zeros(self.w.num_experts, dtype=bool)
        activated[experts] = True
        return activated

    def _admit_each(self, view: LayerView, layer: int, experts: np.ndarray, hit: np.ndarray,
                    source: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """The cache semantics expert by expert, in touch order (any cache policy)."""
        cache, resident, step = self.cache, self.resident[layer], view.step
        activated = self._activated(experts)
        admitted = np.zeros(len(experts), dtype=bool)
        evicted: list[int] = []
        cap = int(self.capacities[layer])
        for i, (e, is_hit, src) in enumerate(zip(experts.tolist(), hit.tolist(), source.tolist())):
            if is_hit:
                cache.on_hit(layer, e, view)
                continue
            if src == CPU:
                continue  # its weights never reach the GPU: nothing to admit
            if self.n_resident[layer] < cap:
                ok = cache.accepts(layer, e, view)
            else:
                evictable = np.flatnonzero(resident & ~activated)
                victim = cache.victim(layer, e, view, readonly(evictable)) if evictable.size else None
                if victim is not None:
                    self._check_victims(step, layer, np.array([victim]), resident & ~activated)
                    resident[victim] = False
                    self.n_resident[layer] -= 1
                    cache.on_evict(layer, int(victim))
                    evicted.append(int(victim))
                ok = victim is not None
            if ok:
                resident[e] = True
                self.n_resident[layer] += 1
                admitted[i] = True
                cache.on_admit(layer, e, view)
        return admitted, evicted

    def _admit_batched(self, view: LayerView, layer: int, experts: np.ndarray, hit: np.ndarray,
                       miss: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """The same semantics in one go, for a policy with the batch form (``CachePolicy.victim_order``):
        the misses (GPU experts not resident, touch order) first fill free slots if the policy accepts,
        then take the victims in the policy's order while evictable entries last; the rest are declined."""
        cache, resident = self.cache, self.resident[layer]
        admitted = np.zeros(len(experts), dtype=bool)
        victims = experts[:0]
        cand = np.flatnonzero(miss)
        m = len(cand)
        if m:
            free = int(self.capacities[layer] - self.n_resident[layer])
            take = 0
            refused = free > 0 and not cache.accepts(layer, int(experts[cand[0]]), view)
            if not refused:
                take = min(max(free, 0), m)
                rest = m - take
                if rest:
                    evictable_mask = resident.copy()
                    evictable_mask[experts] = False  # activated experts are not evictable
                    evictable = np.flatnonzero(evictable_mask)
                    if len(evictable):
                        victims = np.asarray(cache.victim_order(layer, view, readonly(evictable)))[:rest]
                        if len(victims):
                            self._check_victims(view.step, layer, victims, evictable_mask)
            admitted[cand[:take + len(victims)]] = True
            if len(victims):
                resident[victims] = False
                cache.evicted(layer, victims)
            resident[experts[admitted]] = True
            self.n_resident[layer] += take
        touched = hit | admitted
        if np.count_nonzero(touched):
            cache.touched(layer, experts[touched], admitted[touched], view)
        return admitted, victims.tolist()

    def _check_victims(self, step: int, layer: int, victims: np.ndarray, evictable_mask: np.ndarray) -> None:
        """The victims are distinct evictable entries (resident, not activated), else the policy's error.
        ``evictable_mask`` (E,) bool is the caller's scratch copy: the victims are cleared in it."""
        before = np.count_nonzero(evictable_mask)
        was = evictable_mask.copy()
        try:
            evictable_mask[victims] = False
            ok = before - np.count_nonzero(evictable_mask) == len(victims)  # each one evictable, none twice
        except IndexError:
            ok = False
        if not ok:
            raise ValueError(f"cache policy {self.cache.name!r} chose victim(s) {np.asarray(victims).tolist()} at step "
                             f"{step} layer {layer}, not evictable entries of {np.flatnonzero(was).tolist()}")

    def _issue_prefetches(self, view: LayerView) -> list[tuple[int, int]]:
        """The prefetcher's requests in its order, skipping resident, pending and repeated ones, while
        prefetch buffers are free."""
        free = self.prefetch_slots - self._pending_total
        if free <= 0:
            return []
        prefetcher = self.prefetcher
        asked = prefetcher.prefetch(self._view_for(prefetcher, view) if prefetcher.reads_future else view)
        if not len(asked):
            return []
        if isinstance(asked, np.ndarray) and asked.dtype == np.int64 and asked.ndim == 2 and asked.shape[1] == 2 \
                and self._issue_kernel is not None:  # the same rule in one compiled call
            flat, bad = self._issue_kernel(asked, self.resident, self.pending, self.n_pending, view.layer, free)
            issued = flat.tolist()
            self._pending_total += len(issued) // 2
            if bad >= 0:
                self._bad_prefetch(view, *asked[bad].tolist())
            return list(zip(issued[0::2], issued[1::2]))
        if len(asked) <= 32 and (asked.ndim == 2 and asked.shape[1] == 2 if isinstance(asked, np.ndarray)
                                 else all(len(p) == 2 for p in asked)):  # a few pairs: the same rule on ints
            return self._issue_few(view, asked, free)
        pairs = np.asarray(asked, dtype=np.int64).reshape(-1, 2)
        target, e = pairs[:, 0], pairs[:, 1]
        valid = (view.layer < target) & (target < self.w.num_layers) & (0 <= e) & (e < self.w.num_experts)
        n_valid = len(pairs) if valid.all() else int(np.argmax(~valid))
        issued = self._take_prefetches(target[:n_valid], e[:n_valid], free)
        if n_valid < len(pairs) and len(issued) < free:  # the request was reached before the buffers ran out
            self._bad_prefetch(view, *pairs[n_valid].tolist())
        return issued

    def _bad_prefetch(self, view: LayerView, t: int, x: int):
        raise ValueError(f"prefetch policy {self.prefetcher.name!r} asked for (layer {t}, expert {x}) "
                         f"at layer {view.layer}; targets must be later layers of the same step")

    def _issue_few(self, view: LayerView, asked, free: int) -> list[tuple[int, int]]:
        """:meth:`_issue_prefetches` after the policy's answer, for a short one, one request at a time."""
        pairs = asked.tolist() if isinstance(asked, np.ndarray) else asked
        L, E = self.w.num_layers, self.w.num_experts
        resident, pending = self.resident, self.pending
        issued: list[tuple[int, int]] = []
        seen: set[tuple[int, int]] = set()
        for pair in pairs:
            t, x = (int(v) for v in pair)
            if not (view.layer < t < L and 0 <= x < E):
                if len(issued) < free:  # the request was reached before the buffers ran out
                    self._bad_prefetch(view, t, x)
                break
            if (t, x) in seen:
                continue  # the first request of each (layer, expert) counts
            seen.add((t, x))
            if not resident[t, x] and not pending[t, x]:
                issued.append((t, x))
                if len(issued) == free:
                    break  # the buffers ran out: later requests change nothing (nor are they checked)
        for t, x in issued:
            pending[t, x] = True
            self.n_pending[t] += 1
        self._pending_total += len(issued)
        return issued

    def _take_prefetches(self, target: np.ndarray, e: np.ndarray, free: int) -> list[tuple[int, int]]:
        key = target * self.w.num_experts + e
        first = np.zeros(len(key), dtype=bool)  # the first request of each (layer, expert) counts
        first[np.unique(key, return_index=True)[1]] = True
        keep = np.flatnonzero(first & ~self.resident[target, e] & ~self.pending[target, e])[:free]
        target, e = target[keep], e[keep]
        self.pending[target, e] = True
        np.add.at(self.n_pending, target, 1)
        self._pending_total += len(keep)
        return list(zip(target.tolist(), e.tolist()))

    def _apply_swaps(self, view: LayerView, layer: int) -> list[tuple[int, int]]:
        if not self._swapping:
            return []  # the policy never swaps
        resident = self.resident[layer]
        contents = resident.copy()
        contents.flags.writeable = False
        swaps = self.cache.rebalance(view, contents)
        if not len(swaps):
            return []
        for e_in, e_out in swaps:
            if resident[e_in] or not resident[e_out]:
                raise ValueError(f"cache policy {self.cache.name!r} swap ({e_in} in, {e_out} out) at layer {layer} "
                                 "must bring in a non-resident expert for a resident one")
            resident[e_out] = False
            resident[e_in] = True
            if self._told_of_swaps:
                self.cache.on_evict(layer, int(e_out))
                self.cache.on_admit(layer, int(e_in), view)
        return [(int(a), int(b)) for a, b in swaps]

    def plans(self):
        """All plans in execution order: step by step, layer by layer."""
        for step in range(self.w.num_steps):
            for layer in range(self.w.num_layers):
                yield self.plan(step, layer)
