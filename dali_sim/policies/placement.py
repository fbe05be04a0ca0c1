"""Baseline placement policies: which activated experts run on the GPU and which on the CPU."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dali_sim.policies.base import (
    NEVER,
    PLACEMENTS,
    LayerView,
    PlacementPolicy,
    PlacementRule,
    PolicyConfig,
    SetupContext,
    registered,
)


@registered(PLACEMENTS)
class GpuOnly(PlacementPolicy):
    name = "gpu-only"
    description = "every activated expert on the GPU, fetched on demand when not resident"

    def place(self, view: LayerView) -> np.ndarray:
        return np.ones(len(view.experts), dtype=bool)

    def rule_form(self, ctx: SetupContext) -> PlacementRule:
        return PlacementRule.constant(ctx.num_layers, True)


@registered(PLACEMENTS)
class CpuOnly(PlacementPolicy):
    name = "cpu-only"
    description = "every routed expert on the CPU (attention and the rest stay on the dense device)"
    may_fetch = False

    def place(self, view: LayerView) -> np.ndarray:
        return np.zeros(len(view.experts), dtype=bool)

    def rule_form(self, ctx: SetupContext) -> PlacementRule:
        return PlacementRule.constant(ctx.num_layers, False)


@dataclass(frozen=True)
class StaticLayersConfig(PolicyConfig):
    cpu_layers: int = field(default=-1, metadata={
        "help": "the first N MoE layers run their experts on the CPU (llama.cpp --n-cpu-moe); -1 = every "
                "layer whose cache cannot hold all its experts"})
    offload_min_tokens: int = field(default=0, metadata={
        "help": "llama.cpp op offload: in a CPU layer, when the batch reaches this many tokens the activated experts "
                "are copied to the GPU for that step (staging buffer, not cached); 0 = off (llama.cpp: 32)"})
    offload_basis: str = field(default="step", metadata={
        "help": "what must reach offload_min_tokens: 'step' (the step's token count: llama.cpp's batch size of "
                "the op) or 'expert' (each expert's own workload)"})

    def __post_init__(self) -> None:
        if isinstance(self.offload_min_tokens, bool) or not isinstance(self.offload_min_tokens, int) \
                or self.offload_min_tokens < 0:
            raise ValueError(f"placement.offload_min_tokens must be an integer >= 0 (0 = off), "
                             f"got {self.offload_min_tokens!r}")
        if self.offload_basis not in ("step", "expert"):
            raise ValueError(f"placement.offload_basis must be 'step' or 'expert', got {self.offload_basis!r}")


@registered(PLACEMENTS)
class StaticLayers(PlacementPolicy[StaticLayersConfig]):
    name = "static-layers"
    description = "experts of the first N MoE layers on the CPU, the rest on the GPU (llama.cpp --n-cpu-moe)"
    Config = StaticLayersConfig
    may_fetch = False

    def __init__(self, config: StaticLayersConfig | None = None):
        super().__init__(config)
        # op offload copies CPU-layer experts to the GPU for big batches: this instance then fetches
        self.may_fetch = self.config.offload_min_tokens > 0

    def required_capacities(self, num_layers: int, num_experts: int) -> np.ndarray | None:
        n = self.config.cpu_layers
        if n < 0:
            return None  # as many whole layers as the budget holds (memory.layout=whole-layers)
        if n > num_layers:
            raise ValueError(f"placement.cpu_layers={n} is not in 0..{num_layers}")
        return np.where(np.arange(num_layers) < n, 0, num_experts)

    def setup(self, ctx: SetupContext) -> None:
        full = ctx.capacities >= ctx.num_experts
        n = self.config.cpu_layers
        if n < 0:
            n = int(np.argmax(full)) if full.any() else ctx.num_layers
        if not 0 <= n <= ctx.num_layers:
            raise ValueError(f"placement.cpu_layers={n} is not in 0..{ctx.num_layers}")
        if not full[n:].all():
            raise ValueError(f"static-layers puts MoE layers {n}.. on the GPU, but their caches do not hold all "
                             f"{ctx.num_experts} experts (capacities {ctx.capacities.tolist()}); "
                             "use memory.layout=whole-layers")
        self.gpu_layer = np.arange(ctx.num_layers) >= n
        self.cpu_layers = n

    def place(self, view: LayerView) -> np.ndarray:
        if self.gpu_layer[view.layer]:
            return np.ones(len(view.experts), dtype=bool)
        m = self.config.offload_min_tokens
        if m <= 0:
            return np.zeros(len(view.experts), dtype=bool)
        if self.config.offload_basis == "step":
            return np.full(len(view.experts), view.tokens >= m)
        return np.asarray(view.counts) >= m

    def rule_form(self, ctx: SetupContext) -> PlacementRule:
        m = self.config.offload_min_tokens
        by_step = m > 0 and self.config.offload_basis == "step"
        min_tokens = np.where(self.gpu_layer | (not by_step), NEVER, m).astype(np.int64)
        by_count = (np.arange(m + 1) >= m).astype(np.int8) if m > 0 and not by_step else np.zeros(1, np.int8)
        return PlacementRule(self.gpu_layer.copy(), min_tokens, False, False, by_count)
