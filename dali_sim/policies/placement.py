"""Baseline placement policies: which activated experts run on the GPU and which on the CPU."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dali_sim.policies.base import PLACEMENTS, LayerView, PlacementPolicy, PolicyConfig, SetupContext, registered


@registered(PLACEMENTS)
class GpuOnly(PlacementPolicy):
    name = "gpu-only"
    description = "every activated expert on the GPU, fetched on demand when not resident"

    def place(self, view: LayerView) -> np.ndarray:
        return np.ones(len(view.experts), dtype=bool)


@registered(PLACEMENTS)
class CpuOnly(PlacementPolicy):
    name = "cpu-only"
    description = "every routed expert on the CPU (attention and the rest stay on the dense device)"
    may_fetch = False

    def place(self, view: LayerView) -> np.ndarray:
        return np.zeros(len(view.experts), dtype=bool)


@dataclass(frozen=True)
class StaticLayersConfig(PolicyConfig):
    cpu_layers: int = field(default=-1, metadata={
        "help": "the first N MoE layers run their experts on the CPU (llama.cpp --n-cpu-moe); -1 = every "
                "layer whose cache cannot hold all its experts"})


@registered(PLACEMENTS)
class StaticLayers(PlacementPolicy[StaticLayersConfig]):
    name = "static-layers"
    description = "experts of the first N MoE layers on the CPU, the rest on the GPU (llama.cpp --n-cpu-moe)"
    Config = StaticLayersConfig
    may_fetch = False

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
        return np.full(len(view.experts), bool(self.gpu_layer[view.layer]))
