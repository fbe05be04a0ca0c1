"""GPU memory accounting: what the budget must hold, and how many cache slots each layer gets.

Budget = dense weights (everything but routed experts) + KV cache of the largest step
+ staging buffers + prefetch buffers + cache slots. Activations and the framework's own memory are
not modelled: leave headroom in ``gpu_memory_gib``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dali_sim.hardware.profile import MAX_MEMORY_GIB
from dali_sim.models.spec import ModelSpec
from dali_sim.config import PolicyConfig

GIB = 2**30
LAYOUTS = ("uniform", "whole-layers", "none")
#: initial cache contents (``memory.cache_init``): ``frequency`` reads the profiling input's frequencies,
#: ``frequency-hindsight`` the evaluated workload's own; ``lowest-ids`` / ``highest-ids`` fill each layer by
#: id, as HybriMoE's and mixtral-offloading's code do at load time (docs/policies.md, "Initial contents")
CACHE_INITS = ("empty", "random", "frequency", "frequency-hindsight", "lowest-ids", "highest-ids")


@dataclass(frozen=True)
class MemoryConfig(PolicyConfig):
    gpu_memory_gib: float = field(default=0.0, metadata={
        "help": "GPU memory budget in GiB; 0 = the hardware profile's GPU memory"})
    layout: str = field(default="uniform", metadata={
        "help": "cache slots: uniform (same per layer), whole-layers (all experts of the last layers that "
                "fit, none elsewhere: llama.cpp; with cache_experts / cache_ratio as many whole layers as hold "
                "the same expert bytes), none (no cache)"})
    cache_ratio: float = field(default=-1.0, metadata={
        "help": "slots per layer as a fraction of the layer's experts (whole-layers: the same expert bytes in whole "
                "layers); -1 = unset"})
    cache_experts: int = field(default=-1, metadata={
        "help": "slots per layer (whole-layers: the same expert bytes in whole layers); -1 = unset (if both unset: "
                "as many as the budget holds)"})
    cache_init: str = field(default="empty", metadata={
        "help": "initial cache contents: empty | random | frequency (each layer's most used experts in the profiling "
                "input) | frequency-hindsight (in the evaluated data itself) | lowest-ids | highest-ids"})
    staging_slots: int = field(default=2, metadata={
        "help": "expert-sized buffers for fetched experts that are not admitted to the cache; -1 = one layer's "
                "experts (an implementation that copies a whole layer's experts before computing them)"})
    prefetch_slots: int = field(default=0, metadata={
        "help": "expert-sized buffers for prefetched experts; -1 = one layer's experts (stream whole layers)"})

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"memory.layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.cache_init not in CACHE_INITS:
            raise ValueError(f"memory.cache_init must be one of {', '.join(CACHE_INITS)}, got {self.cache_init!r}")
        if self.cache_ratio != -1.0 and not 0.0 <= self.cache_ratio <= 1.0:
            raise ValueError(f"memory.cache_ratio must lie in [0, 1], got {self.cache_ratio}")
        if self.cache_ratio != -1.0 and self.cache_experts != -1:
            raise ValueError("give memory.cache_ratio or memory.cache_experts, not both")
        for name in ("prefetch_slots", "staging_slots"):
            if getattr(self, name) < -1:
                raise ValueError(f"memory.{name} must be >= 0 (or -1 = one layer's experts), got {getattr(self, name)}")
        if not 0.0 <= self.gpu_memory_gib <= MAX_MEMORY_GIB:  # also refuses NaN and inf
            raise ValueError(f"memory.gpu_memory_gib must lie in [0, {MAX_MEMORY_GIB:g}] GiB (0 = the hardware "
                             f"profile's GPU), got {self.gpu_memory_gib}")
        if self.cache_experts < -1:
            raise ValueError(f"memory.cache_experts must be >= 0 (or -1 = unset), got {self.cache_experts}")


@dataclass(frozen=True)
class MemoryPlan:
    capacities: np.ndarray  # (L,) cache slots per MoE layer
    budget_bytes: int
    breakdown: dict[str, int]  # bytes per item
    notes: tuple[str, ...] = ()  # settings that did not apply, said out loud
    prefetch_slots: int = 0  # resolved (-1 in the config = one layer's experts)
    staging_slots: int = 0  # resolved likewise

    @property
    def used_bytes(self) -> int:
        return sum(self.breakdown.values())

    def describe(self) -> dict:
        return {
            "budget_gib": self.budget_bytes / GIB,
            "used_gib": self.used_bytes / GIB,
            "breakdown_gib": {k: v / GIB for k, v in self.breakdown.items()},
            "cache_slots_per_layer": self.capacities.tolist(),
            "notes": list(self.notes),
        }


def kv_cache_bytes(model: ModelSpec, kv_tokens: int, activation_bytes: int = 2) -> int:
    return int(kv_tokens * model.attention.kv_cache_elements_per_token() * model.num_layers * activation_bytes)


def plan_memory(model: ModelSpec, cfg: MemoryConfig, profile_gpu_bytes: int, max_kv_tokens: int,
                required: np.ndarray | None = None) -> MemoryPlan:
    """Cache slots per layer within the budget; a budget below the minimum working set is an error.

    ``required`` (from the placement, e.g. static-layers with a given N) fixes the slots per layer."""
    L, E, xb = model.num_moe_layers, model.num_experts, model.expert_bytes
    budget = int(cfg.gpu_memory_gib * GIB) if cfg.gpu_memory_gib > 0 else int(profile_gpu_bytes)
    prefetch_slots = E if cfg.prefetch_slots == -1 else cfg.prefetch_slots
    staging_slots = E if cfg.staging_slots == -1 else cfg.staging_slots
    fixed = {
        "dense_weights": model.bytes_of(model.non_expert_params),
        "kv_cache": kv_cache_bytes(model, max_kv_tokens),
        "staging_buffers": staging_slots * xb,
        "prefetch_buffers": prefetch_slots * xb,
    }
    free = budget - sum(fixed.values())
    if free < 0:
        need = ", ".join(f"{k} {v / GIB:.2f}" for k, v in fixed.items())
        raise ValueError(f"GPU memory budget {budget / GIB:.2f} GiB cannot hold the minimum working set "
                         f"({sum(fixed.values()) / GIB:.2f} GiB: {need}); raise memory.gpu_memory_gib or use "
                         "fewer staging/prefetch buffers or a smaller batch")
    notes: list[str] = []
    cache_request = cfg.cache_experts >= 0 or cfg.cache_ratio >= 0
    k = cfg.cache_experts if cfg.cache_experts >= 0 else int(round(cfg.cache_ratio * E))
    if cache_request and k > E:
        raise ValueError(f"memory.cache_experts={k} exceeds the {E} experts of a layer")
    if cache_request and (required is not None or cfg.layout == "none"):
        notes.append(f"memory.cache_experts / cache_ratio ignored: the {cfg.layout} layout"
                     + (" with the placement's fixed layers" if required is not None else "") + " sets the cache")
    if required is not None:
        caps = np.asarray(required, dtype=np.int64)
        if caps.sum() * xb > free:
            raise ValueError(f"the placement needs {int(caps.sum())} cached experts ({caps.sum() * xb / GIB:.2f} GiB) "
                             f"but only {free / GIB:.2f} GiB of the {budget / GIB:.2f} GiB budget are left")
    elif cfg.layout == "none":
        caps = np.zeros(L, dtype=np.int64)
    elif cfg.layout == "whole-layers" and cache_request:
        # matched in GPU memory: the expert bytes of k slots in every layer, as whole layers (k x L // E)
        gpu_layers = k * L // E
        caps = np.where(np.arange(L) >= L - gpu_layers, E, 0).astype(np.int64)
        notes.append(f"whole layers matched in memory: {gpu_layers} of {L} MoE layers on the GPU hold the expert "
                     f"bytes of {k} slots per layer")
        if caps.sum() * xb > free:
            raise ValueError(f"{gpu_layers} whole layers x {E} experts x {xb / 2**20:.1f} MiB = "
                             f"{caps.sum() * xb / GIB:.2f} GiB do not fit the {free / GIB:.2f} GiB left of the "
                             f"{budget / GIB:.2f} GiB budget; at most {free // (E * xb)} whole layers fit")
    elif cfg.layout == "whole-layers":
        gpu_layers = min(L, free // (E * xb))
        caps = np.where(np.arange(L) >= L - gpu_layers, E, 0).astype(np.int64)
    elif cache_request:
        caps = np.full(L, k, dtype=np.int64)
        if caps.sum() * xb > free:
            raise ValueError(
                f"{k} cache slots x {L} layers x {xb / 2**20:.1f} MiB = {caps.sum() * xb / GIB:.2f} GiB do not fit "
                f"the {free / GIB:.2f} GiB left of the {budget / GIB:.2f} GiB budget; at most "
                f"{free // (L * xb)} slots per layer fit")
    else:
        caps = np.full(L, min(E, free // (L * xb)), dtype=np.int64)
    breakdown = fixed | {"expert_cache": int(caps.sum() * xb)}
    return MemoryPlan(caps, budget, breakdown, tuple(notes), prefetch_slots, staging_slots)
