"""Hardware profiles (analytic TOML, measured JSON) and the cost model built on them."""

from dali_sim.hardware.cost import CostModel, RooflineCosts, attention_flops_per_pair
from dali_sim.hardware.measured import (
    CurveTable,
    DenseTable,
    MeasuredDevice,
    MeasuredProfile,
    ModelShape,
    TableCosts,
    interp_extrap,
    measured_profile_from_dict,
    read_measured_profile,
    write_measured_profile,
)
from dali_sim.hardware.profile import (
    DEVICES,
    DeviceSpec,
    HardwareProfile,
    LinkSpec,
    Profile,
    ProfileError,
    load_profile,
    profile_from_dict,
    profile_names,
    read_analytic_profile,
)

__all__ = [
    "DEVICES",
    "CostModel",
    "CurveTable",
    "DenseTable",
    "DeviceSpec",
    "HardwareProfile",
    "LinkSpec",
    "MeasuredDevice",
    "MeasuredProfile",
    "ModelShape",
    "Profile",
    "ProfileError",
    "RooflineCosts",
    "TableCosts",
    "attention_flops_per_pair",
    "interp_extrap",
    "load_profile",
    "measured_profile_from_dict",
    "profile_from_dict",
    "profile_names",
    "read_analytic_profile",
    "read_measured_profile",
    "write_measured_profile",
]
