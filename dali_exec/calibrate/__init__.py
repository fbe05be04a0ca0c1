"""Calibration: microbenchmarks with the executor's own code that write a measured hardware profile."""

from dali_exec.calibrate.micro import Microbench, MicroSettings
from dali_exec.calibrate.profile import CalibrationConfig, calibrate, calibrate_to

__all__ = ["CalibrationConfig", "MicroSettings", "Microbench", "calibrate", "calibrate_to"]
