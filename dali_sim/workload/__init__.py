"""From traces to simulated work: batches, steps and per-layer expert workloads (names imported on first use)."""

from dali_sim.lazy import lazy_exports

_EXPORTS = {**dict.fromkeys(("SparseCounts", "Workload", "WorkloadConfig"), "dali_sim.workload.builder"),
            **dict.fromkeys(("ProfileSpec", "ProfiledTrace", "apply_profile"), "dali_sim.workload.profiling")}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
