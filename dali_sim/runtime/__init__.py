"""Timing-free decision runtime shared by the simulator and the executor: controller and memory plan
(names imported on first use)."""

from dali_sim.lazy import lazy_exports

_EXPORTS = {**dict.fromkeys(("CPU", "FETCH", "HIT", "PREFETCHED", "SOURCE_NAMES", "Controller", "LayerPlan"),
                            "dali_sim.runtime.controller"),
            **dict.fromkeys(("MemoryConfig", "MemoryPlan", "plan_memory"), "dali_sim.runtime.memory")}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
