"""The simulator: SimPy engine, no-timing replay, metrics and timelines."""

from dali_sim.sim.simulate import DEFAULT_HARDWARE, SimResult, simulate

__all__ = ["DEFAULT_HARDWARE", "SimResult", "simulate"]
