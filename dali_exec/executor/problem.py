"""What a trace replay executes, decided before any tensor exists (no torch here).

From a trace and the user's options: the profiling split (``dali_sim.workload.profiling``, as
``simulate()`` makes it: the profiling sequences are never replayed), the model shape to build (a preset
or the trace's own, scaled by ``scale`` and cut to the first ``layers`` MoE layers), the reduced trace
(those layers, optionally the first evaluated sequences and tokens), the workload, and the memory plan.
The budget is the *full* model's:
``plan_memory`` on the full-size model (``--gpu-memory`` or the hardware profile's GPU), whose cache
bytes are then scaled to the replay model (see :func:`replay_budget`), so a scaled replay keeps the
full run's slots per layer. The resolved system carries that scaled budget, so ``simulate()`` on
``ReplaySetup.trace`` with ``ReplaySetup.sysconf`` plans exactly the same memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from dali_sim.dtypes import canonical_dtype
from dali_sim.hardware.cost import CostModel
from dali_sim.hardware.implementation import EXECUTOR
from dali_sim.hardware.profile import Profile, load_profile
from dali_sim.models.presets import apply_precision, get_model, get_precision
from dali_sim.models.scaled import scale_model
from dali_sim.models.spec import ModelSpec
from dali_sim.policies.systems import SystemConfig, resolve_system
from dali_sim.runtime.memory import GIB, MemoryPlan, plan_memory
from dali_sim.sim.simulate import DEFAULT_HARDWARE
from dali_sim.trace.reader import Trace
from dali_sim.workload.builder import Workload, WorkloadConfig
from dali_sim.workload.profiling import ProfiledTrace, ProfileSpec, apply_profile, check_batch_size

#: weight storage of the replay -> the precision preset with its bytes per parameter
DTYPE_PRECISION = {"bf16": "bf16", "fp16": "bf16", "fp32": "fp32"}


@dataclass(frozen=True)
class ReplayOptions:
    """The user's choices of what to build (CLI: ``dali exec run``)."""

    model_shape: str | None = None  # a preset name; None = the trace's own model spec
    layers: int | None = None  # the first N MoE layers; None = all
    scale: float = 1.0  # hidden, intermediate and head sizes multiplied by this (rounded, >= 1)
    sequences: int | None = None  # the first N sequences (seq_id order); None = all
    max_tokens: int | None = None  # the first N tokens of each sequence; None = all
    precision: str | None = None  # the full model's weight format for the memory plan (default: the spec's)
    dtype: str = "bf16"  # how the replay stores weights: bf16 | fp16 | fp32

    def __post_init__(self) -> None:
        if not 0.0 < self.scale <= 1.0:
            raise ValueError(f"scale must lie in (0, 1], got {self.scale}")
        for name in ("layers", "sequences", "max_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))


def full_model_of(trace: Trace, model_shape: str | None, precision: str | None) -> ModelSpec:
    """The full-size model the replay stands for: ``model_shape`` (checked against the trace) or the trace's."""
    if model_shape is None:
        return apply_precision(trace.model, precision)
    spec = get_model(model_shape, precision)
    where = trace.path or "the trace"
    have = (trace.num_experts, trace.top_k, tuple(trace.layers))
    want = (spec.num_experts, spec.top_k, spec.moe_layers)
    if have != want:
        raise ValueError(f"--model-shape {model_shape}: {spec.num_experts} experts, top-{spec.top_k}, MoE layers "
                         f"{list(spec.moe_layers)}; but {where} was recorded for {trace.num_experts} experts, "
                         f"top-{trace.top_k}, MoE layers {list(trace.layers)} ({trace.model.name}): pick a preset "
                         "of the trace's shape or omit --model-shape")
    return spec


def reduce_trace(trace: Trace, model: ModelSpec, sequences: int | None = None,
                 max_tokens: int | None = None) -> Trace:
    """The rows of ``model``'s MoE layers (the first ones of the trace's), of the first ``sequences``
    sequences and the first ``max_tokens`` tokens of each, with ``model`` as the trace's model."""
    keep = np.isin(trace.layer, np.asarray(model.moe_layers))
    seq_ids = np.unique(trace.seq_id)
    if sequences is not None:
        keep &= np.isin(trace.seq_id, seq_ids[:sequences])
    if max_tokens is not None:
        # a token is kept if at most max_tokens - 1 tokens of its sequence come before it
        first = trace.layer == model.moe_layers[0]
        seq, pos = trace.seq_id[first].astype(np.int64), trace.pos[first].astype(np.int64)
        order = np.lexsort((pos, seq))
        seq, pos = seq[order], pos[order]
        last = (np.arange(len(seq)) - np.searchsorted(seq, seq, side="left")) == max_tokens - 1
        ids, last_pos = seq[last], pos[last]  # sequences longer than max_tokens: their last kept position
        row_seq = trace.seq_id.astype(np.int64)
        i = np.minimum(np.searchsorted(ids, row_seq), max(len(ids) - 1, 0))
        cut = (ids[i] == row_seq) if len(ids) else np.zeros(len(row_seq), bool)
        keep &= ~cut | (trace.pos.astype(np.int64) <= (last_pos[i] if len(ids) else 0))
    kept_ids = set(np.unique(trace.seq_id[keep]).tolist())
    meta = dataclasses.replace(trace.meta, model=model, num_rows=int(keep.sum()),
                               sequences=[s for s in trace.meta.sequences if s.seq_id in kept_ids])
    if not keep.any():
        raise ValueError(f"{trace.path or 'trace'}: no rows left after choosing layers/sequences/tokens")
    return Trace(trace.table.filter(pa.array(keep)), meta, trace.path)


def _fixed_bytes(plan: MemoryPlan) -> int:
    return plan.used_bytes - plan.breakdown["expert_cache"]


def replay_budget(full_plan: MemoryPlan, full: ModelSpec, replay: ModelSpec, sysconf: SystemConfig,
                  max_kv_tokens: int, required: np.ndarray | None) -> int:
    """Bytes of GPU budget for the replay model: its own fixed working set (dense weights, KV cache,
    staging and prefetch buffers) plus the full plan's free (cache) bytes scaled by the ratio of all
    routed-expert bytes, ``free * (N x replay expert bytes) / (L x full expert bytes)``, rounded down.
    Uniform layouts then keep exactly the full plan's slots per layer and whole-layer layouts the same
    share of layers (rounded down)."""
    huge = dataclasses.replace(sysconf.memory, gpu_memory_gib=float(1 << 40))
    fixed = _fixed_bytes(plan_memory(replay, huge, 0, max_kv_tokens, required=required))
    free_full = full_plan.budget_bytes - _fixed_bytes(full_plan)
    num = free_full * replay.num_moe_layers * replay.expert_bytes
    den = full.num_moe_layers * full.expert_bytes
    return fixed + num // den


@dataclass
class ReplaySetup:
    """Everything a replay (or a simulation of the same replay) needs, torch-free."""

    trace: Trace  # reduced; its model is the replay model
    full_model: ModelSpec
    model: ModelSpec  # the replay model (scaled, cut, at the replay dtype's precision)
    options: ReplayOptions
    sysconf: SystemConfig  # memory.gpu_memory_gib = the scaled budget
    profile: Profile
    costs: CostModel
    workload: Workload
    memory: MemoryPlan  # the replay's plan (what is allocated)
    full_memory: MemoryPlan  # the full model's plan it was scaled from
    hardware: str
    profiled: ProfiledTrace  # the profiling input; ``profiled.evaluated`` is ``trace``

    def describe(self) -> dict[str, Any]:
        o = self.options
        return {
            "full_model": self.full_model.name, "full_precision": self.full_model.precision.name,
            "model_shape": o.model_shape, "layers": self.model.num_moe_layers, "scale": o.scale,
            "sequences": o.sequences, "max_tokens": o.max_tokens, "dtype": o.dtype,
            "replay_model": self.model.to_dict(),
            "full_memory": self.full_memory.describe(),
            "replay_budget_gib": self.memory.budget_bytes / GIB,
        }


def prepare_replay(trace: Trace, system: str, options: ReplayOptions = ReplayOptions(), *,
                   hardware: str = DEFAULT_HARDWARE, batch_size: int = 1, prefill_chunk: int = 0,
                   overrides: Mapping[str, Mapping[str, str]] | None = None,
                   profiling: ProfileSpec | None = None) -> ReplaySetup:
    """Decide the replay: profiling split, shapes, reduced trace, workload, policies' system and the scaled
    memory plan. ``profiling``: as ``simulate()``'s (default: the first 25% of the sequences profile)."""
    full = full_model_of(trace, options.model_shape, options.precision)
    model = scale_model(full, options.scale, options.layers, DTYPE_PRECISION[options.dtype])
    split = apply_profile(trace, profiling)
    reduced = reduce_trace(split.evaluated, model, options.sequences, options.max_tokens)
    profiled = split.restricted(reduced, model.num_moe_layers)
    check_batch_size(batch_size, reduced.num_sequences, str(trace.path or "the trace"))
    full_sys = resolve_system(system, overrides, full)
    if full_sys.time_bound:
        raise ValueError(f"system {system!r} is a time bound computed by the simulator (`dali sim run`), not a "
                         "system the executor can replay")
    profile = load_profile(hardware)
    placement, prefetch = full_sys.placement.build(), full_sys.prefetch.build()
    workload = Workload(reduced, WorkloadConfig(batch_size, prefill_chunk), predictors=prefetch.required_predictors())
    kv = workload.max_batch_context
    full_plan = plan_memory(full, full_sys.memory, profile.gpu_memory_bytes, kv,
                            required=placement.required_capacities(full.num_moe_layers, full.num_experts))
    required = placement.required_capacities(model.num_moe_layers, model.num_experts)
    budget = replay_budget(full_plan, full, model, full_sys, kv, required)
    over = {k: dict(v) for k, v in (overrides or {}).items()}
    over.setdefault("memory", {})["gpu_memory_gib"] = repr(budget / GIB)
    # the replay runs on dali's executor: a simulation of it (validation) times that implementation
    over.setdefault("system", {})["implementation"] = EXECUTOR
    sysconf = resolve_system(system, over, model)
    plan = plan_memory(model, sysconf.memory, profile.gpu_memory_bytes, kv, required=required)
    costs = CostModel(profile, model, implementation=sysconf.implementation, system=sysconf.name)
    return ReplaySetup(reduced, full, model, options, sysconf, profile, costs, workload, plan, full_plan, str(hardware),
                       profiled)


__all__ = ["DTYPE_PRECISION", "ReplayOptions", "ReplaySetup", "full_model_of", "prepare_replay", "reduce_trace",
           "replay_budget", "scale_model"]
