"""``link-budget``: a cache that pays for every copy it causes out of the link's idle time (ours).

Why (measured with the bounds, docs/policies.md "Beyond DALI, honestly"): DALI's window cache swaps
``u`` experts per layer at every window end whatever the link is doing. At batch 1 on Mixtral-shaped
q4_0 decode the link is then 80-90% busy with swaps and prefetches for layers whose CPU experts take
0.8 ms while one copy takes 4.1 ms, and DALI decodes at a third of a static popular set's speed. A
static set never adapts, though, and at larger batches the experts a layer copies on demand anyway
are admitted by no static cache. This cache keeps a static set's start and adapts only with copies
that are free or paid for:

* **Scores.** Per layer, an exponential moving average ``s_e`` of each expert's share of the step's
  tokens (``count_e / tokens``; the shares of a layer sum to top_k), weight ``a`` per visit, started
  from the profiling input's frequencies (``SetupContext.frequencies``: no evaluated data). At a step
  of ``T`` tokens an expert is expected to get ``s_e T`` tokens: active with probability
  ``p = 1 - exp(-s_e T)`` (Poisson), then with ``n = max(1, round(s_e T / p))`` tokens. Its expected
  *saving* per visit if resident is ``p * (min(t_cpu(n), transfer + t_gpu(n)) - t_gpu(n))``: what a
  resident copy saves over the better of running it on the CPU and fetching it (cost model only).
* **Admission** (free: the weights are on the GPU already): an expert fetched on demand enters a full
  cache iff its saving beats the lowest saving among the evictable entries, which it replaces.
* **Swaps** (paid: one copy each, at background priority): after a layer's visit, the best outsider
  replaces the worst resident iff its saving is higher (by more than ``min_gain`` transfer times summed
  over the score's horizon of ``1 / a`` visits; default 0) and the *link credit* holds a transfer. The
  credit is the policy's own estimate of the link's idle time. Each visit runs HybriMoE's schedule (the
  placement of the ``link-budget`` preset, :func:`dali_sim.policies.hybrimoe.hybrid_schedule`) on the view: if it
  fetches any expert on demand the link is on the critical path and the credit drops to at most 0 (a
  background copy would hold up those copies: the link is non-preemptive); otherwise the credit grows
  by the estimated duration of the visit (the dense part at its token count plus the schedule's
  makespan) less the copies the layer's prefetches took, up to ``max_credit`` transfers. Each swap
  spends one transfer. So at batch 1, where no copy pays on demand, the idle link refreshes the cache;
  at large batches, where the link carries on-demand copies, the cache only admits what was fetched.

Everything is computed from the cost model (``CostModel.expert_time``, ``expert_transfer_time``,
``dense_time``) and the view; no clock is read and no evaluated data is seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dali_sim.policies.base import CACHES, CachePolicy, LayerView, PolicyConfig, SetupContext, registered
from dali_sim.policies.hybrimoe import expert_times, hybrid_schedule


ADMIT = ("better", "always")


@dataclass(frozen=True)
class LinkBudgetConfig(PolicyConfig):
    a: float = field(default=1 / 16, metadata={
        "help": "weight of the current visit in the moving average of each expert's token share (0 < a <= 1); "
                "1 / a visits is the horizon over which a swap must pay"})
    min_gain: float = field(default=0.0, metadata={
        "help": "a swap must save at least this many transfer times over the horizon (>= 0)"})
    max_credit: float = field(default=2.0, metadata={
        "help": "link credit cap, in transfer times (>= 1 for any swap to happen; 0 = never swap)"})
    max_swaps: int = field(default=1, metadata={
        "help": "at most this many swaps after one layer visit (>= 0)"})
    admit: str = field(default="better", metadata={
        "help": "a fetched expert and a full cache: better = replace the worst evictable entry iff the fetched "
                "one's expected saving is higher; always = replace it in any case (as HybriMoE's MRS cache)"})

    def __post_init__(self) -> None:
        if isinstance(self.a, bool) or not isinstance(self.a, (int, float)) or not 0.0 < float(self.a) <= 1.0:
            raise ValueError(f"cache.a must be a number in (0, 1], got {self.a!r}")
        for name in ("min_gain", "max_credit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"cache.{name} must be a number >= 0, got {v!r}")
        if self.admit not in ADMIT:
            raise ValueError(f"cache.admit must be one of {', '.join(ADMIT)}, got {self.admit!r}")
        if isinstance(self.max_swaps, bool) or not isinstance(self.max_swaps, int) or self.max_swaps < 0:
            raise ValueError(f"cache.max_swaps must be an integer >= 0, got {self.max_swaps!r}")


def expected_saving(share: np.ndarray, tokens: int, costs) -> np.ndarray:
    """Per expert, the expected time a resident copy saves in a step of ``tokens`` tokens, given its
    expected token share: ``p * (min(t_cpu(n), transfer + t_gpu(n)) - t_gpu(n))`` with ``p = 1 -
    exp(-share * tokens)`` and ``n = max(1, round(share * tokens / p))`` (0 where ``share`` is 0)."""
    mean = np.asarray(share, dtype=float) * max(int(tokens), 1)
    p = -np.expm1(-mean)
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.where(p > 0, mean / np.where(p > 0, p, 1.0), 0.0)
    n = np.clip(np.rint(n), 1, None).astype(np.int64)
    gpu, cpu, xfer = expert_times(costs, n)
    worst = np.minimum(cpu, xfer + gpu)
    return p * np.maximum(worst - gpu, 0.0)


def layer_estimate(view: LayerView) -> tuple[float, int]:
    """The policy's estimate of a layer visit: its duration (the dense part at its token count, no
    context, plus the makespan of HybriMoE's schedule, the placement of the ``link-budget`` preset) and the
    on-demand copies that schedule makes (:func:`hybrid_schedule`, mode ``hss``, on the placement's inputs)."""
    costs = view.costs
    dense = float(costs.dense_time("gpu", max(view.tokens, 1)))
    counts = np.asarray(view.counts, dtype=np.int64)
    if counts.size == 0:
        return dense, 0
    experts = np.asarray(view.experts)
    cached = np.asarray(view.resident, dtype=bool)[experts] | np.asarray(view.pending, dtype=bool)[experts]
    t_gpu, t_cpu, xfer = expert_times(costs, counts)
    plan = hybrid_schedule(counts, cached, t_gpu, t_cpu, xfer, "hss")
    return dense + plan.makespan, int(np.count_nonzero(plan.fetched))


@registered(CACHES)
class LinkBudget(CachePolicy[LinkBudgetConfig]):
    name = "link-budget"
    description = ("ours: moving-average token shares started from the profile; a fetched expert is admitted iff "
                   "its expected saving beats the worst evictable entry's; swaps only when the saving over the "
                   "horizon exceeds min_gain transfers and the link's estimated idle time (credit) pays for them")
    Config = LinkBudgetConfig

    def setup(self, ctx: SetupContext) -> None:
        freq = np.asarray(ctx.frequencies, dtype=float)
        total = freq.sum(axis=1, keepdims=True)
        # the profile's token share of each expert (sums to top_k per layer); uniform without a profile
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(total > 0, freq / np.where(total > 0, total, 1.0), 1.0 / ctx.num_experts)
        self.share = share * ctx.top_k
        self.saving = np.zeros_like(self.share)  # expected saving per visit at the current step, per layer
        self.credit = 0.0

    def observe(self, view: LayerView) -> None:
        a = float(self.config.a)
        layer = view.layer
        now = np.zeros(view.num_experts)
        if view.tokens > 0:
            now[np.asarray(view.experts)] = np.asarray(view.counts, dtype=float) / view.tokens
        self.share[layer] = (1.0 - a) * self.share[layer] + a * now
        self.saving[layer] = expected_saving(self.share[layer], view.tokens, view.costs)
        xfer = float(view.costs.expert_transfer_time())
        cap = float(self.config.max_credit) * xfer
        duration, fetched = layer_estimate(view)
        prefetched = int(np.count_nonzero(view.pending))  # copies the layer's prefetches took
        if fetched:  # on-demand copies: the link is on the critical path; a background copy would delay them
            self.credit = min(self.credit, 0.0)
        else:
            self.credit = min(cap, self.credit + duration - prefetched * xfer)

    def victim(self, layer: int, expert: int, view: LayerView, evictable: np.ndarray) -> int | None:
        sav = self.saving[layer]
        worst = int(evictable[np.lexsort((evictable, sav[evictable]))[0]])  # lowest saving; ties: lower id
        return worst if self.config.admit == "always" or sav[expert] > sav[worst] else None

    def rebalance(self, view: LayerView, resident: np.ndarray) -> list[tuple[int, int]]:
        if self.config.max_swaps == 0:
            return []
        layer = view.layer
        xfer = float(view.costs.expert_transfer_time())
        sav = self.saving[layer]
        ids = np.arange(view.num_experts)
        outsiders, insiders = ids[~resident], ids[resident]
        if outsiders.size == 0 or insiders.size == 0:
            return []
        best_out = outsiders[np.lexsort((outsiders, -sav[outsiders]))]
        worst_in = insiders[np.lexsort((insiders, sav[insiders]))]
        horizon = 1.0 / float(self.config.a)
        swaps: list[tuple[int, int]] = []
        for e_in, e_out in zip(best_out.tolist(), worst_in.tolist()):
            if len(swaps) >= self.config.max_swaps or self.credit < xfer:
                break
            if (sav[e_in] - sav[e_out]) * horizon <= float(self.config.min_gain) * xfer:
                break  # later pairs gain less
            swaps.append((e_in, e_out))
            self.credit -= xfer
        return swaps
