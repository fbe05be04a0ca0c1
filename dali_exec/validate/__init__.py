"""Validation: the executor and the simulator on identical inputs, compared (docs/validation.md).

``validate(trace, ValidationConfig(systems=(...), ...), out)`` calibrates a profile on this machine (or
takes one), replays each system on the devices and simulates the same replay, and writes per-system
time errors, counters side by side, timelines, a CSV, a markdown table and a plot into ``out``.
:mod:`.compare` holds the torch-free comparison of two results.
"""

from dali_exec.validate.compare import compare, rank_agreement
from dali_exec.validate.run import ValidationConfig, ValidationReport, calibration_points, check_profile, validate

__all__ = ["ValidationConfig", "ValidationReport", "calibration_points", "check_profile", "compare",
           "rank_agreement", "validate"]
