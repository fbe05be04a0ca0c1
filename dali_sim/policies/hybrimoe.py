"""HybriMoE (Zhong et al., DAC 2025, arXiv 2504.05897; code: github.com/PKU-SEC-Lab/HybriMoE, a fork of
kTransformers): hybrid CPU-GPU scheduling, the MRS score cache and impact-driven prefetching. Sources,
readings and parameter choices in docs/policies.md ("HybriMoE").

* ``hybrimoe`` (placement): dynamic intra-layer scheduling. ``mode=hss`` (the default) is the released
  code's ``KExpertsCache.HSS`` (HybridSchedulingStrategy, ktransformers/operators/experts.py): the
  activated experts are listed cached first (descending load), then uncached (descending load); the GPU
  takes the head of the list, the CPU the tail, one at a time: whichever finishes sooner with its
  candidate takes it (the GPU on ties), a head that is not cached waits for its copy, copies run back to
  back. The GPU thus runs cached experts (highest load first) then copied ones; the CPU runs the
  uncached ones from the lowest load up and, when the GPU is the bottleneck, even cached ones.
  ``mode=best`` and ``mode=greedy`` are our readings of the paper's description written before the code
  was at hand (every prefix of the uncached list simulated, smallest makespan; the CPU and the link each
  taking their next expert when free): :func:`hybrid_schedule`. ``hss_steps=single-token`` is the released
  code's ``generate = input_tensor.size(0) == 1``: a step of more tokens runs every activated expert on
  the GPU (``calc_experts`` outside ``generate``), the schedule is for one-token steps only.
* ``hybrimoe-mrs`` (cache): Minus Recent Score (``KScoreAwareCache``). Per layer, at every visit,
  ``S <- a * TopP(s) + (1 - a) * S`` (a = 0.5 in the code); experts outside TopP decay by ``1 - a``; a full
  cache evicts the lowest score (ties: least recently used, as the code's ``argmin`` over its LRU-ordered
  dict); in prefill a full cache does not evict (the code loads misses into a one-layer buffer).
  ``TopP(s)`` here is the fraction of the step's tokens routed to each activated expert (views carry
  workloads, not router probabilities; the code uses the first token's top-2k softmax scores).
* ``hybrimoe`` (prefetch): ``source=impact`` (default): impact-driven prefetching as the paper describes
  it, from the predicted routing of the next 3 layers (one lookahead column per distance): per target
  layer, the prefix of its predicted, uncached experts (descending predicted load) whose presence on the
  GPU most lowers that layer's simulated makespan (the same schedule on the predicted workloads); layers'
  prefixes are requested by gain per copy, largest first (ties: the nearer layer). ``source=score``: the
  released code's ``prefetch_expert``: the ``k`` experts of the next layer with the highest MRS score.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from dali_sim.policies import kernels
from dali_sim.policies.base import (
    CACHES,
    PLACEMENTS,
    PREFETCHERS,
    HSSForm,
    LayerView,
    PlacementPolicy,
    PolicyConfig,
    PrefetchPolicy,
    SetupContext,
    registered,
)
from dali_sim.policies.cache import LRU
from dali_sim.trace.schema import PREFILL

MODES = ("hss", "best", "greedy")
HSS_STEPS = ("all", "single-token")
SOURCES = ("impact", "score")
_NAME = re.compile(r"^[A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Schedule:
    """The outcome of :func:`hybrid_schedule` for one layer (arrays aligned with the inputs)."""

    on_gpu: np.ndarray  # bool: experts run on the GPU (cached or fetched)
    fetched: np.ndarray  # bool: uncached experts brought over PCIe
    makespan: float  # max(GPU lane end, CPU lane end), both from 0
    gpu_end: float
    cpu_end: float
    makespans: np.ndarray  # makespan for m = 0..U fetched (the U uncached in descending-load order)


def _hss(counts, cached, t_gpu, t_cpu, xfer: float) -> tuple[np.ndarray, np.ndarray, float, float]:
    """The released code's HybridSchedulingStrategy (``KExpertsCache.HSS``): (on_gpu, fetched, GPU end, CPU end).

    The list is the cached experts by descending load, then the uncached ones by descending load (ties:
    input order). While experts remain, the GPU's candidate is the head, the CPU's the tail: the head
    would end on the GPU at ``g + t_gpu``, where an uncached head first waits for its copy (copies back
    to back from 0: it lands at ``moved + xfer``, so the GPU ends at ``max(g, moved + xfer) + t_gpu``);
    the tail would end on the CPU at ``c + t_cpu``. The GPU takes its candidate iff it ends no later,
    else the CPU takes its own. (The code adds per-device intercepts to the first expert of each queue;
    here the cost model's times are used as they are.) The loop is ``kernels._hss``.
    """
    by_load = np.lexsort((np.arange(counts.shape[0]), -np.asarray(counts)))  # descending load, ties: index
    order = np.concatenate([by_load[cached[by_load]], by_load[~cached[by_load]]])
    on_gpu, fetched, g, c = kernels.run("hss", order, np.asarray(cached, dtype=bool), np.asarray(t_gpu, dtype=float),
                                        np.asarray(t_cpu, dtype=float), float(xfer))
    return np.asarray(on_gpu, dtype=bool), np.asarray(fetched, dtype=bool), float(g), float(c)


def hybrid_schedule(counts, cached, t_gpu, t_cpu, xfer: float, mode: str = "hss") -> Schedule:
    """HybriMoE's intra-layer schedule.

    ``counts`` (n,) workloads, ``cached`` (n,) bool (weights on the GPU: resident or prefetched),
    ``t_gpu``/``t_cpu`` (n,) compute times of each expert at its workload, ``xfer`` one expert's copy.

    ``hss`` (default): the released code's greedy (:func:`_hss`).

    ``best`` and ``greedy`` (our earlier readings): the GPU runs every cached expert first (all present
    at time 0), then the fetched ones in arrival order; copies run back to back from time 0 in descending
    load (ties: lower index first); the CPU runs the rest back to back. With m fetched: transfer i lands
    at (i+1) * xfer, the GPU lane ends at ``g_m`` with ``g_0 = sum t_gpu(cached)`` and
    ``g_{i+1} = max(g_i, (i+1) * xfer) + t_gpu(u_i)``, the CPU lane at the sum of t_cpu over the uncached
    experts not fetched. ``best``: the m with the smallest makespan (ties: fewer copies). ``greedy``: the
    CPU (from the low-load end) and the link (from the high-load end) each take the next remaining expert
    when free (the CPU first on equal times) until none is left.

    ``makespans`` is the prefix model's makespan for every m, whatever the mode.
    """
    if mode not in MODES:
        raise ValueError(f"hybrimoe schedule mode must be one of {', '.join(MODES)}, got {mode!r}")
    counts = np.asarray(counts)
    cached = np.asarray(cached, dtype=bool)
    t_gpu = np.asarray(t_gpu, dtype=float)
    t_cpu = np.asarray(t_cpu, dtype=float)
    n = counts.shape[0]
    idx = np.arange(n)
    unc = idx[~cached]
    unc = unc[np.lexsort((unc, -counts[unc]))]  # descending load, ties: lower index
    g = float(t_gpu[cached].sum())
    gpu_end = np.empty(unc.size + 1)
    gpu_end[0] = g
    for i, e in enumerate(unc.tolist()):
        g = max(g, (i + 1) * xfer) + float(t_gpu[e])
        gpu_end[i + 1] = g
    # cpu_end[m] = sum of t_cpu over unc[m:]
    cpu_end = np.concatenate([np.cumsum(t_cpu[unc][::-1])[::-1], [0.0]]) if unc.size else np.zeros(1)
    makespans = np.maximum(gpu_end, cpu_end)
    if mode == "hss":
        on_gpu, fetched, g_end, c_end = _hss(counts, cached, t_gpu, t_cpu, float(xfer))
        return Schedule(on_gpu=on_gpu, fetched=fetched, makespan=max(g_end, c_end), gpu_end=g_end, cpu_end=c_end,
                        makespans=makespans)
    if mode == "best":
        m = int(np.argmin(makespans))  # first minimum: fewest copies
    else:
        lo, hi = 0, unc.size  # remaining: unc[lo:hi]; the CPU takes unc[hi-1], the link unc[lo]
        t_c = t_l = 0.0
        while lo < hi:
            if t_c <= t_l:
                hi -= 1
                t_c += float(t_cpu[unc[hi]])
            else:
                t_l += xfer
                lo += 1
        m = lo
    fetched = np.zeros(n, dtype=bool)
    fetched[unc[:m]] = True
    return Schedule(on_gpu=cached | fetched, fetched=fetched, makespan=float(makespans[m]),
                    gpu_end=float(gpu_end[m]), cpu_end=float(cpu_end[m]), makespans=makespans)


def expert_times(costs, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Per expert with ``counts`` tokens: its seconds on the GPU and on the CPU, and one expert's copy."""
    c = np.asarray(counts).astype(np.int64)  # predicted counts come as floats
    t_gpu = np.asarray(costs.expert_time("gpu", c), dtype=float).reshape(c.shape)
    t_cpu = np.asarray(costs.expert_time("cpu", c), dtype=float).reshape(c.shape)
    return t_gpu, t_cpu, float(costs.expert_transfer_time())


# ---- placement ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HybriMoEPlacementConfig(PolicyConfig):
    mode: str = field(default="hss", metadata={
        "help": "hss: the released code's HybridSchedulingStrategy (the GPU takes cached then copied experts "
                "from the high-load end, the CPU from the low-load end, whichever ends sooner); best (ours): "
                "simulate every number of fetched experts and keep the smallest makespan; greedy (ours): the "
                "CPU and PCIe take experts as they become free"})
    pending_resident: bool = field(default=True, metadata={
        "help": "a prefetched expert (in flight or landed) counts as cached (on the GPU, no copy)"})
    hss_steps: str = field(default="all", metadata={
        "help": "all: schedule every step; single-token: the released code (KExpertsMarlin.forward, generate = "
                "input_tensor.size(0) == 1) schedules one-token steps only and runs every activated expert of a "
                "step of more tokens on the GPU (cached ones from the cache, the rest copied)"})

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"placement.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.hss_steps not in HSS_STEPS:
            raise ValueError(f"placement.hss_steps must be one of {', '.join(HSS_STEPS)}, got {self.hss_steps!r}")


@registered(PLACEMENTS)
class HybriMoEPlacement(PlacementPolicy[HybriMoEPlacementConfig]):
    name = "hybrimoe"
    description = ("HybriMoE's dynamic intra-layer scheduling (the released code's HSS by default): cached experts "
                   "from the high-load end to the GPU, uncached ones from the low-load end to the CPU, the "
                   "high-load uncached ones copied over PCIe, whichever device ends sooner taking the next")
    Config = HybriMoEPlacementConfig

    def schedule(self, view: LayerView) -> Schedule:
        t_gpu, t_cpu, xfer = expert_times(view.costs, view.counts)
        return hybrid_schedule(view.counts, self._cached(view), t_gpu, t_cpu, xfer, self.config.mode)

    def place(self, view: LayerView) -> np.ndarray:
        if self.config.hss_steps == "single-token" and view.tokens > 1:
            return np.ones(len(view.experts), dtype=bool)  # the code's all-GPU path (calc_experts, not generate)
        if self.config.mode != "hss":
            return self.schedule(view).on_gpu
        t_gpu, t_cpu, xfer = expert_times(view.costs, view.counts)  # HSS alone: no prefix model needed
        return _hss(np.asarray(view.counts), self._cached(view), t_gpu, t_cpu, xfer)[0]

    def hss_form(self, ctx: SetupContext) -> HSSForm | None:
        tables = kernels.cost_tables(self, ctx.costs)
        if type(self) is not HybriMoEPlacement or self.config.mode != "hss" or tables is None:
            return None
        gpu, cpu, xfer = tables
        return HSSForm(gpu, cpu, xfer, bool(self.config.pending_resident), self.config.hss_steps == "single-token")

    def _cached(self, view: LayerView) -> np.ndarray:
        cached = view.resident[view.experts]
        return cached | view.pending[view.experts] if self.config.pending_resident else cached


# ---- cache ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MRSConfig(PolicyConfig):
    a: float = field(default=0.5, metadata={
        "help": "weight of the current step in S <- a * TopP(s) + (1 - a) * S (0 < a <= 1; the code: 0.5)"})
    prefill_evicts: bool = field(default=False, metadata={
        "help": "whether a full cache evicts during prefill; the code never does (misses are loaded into a "
                "one-layer buffer), so a fetched expert is then staged"})


    def __post_init__(self) -> None:
        if isinstance(self.a, bool) or not isinstance(self.a, (int, float)) or not 0.0 < float(self.a) <= 1.0:
            raise ValueError(f"cache.a must be a number in (0, 1], got {self.a!r}")


def mrs_update(score: np.ndarray, experts: np.ndarray, counts: np.ndarray, tokens: int, a: float) -> np.ndarray:
    """One MRS update of a layer's (E,) scores: ``a * TopP(s) + (1 - a) * S``, with ``TopP(s)`` = the
    fraction of the step's tokens routed to each activated expert (0 for the others)."""
    s = np.zeros_like(score, dtype=float)
    if tokens > 0:
        s[np.asarray(experts)] = np.asarray(counts, dtype=float) / tokens
    return a * s + (1.0 - a) * score


@registered(CACHES)
class MRSCache(LRU):
    """LRU's bookkeeping (use stamps) breaks ties between equal scores, as the released code's LRU-ordered
    dict does."""

    name = "hybrimoe-mrs"
    description = ("HybriMoE's Minus Recent Score cache: per layer S <- a*TopP(s) + (1-a)*S at every visit; "
                   "evict the evictable entry with the lowest score (ties: least recently used); always admits "
                   "into a free slot; a full cache does not evict in prefill")
    Config = MRSConfig

    def setup(self, ctx: SetupContext) -> None:
        super().setup(ctx)  # initial contents count as used before everything else, in id order
        self.score = np.zeros((ctx.num_layers, ctx.num_experts), dtype=float)

    def observe(self, view: LayerView) -> None:
        update = kernels.fused("mrs_update")
        if update is not None:  # the same update in place, in one call
            update(self.score[view.layer], view.experts, view.counts, view.tokens, float(self.config.a))
            return
        self.score[view.layer] = mrs_update(self.score[view.layer], view.experts, view.counts, view.tokens,
                                            float(self.config.a))

    def victim(self, layer: int, expert: int, view: LayerView, evictable: np.ndarray) -> int | None:
        order = self.victim_order(layer, view, evictable)
        return int(order[0]) if order.size else None

    def victim_order(self, layer: int, view: LayerView, evictable: np.ndarray) -> np.ndarray:
        if view.phase == PREFILL and not self.config.prefill_evicts:
            return evictable[:0]
        # lowest score; ties: least recently used, then lower id (scores change in observe only)
        return evictable[np.lexsort((evictable, self.stamp[layer, evictable], self.score[layer, evictable]))]

    def keyed_form(self, layer: int, view: LayerView):
        evicts = view.phase != PREFILL or self.config.prefill_evicts
        return True, evicts, self.score[layer], self.stamp[layer], self._clock

    def mrs_form(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, bool] | None:
        if type(self) is not MRSCache:  # (a subclass may observe or evict otherwise)
            return None
        return self.score, self.stamp, self._clock, float(self.config.a), bool(self.config.prefill_evicts)


# ---- prefetch -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HybriMoEPrefetchConfig(PolicyConfig):
    source: str = field(default="impact", metadata={
        "help": "impact: the paper's impact-driven prefetching from the predicted routing of layers l+1..l+3; "
                "score: the released code's prefetch_expert, the k experts of layer l+1 with the highest MRS "
                "score (no lookahead column)"})
    predictor1: str = field(default="next-gate", metadata={
        "help": "impact: lookahead column predicting layer l+1 ('' = skip this distance)"})
    predictor2: str = field(default="gate2", metadata={
        "help": "impact: lookahead column predicting layer l+2 (target_offset >= 2; '' = skip)"})
    predictor3: str = field(default="gate3", metadata={
        "help": "impact: lookahead column predicting layer l+3 (target_offset >= 3; '' = skip)"})
    k: int = field(default=0, metadata={
        "help": "impact: request at most k experts per layer, largest gain first; 0 = every expert with a gain "
                "(the runtime drops what does not fit memory.prefetch_slots). score: the code's prefetch_size "
                "(>= 1)"})
    min_gain: float = field(default=-1.0, metadata={
        "help": "impact: request a layer's prefix only if its makespan gain per copy is at least this many "
                "seconds; -1 = one expert's transfer time (a copy must save more than the PCIe time it takes); "
                "0 = any gain"})
    schedule: str = field(default="hss", metadata={
        "help": "impact: the schedule simulated on the predicted workloads (hss, best or greedy, as "
                "placement.mode)"})
    a: float = field(default=0.5, metadata={
        "help": "score: the MRS weight a, as cache.a"})

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"prefetch.source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        for name in ("predictor1", "predictor2", "predictor3"):
            v = getattr(self, name)
            if not isinstance(v, str) or not _NAME.match(v):
                raise ValueError(f"prefetch.{name} must be a lookahead column name or '', got {v!r}")
        if self.source == "impact" and not any((self.predictor1, self.predictor2, self.predictor3)):
            raise ValueError("hybrimoe prefetch needs at least one of prefetch.predictor1..3")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"prefetch.k must be an integer >= 0, got {self.k!r}")
        if self.source == "score" and self.k < 1:
            raise ValueError("prefetch.source=score needs prefetch.k >= 1 (the code's prefetch_size)")
        if not isinstance(self.min_gain, (int, float)) or isinstance(self.min_gain, bool) or \
                (self.min_gain < 0 and self.min_gain != -1):
            raise ValueError(f"prefetch.min_gain must be >= 0 seconds or -1 (one transfer time), got {self.min_gain!r}")
        if self.schedule not in MODES:
            raise ValueError(f"prefetch.schedule must be one of {', '.join(MODES)}, got {self.schedule!r}")
        if isinstance(self.a, bool) or not isinstance(self.a, (int, float)) or not 0.0 < float(self.a) <= 1.0:
            raise ValueError(f"prefetch.a must be a number in (0, 1], got {self.a!r}")


def impact_prefix(pred: np.ndarray, cached: np.ndarray, costs, mode: str = "hss") -> tuple[list[int], float]:
    """The experts worth prefetching for one layer and the gain per copy.

    ``pred`` (E,) predicted workloads, ``cached`` (E,) bool. The candidates are the predicted, uncached
    experts by descending predicted load (ties: lower id), the order in which the schedule fetches
    them. Bringing the first j of them to the GPU lowers the layer's simulated makespan (the ``mode``
    schedule on the predicted workloads) by ``G_j``; the prefix with the largest ``G_j`` (the shortest
    on ties) is returned with ``G_j / j``, or ``([], 0)`` if no prefix gains. Prefixes, not single
    experts: at batch 1 one expert alone often gains nothing (its partner still runs on the CPU for as
    long) while both together do.
    """
    pred = np.asarray(pred)
    fused = kernels.fused("impact_prefix") if mode == "hss" else None
    table = getattr(costs, "expert_time_table", None)
    if fused is not None and table is not None and pred.ndim == 1:
        gpu, cpu = table("gpu"), table("cpu")
        if pred.size and pred.max() < min(len(gpu), len(cpu)):  # every time a table lookup
            best_gain, best_j, order = fused(pred.astype(np.float64, copy=False), np.asarray(cached, dtype=bool),
                                             gpu, cpu, float(costs.expert_transfer_time()))
            return (order[:best_j].tolist(), float(best_gain) / best_j) if best_j else ([], 0.0)
    experts = np.flatnonzero(pred > 0)
    if experts.size == 0:
        return [], 0.0
    counts = pred[experts]
    c = np.asarray(cached, dtype=bool)[experts].copy()
    t_gpu, t_cpu, xfer = expert_times(costs, counts)
    cand = np.flatnonzero(~c)
    cand = cand[np.lexsort((experts[cand], -counts[cand]))]
    if mode == "hss":  # the default: every prefix's schedule in one compiled loop
        by_load = np.lexsort((np.arange(len(counts)), -counts))
        best_gain, best_j = kernels.run("impact", by_load, c, t_gpu, t_cpu, xfer, cand)
    else:
        base = hybrid_schedule(counts, c, t_gpu, t_cpu, xfer, mode).makespan
        best_gain, best_j = 0.0, 0
        for j, i in enumerate(cand.tolist(), start=1):
            c[i] = True
            gain = base - hybrid_schedule(counts, c, t_gpu, t_cpu, xfer, mode).makespan
            if gain > best_gain:
                best_gain, best_j = gain, j
    if best_j == 0:
        return [], 0.0
    return [int(e) for e in experts[cand[:best_j]]], float(best_gain) / best_j


@registered(PREFETCHERS)
class HybriMoEPrefetch(PrefetchPolicy[HybriMoEPrefetchConfig]):
    name = "hybrimoe"
    description = ("HybriMoE's impact-driven prefetching: from the predicted routing of layers l+1..l+3, the experts "
                   "whose presence on the GPU most reduces that layer's simulated makespan, largest gain first "
                   "(source=score: the released code's top-k of the next layer by MRS score)")
    Config = HybriMoEPrefetchConfig

    def _columns(self) -> list[tuple[int, str]]:
        c = self.config
        if c.source != "impact":
            return []
        return [(d, name) for d, name in ((1, c.predictor1), (2, c.predictor2), (3, c.predictor3)) if name]

    def required_predictors(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(name for _, name in self._columns()))

    def setup(self, ctx: SetupContext) -> None:
        # a layer's cache contents as last seen at its own visit (the view shows only the current layer's)
        self.seen = np.zeros((ctx.num_layers, ctx.num_experts), dtype=bool)
        self.score = np.zeros((ctx.num_layers, ctx.num_experts), dtype=float)  # source=score: MRS scores
        self._cols = self._columns()

    def prefetch(self, view: LayerView) -> list[tuple[int, int]]:
        if self.config.source == "score":
            return self._by_score(view)
        self.seen[view.layer] = view.resident
        threshold = float(self.config.min_gain)
        if threshold < 0:
            threshold = float(view.costs.expert_transfer_time())
        fast = self._compiled(view, threshold)
        if fast is not None:
            return fast
        cands: list[tuple[float, int, int, int]] = []  # (-gain per copy, distance, position, expert)
        for d, name in self._columns():
            target = view.layer + d
            if target >= view.num_layers:
                continue
            pred = np.asarray(view.lookahead(name, target))
            chosen, gain = impact_prefix(pred, self.seen[target], view.costs, self.config.schedule)
            if gain < threshold:
                continue
            cands.extend((-gain, d, pos, e) for pos, e in enumerate(chosen))
        cands.sort()
        out = [(view.layer + d, e) for _, d, _, e in cands]
        return out[: self.config.k] if self.config.k > 0 else out

    def impact_form(self, ctx: SetupContext) -> tuple[np.ndarray, list[tuple[int, str]], float, int] | None:
        c = self.config
        if type(self) is not HybriMoEPrefetch or c.source != "impact" or c.schedule != "hss":
            return None
        threshold = float(c.min_gain) if c.min_gain >= 0 else float(ctx.costs.expert_transfer_time())
        return self.seen, list(self._cols), threshold, int(c.k)

    def _compiled(self, view: LayerView, threshold: float) -> list[tuple[int, int]] | None:
        """:meth:`prefetch` after the lookups as one compiled call (``kernels._impact_requests``), for the hss
        schedule with the cost model's tables; None: take the NumPy path (no numba, or a prediction beyond
        the tables)."""
        kernel = kernels.fused("impact_requests")
        tables = kernels.cost_tables(self, view.costs) if kernel is not None else None
        if tables is None or self.config.schedule != "hss":
            return None
        layer, L = view.layer, view.num_layers
        columns = [(d, name) for d, name in self._cols if layer + d < L]
        if not columns:
            return []
        preds = tuple(np.asarray(view.lookahead(name, layer + d), dtype=np.float64) for d, name in columns)
        gpu, cpu, xfer = tables
        ok, pairs = kernel(preds, tuple(d for d, _ in columns), self.seen, layer, gpu, cpu, xfer, threshold,
                           int(self.config.k))
        return pairs if ok else None  # (m, 2) int64 pairs: the controller's compiled path takes them as they are

    def _by_score(self, view: LayerView) -> list[tuple[int, int]]:
        """The code's prefetch_expert: the k highest MRS scores of the next layer (updated at its own visits,
        as the cache does; ties: lower id); the runtime skips resident ones."""
        self.score[view.layer] = mrs_update(self.score[view.layer], view.experts, view.counts, view.tokens,
                                            float(self.config.a))
        target = view.layer + 1
        if target >= view.num_layers:
            return []
        s = self.score[target]
        order = np.lexsort((np.arange(s.shape[0]), -s))[: self.config.k]
        return [(target, int(e)) for e in order]
