"""The time lower bound (the ``lower-bound`` preset): no system is faster under the same cost model,
GPU memory budget and batching. Not a policy: it is computed directly, not simulated. Proof: docs/bounds.md.

Take any system and any span of consecutive steps that starts where a batch's prefill or decode
starts (the whole span, or a prefix of it up to where a sequence ends). Let ``x`` be the system's
CPU/GPU assignment of the span's activated experts, ``G(x)`` the number it runs on the GPU. Then

* ``time >= A(x)``: every step pays :func:`always_paid`, and each MoE layer's experts take at least
  the longer of its two lanes, with every GPU expert's weights free (:func:`lane_profiles`);
* ``time >= B(x) = tau * (G(x) - R)``: a GPU expert whose weights did not stay resident since its
  previous use in the span (or since the span began) needs a copy of ``tau`` seconds over the one
  host-to-GPU link, and at most ``R`` (:func:`reuse_bound`) uses can be served by weights that stayed,
  given how many experts the budget holds (:func:`expert_slots`).

So ``time >= max over lambda in [0, 1] of min_x [lambda A(x) + (1 - lambda) B(x)]``, and the inner
minimum separates per (step, layer): min over k (GPU experts) of ``lambda * m_k + (1 - lambda) * tau * k``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from dali_sim.flow import min_cost_flow
from dali_sim.hardware.cost import CostModel
from dali_sim.hardware.profile import DEVICES
from dali_sim.models.spec import ModelSpec
from dali_sim.runtime.memory import GIB, MemoryConfig, plan_memory
from dali_sim.workload.builder import Workload

#: the lambda values tried (each gives a valid bound; the largest is kept)
LAMBDAS = np.linspace(0.0, 1.0, 201)
#: layers with at most this many activated experts: every CPU/GPU split is evaluated
EXACT_MAX = 12
#: theta values of the relaxation for larger layers (each gives a valid bound)
THETAS = np.linspace(0.0, 1.0, 65)


def _least(costs: Sequence[CostModel], fn) -> np.ndarray:
    """The smallest of ``fn(cost model)`` over the cost models systems may use."""
    return np.min([np.asarray(fn(c), float) for c in costs], axis=0)


def always_paid(costs: Sequence[CostModel], w: Workload) -> tuple[np.ndarray, np.ndarray]:
    """Seconds every system pays in each step outside its routed experts, whatever its policies:
    ``(per MoE layer (S,), all non-MoE blocks of the step (S,))``. The engine runs each MoE layer's
    dense part (attention, router, shared experts) before the layer's experts can start, and each
    non-MoE block whole, on the system's dense device; the bound takes the faster device and the
    cheapest of ``costs`` (the cost models the systems compared may have).

    New terms that every system pays in every layer or step (a per-layer host or framework overhead,
    say) belong here, computed from :class:`CostModel` methods; terms that depend on what a system
    decides (which experts run where, copies) do not."""
    args = (w.step_tokens, w.step_context, w.step_kv)
    moe = _least(costs, lambda c: np.min([_dense_paid(c, d, args, w.model) for d in DEVICES], axis=0))
    blocks = np.zeros(w.num_steps)
    num_blocks = w.model.num_layers - w.num_layers
    if num_blocks:
        blocks = num_blocks * _least(costs, lambda c: np.min([c.dense_block_time(d, *args) for d in DEVICES], axis=0))
    return moe, blocks


def _dense_paid(c: CostModel, device: str, args, model: ModelSpec) -> np.ndarray:
    """The dense part every step pays: without the shared experts where the implementation may move
    them onto the GPU lane (``shared_overlap``), where the lane bound does not count them."""
    moves_shared = model.num_shared_experts > 0 and c.impl.shared_overlap != "never"
    return c.dense_time(device, *args, shared=not moves_shared)


def _split_table(c: np.ndarray, g: np.ndarray) -> np.ndarray:
    """(m, n+1): exactly, for each row, the least max(CPU lane, GPU lane) with k of its n experts on the
    GPU (CPU times ``c``, GPU times ``g``), over all 2^n splits."""
    m, n = c.shape
    masks = ((np.arange(2**n)[:, None] >> np.arange(n)) & 1).astype(float)
    size = masks.sum(axis=1).astype(int)
    out = np.empty((m, n + 1))
    chunk = max(1, 2**22 // 2**n)
    for lo in range(0, m, chunk):
        cc, gg = c[lo:lo + chunk], g[lo:lo + chunk]
        lanes = np.maximum(gg @ masks.T, cc.sum(axis=1)[:, None] - cc @ masks.T)
        for k in range(n + 1):
            out[lo:lo + chunk, k] = lanes[:, size == k].min(axis=1)
    return out


def _relaxed_table(c: np.ndarray, g: np.ndarray) -> np.ndarray:
    """(m, n+1): a lower bound of :func:`_split_table` for large layers. For any split S with |S| = k
    and any theta in [0, 1], max(C, G) >= theta * C + (1 - theta) * G = theta * sum(c) + sum over S of
    ((1 - theta) g - theta c) >= theta * sum(c) + the k smallest of those terms."""
    m, n = c.shape
    out = np.full((m, n + 1), -np.inf)
    total = c.sum(axis=1)[:, None]
    for theta in THETAS:
        d = np.sort((1.0 - theta) * g - theta * c, axis=1)
        smallest = np.concatenate((np.zeros((m, 1)), np.cumsum(d, axis=1)), axis=1)
        np.maximum(out, theta * total + smallest, out=out)
    return out


def lane_profiles(costs: Sequence[CostModel], w: Workload) -> list[tuple[np.ndarray, np.ndarray]]:
    """For the (step, MoE layer) segments ``i = step * L + layer``, grouped by their number n of
    activated experts: ``(segments, table)``, ``table[j, k]`` = a lower bound on the time segment j's
    experts take when exactly k of them run on the GPU, every transfer free: the longer of the CPU
    lane (the sum of ``expert_time("cpu", n_e)``) and the GPU lane (the sum of ``expert_time("gpu",
    n_e)``, the cheapest of ``costs``), since the engine runs one expert at a time on each lane. Exact
    up to :data:`EXACT_MAX` experts, a relaxation above."""
    ptr = w.actual.ptr
    counts = w.actual.count.astype(np.int64)
    cpu = _least(costs, lambda c: c.expert_time("cpu", counts))
    gpu = _least(costs, lambda c: c.expert_time("gpu", counts))
    sizes = np.diff(ptr)
    groups = []
    for n in np.unique(sizes).tolist():
        seg = np.flatnonzero(sizes == n)
        if n == 0:
            groups.append((seg, np.zeros((len(seg), 1))))
            continue
        idx = ptr[seg][:, None] + np.arange(n)
        table = (_split_table if n <= EXACT_MAX else _relaxed_table)(cpu[idx], gpu[idx])
        groups.append((seg, table))
    return groups


def expert_slots(model: ModelSpec, memory: MemoryConfig, profile_gpu_bytes: int, max_kv_tokens: int) -> tuple[int, Any]:
    """The most expert-sized buffers (cache slots, staging and prefetch buffers alike) any system can
    hold within the GPU budget: what is left once the dense weights and the KV cache of the largest
    step are in (the memory planner's accounting, whatever the layout), at most every expert."""
    base = plan_memory(model, dataclasses.replace(memory, layout="none", staging_slots=0, prefetch_slots=0,
                                                  cache_experts=-1, cache_ratio=-1.0),
                       profile_gpu_bytes, max_kv_tokens)
    free = base.budget_bytes - base.used_bytes
    return int(min(model.num_moe_layers * model.num_experts, free // model.expert_bytes)), base


def reuse_bound(w: Workload, first: int, last: int, slots: int) -> int:
    """An upper bound on how many of the activations of steps ``first..last`` any system serves from
    weights resident since the expert's previous use in the span (or since the span began), with at
    most ``slots`` experts resident at any time: the most intervals "from one use of (layer, expert)
    to its next" (plus "from the span's start to its first use") of which at most ``slots`` overlap,
    on the line of the span's layer visits in order. In-step protection is relaxed (dropping
    constraints only raises the bound). A min-cost flow on that line, solved exactly."""
    L, E = w.num_layers, w.num_experts
    ptr = w.actual.ptr
    lo, hi = int(ptr[first * L]), int(ptr[(last + 1) * L])
    n = hi - lo
    seg = np.repeat(np.arange(first * L, (last + 1) * L), np.diff(ptr[first * L:(last + 1) * L + 1]))
    page = (seg % L) * E + w.actual.expert[lo:hi].astype(np.int64)
    pos = seg - first * L  # visit p = (step - first) * L + layer
    if slots <= 0 or n == 0:
        return 0
    pages = np.unique(page)
    if slots >= len(pages):
        return n  # every expert of the span fits: every use can be served
    order = np.lexsort((pos, page))
    page, pos = page[order], pos[order]
    same = page[1:] == page[:-1]
    opens = np.concatenate(([True], ~same))
    P = (last - first + 1) * L
    # nodes 0..P+1; arc j -> j+1 is the gap before visit j (gap 0: the span's start); an interval
    # from visit p to visit q (or from the start) skips the gaps it holds a slot over
    line = np.arange(P + 1)
    tail = np.concatenate((line, pos[:-1][same] + 1, np.zeros(int(opens.sum()), np.int64)))
    head = np.concatenate((line + 1, pos[1:][same] + 1, pos[opens] + 1))
    cost = np.concatenate((np.zeros(P + 1), -np.ones(len(tail) - P - 1)))
    upper = np.concatenate((np.full(P + 1, float(slots)), np.ones(len(tail) - P - 1)))
    supply = np.zeros(P + 2)
    supply[0], supply[-1] = slots, -slots
    flow = min_cost_flow(tail, head, cost, upper, supply, what=f"reuse bound ({n} activations, {slots} slots)")
    return int(flow[P + 1:].sum())


@dataclass
class LowerBound:
    step_start: np.ndarray  # (S,) seconds; see time_lower_bound for what they bound
    step_end: np.ndarray
    compute_s: np.ndarray  # (S,) per step: always-paid part + per layer the best split with free transfers
    layer_s: np.ndarray  # (L,) the per-layer share of compute_s (dense part + experts)
    makespan_s: float  # the sum of the batch-phase bounds (= step_end[-1])
    details: dict[str, Any]


def _spans(w: Workload) -> list[tuple[int, int, list[int]]]:
    """Each batch's prefill and decode as (first step, last step, the steps where a sequence's phase ends)."""
    key = w.step_batch * 2 + w.step_phase
    starts = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
    ends = np.concatenate((starts[1:] - 1, [w.num_steps - 1]))
    seq = w.sequences
    marks = set(seq["last_prefill_step"].tolist()) | set(seq["last_decode_step"].tolist())
    return [(int(a), int(b), sorted({s for s in marks if a <= s <= b} | {int(b)})) for a, b in zip(starts, ends)]


def time_lower_bound(w: Workload, costs: Sequence[CostModel], slots: int) -> LowerBound:
    """Step times such that no system with at most ``slots`` expert-sized GPU buffers whose costs are
    one of ``costs`` is faster (every term is the least over ``costs``).

    Valid for every system: each batch's prefill and decode time (hence ``prefill_s``, ``decode_s``),
    the time from a batch's start to the end of a sequence's prefill (TTFT) and from a batch's first
    decode step to the end of a sequence's decode (its decode time), and the makespan. A single
    step's time is not a bound by itself (copies can be done in other steps)."""
    S, L = w.num_steps, w.num_layers
    per_layer, blocks = always_paid(costs, w)
    fixed = L * per_layer + blocks
    tau = float(min(c.expert_transfer_time() for c in costs))
    phi = np.zeros((len(LAMBDAS), S))  # per step: sum over layers of min_k (lambda m_k + (1 - lambda) tau k)
    layer_s = per_layer.sum() * np.ones(L)
    for seg, table in lane_profiles(costs, w):
        step = seg // L
        k = np.arange(table.shape[1])
        for j, lam in enumerate(LAMBDAS):
            phi[j] += np.bincount(step, weights=(lam * table + (1.0 - lam) * tau * k).min(axis=1), minlength=S)
        layer_s += np.bincount(seg % L, weights=table.min(axis=1), minlength=L)
    compute = fixed + phi[-1]  # lambda = 1
    fixed_cum = np.concatenate(([0.0], np.cumsum(fixed)))
    phi_cum = np.concatenate((np.zeros((len(LAMBDAS), 1)), np.cumsum(phi, axis=1)), axis=1)

    def span_bound(a: int, b: int, reuse: int) -> tuple[float, float]:
        values = LAMBDAS * (fixed_cum[b + 1] - fixed_cum[a]) + phi_cum[:, b + 1] - phi_cum[:, a] \
            - (1.0 - LAMBDAS) * tau * reuse
        j = int(np.argmax(values))
        return float(values[j]), float(LAMBDAS[j])

    end = np.zeros(S)
    t = 0.0
    span_rows = []
    for a, b, marks in _spans(w):
        reuse = reuse_bound(w, a, b, slots)
        t0, done, prev = t, t, a - 1
        for m in marks:
            bound, lam = span_bound(a, m, reuse)
            part = np.cumsum(compute[prev + 1:m + 1])
            target = max(t0 + bound, done + part[-1])  # both lower bounds of the span's time up to m
            scale = (target - done) / part[-1] if part[-1] > 0 else 1.0
            end[prev + 1:m + 1] = done + scale * part
            end[m] = target
            done, prev = target, m
        span_rows.append({"first_step": a, "last_step": b, "bound_s": done - t0,
                          "compute_s": float(compute[a:b + 1].sum()), "reuse": reuse, "lambda": lam})
        t = done
    start = np.concatenate(([0.0], end[:-1]))
    details = {"expert_slots": slots, "copy_s": tau, "compute_s": float(compute.sum()),
               "reuse": sum(r["reuse"] for r in span_rows), "activations": int(len(w.actual.expert)),
               "spans": span_rows}
    return LowerBound(start, end, compute, layer_s, float(t), details)


@dataclass(frozen=True)
class BoundMemory:
    """The memory a time bound assumes: the whole budget for expert buffers, any layout."""

    budget_bytes: int
    breakdown: dict[str, int]
    expert_slots: int
    notes: tuple[str, ...]

    def describe(self) -> dict:
        return {"budget_gib": self.budget_bytes / GIB, "used_gib": sum(self.breakdown.values()) / GIB,
                "breakdown_gib": {k: v / GIB for k, v in self.breakdown.items()}, "cache_slots_per_layer": None,
                "expert_slots": self.expert_slots, "notes": list(self.notes)}


def bound_memory(model: ModelSpec, memory: MemoryConfig, profile_gpu_bytes: int, max_kv_tokens: int) -> BoundMemory:
    slots, base = expert_slots(model, memory, profile_gpu_bytes, max_kv_tokens)
    defaults = MemoryConfig()
    ignored = [f.name for f in dataclasses.fields(memory)
               if f.name != "gpu_memory_gib" and getattr(memory, f.name) != getattr(defaults, f.name)]
    notes = [f"expert-sized GPU buffers: {slots} in all, any layout (the budget left after the dense weights and "
             "the KV cache; cache slots, staging and prefetch buffers alike)"]
    if ignored:
        notes.append("memory." + ", memory.".join(ignored) + " not used: the bound holds for any system within the "
                     "GPU memory budget (set memory.gpu_memory_gib to bound systems with less memory)")
    used = {k: v for k, v in base.breakdown.items() if v}
    return BoundMemory(base.budget_bytes, {**used, "expert_buffers": slots * model.expert_bytes}, slots, tuple(notes))


__all__ = ["BoundMemory", "LowerBound", "always_paid", "bound_memory", "expert_slots", "lane_profiles",
           "reuse_bound", "time_lower_bound"]
