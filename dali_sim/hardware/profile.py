"""Analytic hardware profiles: typed specs of the GPU, the CPU and the host-to-device link.

A profile is a TOML file (format in ``docs/hardware.md``). Every number in it carries a
``<field>_source`` string naming where it comes from (a spec sheet, or ``assumption: ...``), so no
cost constant lives in code. :func:`load_profile` also reads measured profiles (JSON, see
:mod:`dali_sim.hardware.measured`); both kinds feed :class:`dali_sim.hardware.cost.CostModel`.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Union

from dali_sim.registry import UnknownNameError

if TYPE_CHECKING:
    from dali_sim.hardware.measured import MeasuredProfile

DEVICES = ("gpu", "cpu")
DEFAULT_HARDWARE = "rtx3090-epyc7532"  # the DALI paper's testbed: the default profile of every command
PROFILE_SUFFIXES = (".toml", ".json")
GIB = 1 << 30
#: a sanity bound on memory sizes (2^40 GiB = 1 ZiB), far below where GiB -> bytes overflows; not a cost
MAX_MEMORY_GIB = float(1 << 40)


class ProfileError(ValueError):
    """A hardware profile (file or dict) is malformed; the message names the file and the field."""


# ---- validation helpers (shared with measured.py) -------------------------------------------
class FieldReader:
    """Reads typed fields from one table of a profile, raising :class:`ProfileError` with
    ``<source>: <prefix.field>: <problem>`` on anything missing, mistyped or out of range."""

    def __init__(self, source: str, data: Any, prefix: str = ""):
        self.source = source
        self.prefix = prefix
        if not isinstance(data, Mapping):
            raise self.error("", f"must be a table/object, got {type(data).__name__}")
        self.data = data

    def where(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix and key else (key or self.prefix or "(top level)")

    def error(self, key: str, problem: str) -> ProfileError:
        return ProfileError(f"{self.source}: {self.where(key)}: {problem}")

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str) -> Any:
        if key not in self.data:
            raise self.error(key, "missing")
        return self.data[key]

    def string(self, key: str, default: str | None = None, *, nonempty: bool = True) -> str:
        if key not in self.data and default is not None:
            return default
        value = self.raw(key)
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {value!r}")
        if nonempty and not value.strip():
            raise self.error(key, "must not be empty")
        return value

    def number(self, key: str, *, minimum: float = 0.0, strict: bool = True, maximum: float | None = None) -> float:
        """A finite number > ``minimum`` (``>=`` if not ``strict``) and ``<= maximum``."""
        return check_number(self.raw(key), self, key, minimum=minimum, strict=strict, maximum=maximum)

    def table(self, key: str) -> "FieldReader":
        return FieldReader(self.source, self.raw(key), self.where(key))

    def reject_unknown(self, allowed: set[str]) -> None:
        unknown = sorted(set(self.data) - allowed)
        if unknown:
            raise self.error("", f"unknown field(s) {unknown}; allowed: {sorted(allowed)}")


def check_number(value: Any, reader: FieldReader, key: str, *, minimum: float = 0.0, strict: bool = True,
                 maximum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise reader.error(key, f"must be a number, got {value!r}")
    x = float(value)
    if not math.isfinite(x):
        raise reader.error(key, f"must be finite, got {value!r}")
    if x < minimum or (strict and x == minimum):
        raise reader.error(key, f"must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    if maximum is not None and x > maximum:
        raise reader.error(key, f"must be <= {maximum:g}, got {value!r}")
    return x


# ---- analytic profile dataclasses ------------------------------------------------------------
@dataclass(frozen=True)
class DeviceSpec:
    """Roofline description of one compute device (the GPU or the CPU cores the runtime may use).

    ``peak_tflops`` maps a weight precision name (``bf16``, ``q4_0``, ...) to the peak rate of the
    arithmetic used to multiply weights stored in it; ``default`` covers the others (quantised
    weights are usually dequantised to a wider type before the multiply). ``compute_efficiency`` is
    keyed the same way: the share of that peak large matrix products reach.
    """

    name: str
    memory_gib: float
    peak_tflops: Mapping[str, float]
    mem_bandwidth_gbs: float
    compute_efficiency: Mapping[str, float]
    memory_efficiency: float
    kernel_us: float  # device time one small kernel (GPU, inside a CUDA graph) or parallel op (CPU) costs
    launch_us: float  # host time to launch one kernel outside a graph (GPU); dispatch of one op (CPU)
    sync_us: float  # one host-device round trip: the host waits for the device and reads a small result
    gemm_tile_tokens: float  # tokens a GEMM tile holds: fewer tokens per call lower the compute rate (0 = none)
    activation_bytes: float
    #: CPU only: the share of ``mem_bandwidth_gbs`` all host-memory readers together (cores and DMA) sustain
    shared_bandwidth_efficiency: float | None = None

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s for weights stored in ``precision``."""
        tf = self.peak_tflops.get(precision, self.peak_tflops["default"])
        return tf * 1e12

    def efficiency(self, precision: str) -> float:
        return self.compute_efficiency.get(precision, self.compute_efficiency["default"])

    def effective_flops(self, precision: str) -> float:
        return self.peak_flops(precision) * self.efficiency(precision)

    @property
    def effective_bandwidth(self) -> float:
        """Achievable memory bandwidth in bytes/s."""
        return self.mem_bandwidth_gbs * 1e9 * self.memory_efficiency

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)


@dataclass(frozen=True)
class LinkSpec:
    """Host-to-device copy link (PCIe): ``latency + bytes / (bandwidth * efficiency)``, the efficiency
    of pinned (page-locked) host memory, or ``pageable_efficiency`` for copies from pageable memory
    (staged by the driver through a pinned bounce buffer)."""

    name: str
    bandwidth_gbs: float
    efficiency: float
    pageable_efficiency: float
    latency_us: float

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth_gbs * 1e9 * self.efficiency

    def bandwidth(self, pageable: bool = False) -> float:
        return self.bandwidth_gbs * 1e9 * (self.pageable_efficiency if pageable else self.efficiency)


@dataclass(frozen=True)
class HardwareProfile:
    """An analytic (roofline) profile. ``sources`` maps ``gpu.mem_bandwidth_gbs``-style field paths
    to the public source (or stated assumption) of each number."""

    name: str
    description: str
    gpu: DeviceSpec
    cpu: DeviceSpec
    link: LinkSpec
    sources: Mapping[str, str]
    path: str = field(default="", compare=False)

    kind = "analytic"

    def device(self, device: str) -> DeviceSpec:
        check_device(device)
        return self.gpu if device == "gpu" else self.cpu

    @property
    def gpu_memory_bytes(self) -> int:
        return self.gpu.memory_bytes

    def to_dict(self) -> dict[str, Any]:
        """The TOML structure as a dict (numbers and their ``*_source`` strings)."""
        out: dict[str, Any] = {"kind": self.kind, "name": self.name, "description": self.description}
        for part, spec in (("gpu", self.gpu), ("cpu", self.cpu), ("link", self.link)):
            d: dict[str, Any] = {}
            for f in spec.__dataclass_fields__:
                value = getattr(spec, f)
                if value is None:
                    continue
                d[f] = dict(value) if isinstance(value, Mapping) else value
                if f"{part}.{f}" in self.sources:
                    d[f"{f}_source"] = self.sources[f"{part}.{f}"]
            out[part] = d
        return out


Profile = Union[HardwareProfile, "MeasuredProfile"]


def check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"device must be 'gpu' or 'cpu', got {device!r}")


# ---- parsing ---------------------------------------------------------------------------------
_DEVICE_NUMBERS = {
    # field: (minimum, strict, maximum)
    "memory_gib": (0.0, True, MAX_MEMORY_GIB),
    "mem_bandwidth_gbs": (0.0, True, None),
    "memory_efficiency": (0.0, True, 1.0),
    "kernel_us": (0.0, False, None),
    "launch_us": (0.0, False, None),
    "sync_us": (0.0, False, None),
    "gemm_tile_tokens": (0.0, False, None),
    "activation_bytes": (0.0, True, None),
}
_CPU_NUMBERS = {"shared_bandwidth_efficiency": (0.0, True, 1.0)}
_LINK_NUMBERS = {
    "bandwidth_gbs": (0.0, True, None),
    "efficiency": (0.0, True, 1.0),
    "pageable_efficiency": (0.0, True, 1.0),
    "latency_us": (0.0, False, None),
}


def _sourced_numbers(r: FieldReader, spec: Mapping[str, tuple], sources: dict[str, str]) -> dict[str, float]:
    out = {}
    for key, (lo, strict, hi) in spec.items():
        out[key] = r.number(key, minimum=lo, strict=strict, maximum=hi)
        _need_source(r, key, sources)
    return out


def _need_source(r: FieldReader, key: str, sources: dict[str, str]) -> None:
    skey = f"{key}_source"
    if skey not in r.data:
        raise r.error(skey, "missing: every number needs a source (write 'assumption: <why>' if it is one)")
    sources[r.where(key)] = r.string(skey)


def _precision_table(r: FieldReader, key: str, sources: dict[str, str], *, maximum: float | None = None,
                     allow_number: bool = False) -> dict[str, float]:
    """A table keyed by precision names with a required ``default`` (or, if allowed, one number)."""
    from dali_sim.models.presets import precision_names

    _need_source(r, key, sources)
    if allow_number and not isinstance(r.raw(key), Mapping):
        return {"default": r.number(key, maximum=maximum)}
    t = r.table(key)
    t.reject_unknown(set(precision_names()) | {"default"})
    if not t.has("default"):
        raise t.error("default", "missing (the value for precisions not listed)")
    return {k: t.number(k, maximum=maximum) for k in sorted(t.data)}


def _device_from(r: FieldReader, sources: dict[str, str], extra: Mapping[str, tuple] = {}) -> DeviceSpec:
    numbers = _sourced_numbers(r, {**_DEVICE_NUMBERS, **extra}, sources)
    peak = _precision_table(r, "peak_tflops", sources)
    efficiency = _precision_table(r, "compute_efficiency", sources, maximum=1.0, allow_number=True)
    fields = {"peak_tflops", "compute_efficiency", *_DEVICE_NUMBERS, *extra}
    r.reject_unknown({"name"} | fields | {f"{k}_source" for k in fields})
    return DeviceSpec(name=r.string("name"), peak_tflops=peak, compute_efficiency=efficiency, **numbers)


def profile_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> HardwareProfile:
    """Validate and build an analytic profile from the TOML structure."""
    top = FieldReader(source, data)
    kind = top.string("kind")
    if kind != "analytic":
        raise top.error("kind", f"must be 'analytic' in a TOML profile (measured profiles are JSON), got {kind!r}")
    top.reject_unknown({"kind", "name", "description", "gpu", "cpu", "link"})
    sources: dict[str, str] = {}
    gpu = _device_from(top.table("gpu"), sources)
    cpu = _device_from(top.table("cpu"), sources, _CPU_NUMBERS)
    lr = top.table("link")
    link_numbers = _sourced_numbers(lr, _LINK_NUMBERS, sources)
    lr.reject_unknown({"name"} | set(_LINK_NUMBERS) | {f"{k}_source" for k in _LINK_NUMBERS})
    link = LinkSpec(name=lr.string("name"), **link_numbers)
    return HardwareProfile(
        name=top.string("name"), description=top.string("description"), gpu=gpu, cpu=cpu, link=link,
        sources=sources, path=source if source != "<dict>" else "",
    )


def read_analytic_profile(path: str | Path) -> HardwareProfile:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ProfileError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return profile_from_dict(data, str(path))


# ---- lookup ----------------------------------------------------------------------------------
def _shipped_dir() -> Path:
    return Path(str(resources.files("dali_sim.hardware").joinpath("profiles")))


def profile_names() -> list[str]:
    """Names of the shipped profiles (file stems in ``dali_sim/hardware/profiles``)."""
    d = _shipped_dir()
    return sorted({p.stem for p in d.iterdir() if p.suffix in PROFILE_SUFFIXES}) if d.is_dir() else []


def _looks_like_path(s: str) -> bool:
    return s.endswith(PROFILE_SUFFIXES) or "/" in s or "\\" in s


def resolve_profile_path(name_or_path: str | Path) -> Path:
    """A shipped profile name or a file path -> the file to read."""
    if isinstance(name_or_path, Path) or _looks_like_path(str(name_or_path)):
        path = Path(name_or_path)
        if not path.exists():
            raise ProfileError(f"{path}: no such hardware profile file")
        if not path.is_file() or path.is_fifo():
            raise ProfileError(f"{path}: a hardware profile must be a regular file")
        return path
    for suffix in PROFILE_SUFFIXES:
        path = _shipped_dir() / f"{name_or_path}{suffix}"
        if path.is_file():
            return path
    raise UnknownNameError(f"unknown hardware profile {name_or_path!r}; known: {', '.join(profile_names()) or '(none)'}")


def load_profile(name_or_path: str | Path) -> Profile:
    """Load a shipped profile by name, or a file: ``.toml`` analytic, ``.json`` measured."""
    path = resolve_profile_path(name_or_path)
    if path.suffix == ".json":
        from dali_sim.hardware.measured import read_measured_profile

        return read_measured_profile(path)
    if path.suffix == ".toml":
        return read_analytic_profile(path)
    raise ProfileError(f"{path}: unknown profile file type {path.suffix!r}; expected .toml (analytic) or .json (measured)")
