"""Timing-free decision runtime shared by the simulator and the executor: controller and memory plan."""

from dali_sim.runtime.controller import CPU, FETCH, HIT, PREFETCHED, SOURCE_NAMES, Controller, LayerPlan
from dali_sim.runtime.memory import MemoryConfig, MemoryPlan, plan_memory

__all__ = ["CPU", "FETCH", "HIT", "PREFETCHED", "SOURCE_NAMES", "Controller", "LayerPlan", "MemoryConfig",
           "MemoryPlan", "plan_memory"]
