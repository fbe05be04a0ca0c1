"""From traces to simulated work: batches, steps and per-layer expert workloads."""

from dali_sim.workload.builder import SparseCounts, Workload, WorkloadConfig

__all__ = ["SparseCounts", "Workload", "WorkloadConfig"]
