"""DALI's Greedy Assignment (arXiv 2602.03495, Algorithm 1) and a variant that respects GPU memory.

Per (step, MoE layer) every activated expert ``e`` goes to the GPU or the CPU so as to make
``max(T_cpu, T_gpu)`` small, where ``T_cpu`` is the sum of ``t_cpu`` over the CPU experts and
``T_gpu`` the sum of ``t_gpu`` over the GPU experts, with (the published cost model)

    t_cpu(e) = CPU compute time of e for its workload (tokens routed to it)
    t_gpu(e) = max(transfer, GPU compute time)    transfer = 0 if e's weights are on the GPU already

Algorithm 1 (as published): sort the experts by ``|t_gpu - t_cpu|``, largest first; walk them once
keeping running sums ``T_gpu`` and ``T_cpu`` (both start at 0); an expert goes to the GPU if
``T_gpu + t_gpu <= T_cpu + t_cpu``, else to the CPU.

Choices where the paper is silent (docs/policies.md repeats them):

* equal ``|t_gpu - t_cpu|``: higher workload first, then the lower expert id (a total order, so the
  result does not depend on the order the experts are given in);
* a *pending* expert (prefetched for this layer, in flight or arrived) counts as on the GPU
  (transfer 0) by default: the prefetch copy was issued during an earlier layer, and the point of
  the paper's prefetching is that the assignment finds those experts on the GPU. ``pending_resident
  = false`` charges it a full transfer instead (its weights still need no new buffer);
* ``overlap = false`` replaces ``max(transfer, compute)`` by ``transfer + compute`` (no pipelining);
* the memory rule of ``dali-greedy-mem`` (and of ``optimal-mem``): see :func:`fetch_limit`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dali_sim.policies import kernels
from dali_sim.policies.base import (
    PLACEMENTS,
    GreedyForm,
    LayerView,
    PlacementPolicy,
    PolicyConfig,
    SetupContext,
    registered,
)

SLOT_RULES = ("evictable", "free", "staging")


# ---- pure functions ----------------------------------------------------------------------------
def expert_times(view: LayerView, *, overlap: bool = True, pending_resident: bool = True
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(t_gpu, t_cpu, needs_buffer)`` aligned with ``view.experts``.

    ``needs_buffer`` marks the experts whose weights are neither resident nor pending: putting one
    on the GPU takes a buffer it does not hold yet (a cache slot or a staging buffer)."""
    experts = np.asarray(view.experts)
    counts = np.asarray(view.counts, dtype=np.int64)
    costs = view.costs
    table = getattr(costs, "expert_time_table", None)
    if table is not None and counts.size and counts.min() >= 0 and counts.max() <= costs.lookup_tokens:
        gpu, cpu = table("gpu")[counts], table("cpu")[counts]  # expert_time's own lookup, without its checks
    else:
        gpu = np.asarray(costs.expert_time("gpu", counts), dtype=float).reshape(counts.shape)
        cpu = np.asarray(costs.expert_time("cpu", counts), dtype=float).reshape(counts.shape)
    xfer = float(costs.expert_transfer_time())
    resident = np.asarray(view.resident, dtype=bool)[experts]
    pending = np.asarray(view.pending, dtype=bool)[experts]
    present = resident | pending if pending_resident else resident
    uncached = np.maximum(xfer, gpu) if overlap else xfer + gpu
    t_gpu = np.where(present, gpu, uncached)
    return t_gpu, cpu, ~(resident | pending)


def _greedy_place(experts, counts, resident, pending, lut_gpu, lut_cpu, xfer, overlap, pending_resident):
    """:meth:`DaliGreedy.place` in one loop (compiled by numba): :func:`expert_times` from the cost model's
    tables (``counts`` within them), :func:`greedy_order` (an insertion sort on the same keys: ``|t_gpu -
    t_cpu|`` descending, workload descending, id ascending) and the greedy walk, in float64 as the NumPy
    code computes them."""
    n = experts.shape[0]
    t_gpu = np.empty(n)
    t_cpu = np.empty(n)
    key = np.empty(n)
    order = np.empty(n, np.int64)
    for j in range(n):
        g = lut_gpu[counts[j]]
        e = experts[j]
        present = resident[e] or (pending_resident and pending[e])
        if present:
            t_gpu[j] = g
        elif overlap:
            t_gpu[j] = max(xfer, g)
        else:
            t_gpu[j] = xfer + g
        t_cpu[j] = lut_cpu[counts[j]]
        key[j] = -abs(t_gpu[j] - t_cpu[j])
        i = j  # insert j: ascending (key, -count, id), as np.lexsort((ids, -counts, key))
        while i > 0:
            o = order[i - 1]
            if key[o] < key[j] or (key[o] == key[j] and (counts[o] > counts[j] or (counts[o] == counts[j]
                                                                                    and experts[o] < e))):
                break
            order[i] = o
            i -= 1
        order[i] = j
    out = np.zeros(n, np.bool_)
    total_g = 0.0
    total_c = 0.0
    for i in range(n):
        j = order[i]
        if total_g + t_gpu[j] <= total_c + t_cpu[j]:
            out[j] = True
            total_g += t_gpu[j]
        else:
            total_c += t_cpu[j]
    return out


def _greedy_place_checked(experts, counts, resident, pending, lut_gpu, lut_cpu, xfer, overlap, pending_resident):
    """:func:`_greedy_place` if every count lies in the tables (as ``(True, mask)``), else ``(False, empty)``:
    the range check in the same compiled call (two NumPy reductions cost more than the greedy)."""
    top = min(lut_gpu.shape[0], lut_cpu.shape[0])
    for j in range(counts.shape[0]):
        if counts[j] < 0 or counts[j] >= top:
            return False, np.zeros(0, np.bool_)
    return True, _greedy_fn(experts, counts, resident, pending, lut_gpu, lut_cpu, xfer, overlap, pending_resident)


_COMPILED: list = []
_greedy_fn = _greedy_place  # what _greedy_place_checked calls: the compiled _greedy_place


def _compiled_place():
    """The compiled :func:`_greedy_place` (None without numba)."""
    if not _COMPILED:
        global _greedy_fn
        _greedy_fn = kernels.jit(_greedy_place)
        _COMPILED.append(_greedy_fn)
        _COMPILED.append(kernels.jit(_greedy_place_checked) if _greedy_fn is not None else None)
    return _COMPILED[0]


def _compiled_place_checked():
    """The compiled :func:`_greedy_place_checked` (None without numba, or when :func:`_compiled_place` is
    switched off)."""
    return _COMPILED[1] if _compiled_place() is not None else None


def makespan(on_gpu, t_gpu, t_cpu) -> float:
    """``max(T_cpu, T_gpu)`` of an assignment (the objective of the greedy and of the bound)."""
    on_gpu = np.asarray(on_gpu, dtype=bool)
    t_gpu, t_cpu = np.asarray(t_gpu, dtype=float), np.asarray(t_cpu, dtype=float)
    return max(float(t_gpu[on_gpu].sum()), float(t_cpu[~on_gpu].sum()))


def _check_inputs(t_gpu, t_cpu, needs_buffer, max_new) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t_gpu = np.asarray(t_gpu, dtype=float)
    t_cpu = np.asarray(t_cpu, dtype=float)
    if t_gpu.ndim != 1 or t_gpu.shape != t_cpu.shape:
        raise ValueError(f"t_gpu and t_cpu must be 1-D arrays of one length, got shapes {t_gpu.shape} and {t_cpu.shape}")
    # all finite iff the sum is (times are seconds: no overflow)
    if t_gpu.size and not (math.isfinite(float(t_gpu.sum() + t_cpu.sum())) and min(t_gpu.min(), t_cpu.min()) >= 0):
        raise ValueError("expert times must be finite and >= 0")
    needs = np.zeros(t_gpu.shape, dtype=bool) if needs_buffer is None else np.asarray(needs_buffer, dtype=bool)
    if needs.shape != t_gpu.shape:
        raise ValueError(f"needs_buffer has shape {needs.shape}, expected {t_gpu.shape}")
    if max_new is not None and max_new < 0:
        raise ValueError(f"max_new must be >= 0, got {max_new}")
    return t_gpu, t_cpu, needs


def greedy_order(t_gpu, t_cpu, workload=None, ids=None) -> np.ndarray:
    """Indices in Algorithm 1's order: ``|t_gpu - t_cpu|`` descending; ties by higher ``workload``,
    then lower ``ids`` (default: the positions)."""
    t_gpu, t_cpu = np.asarray(t_gpu, dtype=float), np.asarray(t_cpu, dtype=float)
    n = len(t_gpu)
    w = np.zeros(n) if workload is None else np.asarray(workload, dtype=float)
    i = np.arange(n) if ids is None else np.asarray(ids)
    if w.shape != (n,) or i.shape != (n,):
        raise ValueError(f"workload and ids must have {n} entries")
    return np.lexsort((i, -w, -np.abs(t_gpu - t_cpu)))


def greedy_assign(t_gpu, t_cpu, *, workload=None, ids=None, needs_buffer=None, max_new: int | None = None
                  ) -> np.ndarray:
    """DALI Algorithm 1. Returns a bool mask (True = GPU) aligned with the inputs.

    Experts are taken in :func:`greedy_order`; each goes to the GPU iff ``T_gpu + t_gpu <= T_cpu +
    t_cpu`` (ties go to the GPU, as published) and, when ``max_new`` is given, fewer than
    ``max_new`` experts with ``needs_buffer`` have gone to the GPU so far (the memory-respecting
    variant; an expert refused for memory goes to the CPU)."""
    t_gpu, t_cpu, needs = _check_inputs(t_gpu, t_cpu, needs_buffer, max_new)
    return _greedy(t_gpu, t_cpu, workload, ids, needs, max_new)


def _greedy(t_gpu: np.ndarray, t_cpu: np.ndarray, workload, ids, needs: np.ndarray, max_new: int | None) -> np.ndarray:
    """:func:`greedy_assign` on checked inputs (float arrays of one length, ``needs`` bool)."""
    order = greedy_order(t_gpu, t_cpu, workload, ids)
    limit = len(t_gpu) + 1 if max_new is None else int(max_new)  # more than can ever need a buffer: no limit
    return kernels.run("greedy", order, t_gpu, t_cpu, needs, limit)


def fetch_limit(view: LayerView, capacity: int, staging_slots: int, slots: str = "evictable") -> int:
    """M: how many experts that are neither resident nor pending one layer may put on the GPU.

    Every such expert needs a buffer for the whole layer (the GPU experts of a layer are all held at
    once, as in the paper's memory constraint): a staging buffer (``memory.staging_slots``, all free
    at a layer start since staged buffers are released when their expert's compute ends) or a slot
    of this layer's cache. ``slots`` says which cache slots count:

    * ``evictable`` (default): every slot not holding an expert activated in this step,
      ``capacity - |resident & activated|``: the empty ones plus the entries the cache may evict for
      a fetched expert (the controller only evicts entries not activated in the step). With a cache
      that always admits (lru, lfu) the controller then never stages more than ``staging_slots``
      experts in a layer;
    * ``free``: only the empty slots, ``capacity - |resident|`` (no eviction assumed);
    * ``staging``: no cache slot, M = ``staging_slots`` (holds for any cache, also one that declines
      every admission, e.g. ``static``).

    Pending experts hold prefetch buffers already and do not count."""
    if slots not in SLOT_RULES:
        raise ValueError(f"slots must be one of {', '.join(SLOT_RULES)}, got {slots!r}")
    resident = np.asarray(view.resident, dtype=bool)
    if slots == "staging":
        cache = 0
    elif slots == "free":
        cache = capacity - int(resident.sum())
    else:
        cache = capacity - int(resident[np.asarray(view.experts)].sum())
    return staging_slots + max(0, cache)


# ---- configs -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DaliGreedyConfig(PolicyConfig):
    overlap: bool = field(default=True, metadata={
        "help": "t_gpu of a non-resident expert = max(transfer, compute) as published (its copy overlaps "
                "other experts' compute); false = transfer + compute"})
    pending_resident: bool = field(default=True, metadata={
        "help": "a prefetched (pending) expert counts as on the GPU (transfer 0); false = charge it a full "
                "transfer"})


@dataclass(frozen=True)
class MemoryRuleConfig(PolicyConfig):
    """Fields of the memory constraint shared by dali-greedy-mem and optimal-mem."""

    slots: str = field(default="evictable", metadata={
        "help": "cache slots that may take a fetched expert, besides the staging buffers: evictable (slots "
                "not holding an expert activated in the step), free (empty slots only), staging (none)"})
    staging_slots: int = field(default=-1, metadata={
        "help": "staging buffers counted in the limit; -1 = memory.staging_slots (needs SetupContext."
                "staging_slots; set it explicitly otherwise). Must not exceed memory.staging_slots"})

    def __post_init__(self) -> None:
        if self.slots not in SLOT_RULES:
            raise ValueError(f"placement.slots must be one of {', '.join(SLOT_RULES)}, got {self.slots!r}")
        if self.staging_slots < -1:
            raise ValueError(f"placement.staging_slots must be >= 0 (or -1 = memory.staging_slots), got "
                             f"{self.staging_slots}")


@dataclass(frozen=True)
class DaliGreedyMemConfig(DaliGreedyConfig, MemoryRuleConfig):
    pass


def resolve_staging_slots(configured: int, ctx: SetupContext) -> int:
    """The staging buffers the memory rule counts: the config's value, else the context's."""
    known = ctx.staging_slots
    if configured < 0:
        return int(known)
    if configured > known:
        raise ValueError(f"placement.staging_slots={configured} exceeds memory.staging_slots={known}")
    return int(configured)


# ---- policies ------------------------------------------------------------------------------------
@registered(PLACEMENTS)
class DaliGreedy(PlacementPolicy[DaliGreedyConfig]):
    name = "dali-greedy"
    description = ("DALI Greedy Assignment (Algorithm 1): experts by |t_gpu - t_cpu| descending, each to the GPU "
                   "iff T_gpu + t_gpu <= T_cpu + t_cpu; ignores GPU memory")
    Config = DaliGreedyConfig

    def times(self, view: LayerView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return expert_times(view, overlap=self.config.overlap, pending_resident=self.config.pending_resident)

    def greedy_form(self, ctx: SetupContext) -> GreedyForm | None:
        if type(self) is not DaliGreedy:  # (a subclass may place otherwise)
            return None
        tables = kernels.cost_tables(self, ctx.costs)
        if tables is None:
            return None
        gpu, cpu, xfer = tables
        return GreedyForm(gpu, cpu, xfer, bool(self.config.overlap), bool(self.config.pending_resident))

    def place(self, view: LayerView) -> np.ndarray:
        kernel = _compiled_place_checked() if type(self) is DaliGreedy else None
        tables = kernels.cost_tables(self, view.costs) if kernel is not None else None
        if tables is not None:  # the same decisions in one compiled loop
            gpu, cpu, xfer = tables
            ok, out = kernel(view.experts, view.counts, view.resident, view.pending, gpu, cpu, xfer,
                             self.config.overlap, self.config.pending_resident)
            if ok:
                return out
        t_gpu, t_cpu, needs = self.times(view)  # from the cost model's tables: valid inputs
        return _greedy(t_gpu, t_cpu, view.counts, view.experts, np.zeros(len(t_gpu), dtype=bool), None)


class _MemoryLimited:
    """Mixin: per-layer fetch limit M from the setup context and the memory-rule config."""

    def setup(self, ctx: SetupContext) -> None:
        self.capacities = np.asarray(ctx.capacities, dtype=np.int64).copy()
        self.staging = resolve_staging_slots(self.config.staging_slots, ctx)

    def limit(self, view: LayerView) -> int:
        if not hasattr(self, "capacities"):
            raise RuntimeError(f"placement {self.name!r}: setup() was not called")
        return fetch_limit(view, int(self.capacities[view.layer]), self.staging, self.config.slots)


@registered(PLACEMENTS)
class DaliGreedyMem(_MemoryLimited, DaliGreedy):
    name = "dali-greedy-mem"
    description = ("DALI Greedy Assignment that also keeps the GPU memory constraint: at most M experts that are "
                   "neither resident nor prefetched go to the GPU per layer (M = staging buffers + usable cache slots)")
    Config = DaliGreedyMemConfig

    def place(self, view: LayerView) -> np.ndarray:
        t_gpu, t_cpu, needs = self.times(view)
        return greedy_assign(t_gpu, t_cpu, workload=view.counts, ids=view.experts, needs_buffer=needs,
                             max_new=self.limit(view))


__all__ = ["DaliGreedy", "DaliGreedyConfig", "DaliGreedyMem", "DaliGreedyMemConfig", "MemoryRuleConfig",
           "SLOT_RULES", "expert_times", "fetch_limit", "greedy_assign", "greedy_order", "makespan",
           "resolve_staging_slots"]
