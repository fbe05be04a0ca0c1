"""System presets (``systems.toml``): named combinations of the three policies and memory settings.

``--set section.key=value`` overrides a parameter of every system run, ``--set SYSTEM:section.key=value``
one of SYSTEM only (:func:`system_overrides`); the resolved :class:`SystemConfig` is what a result's
manifest records.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import Any, Mapping, Sequence

from dali_sim.hardware.implementation import ANY, get_implementation
from dali_sim.models.spec import ModelSpec
from dali_sim.policies.base import CACHES, PLACEMENTS, PREFETCHERS, Policy, PolicyConfig
from dali_sim.registry import Registry, UnknownNameError
from dali_sim.runtime.memory import MemoryConfig

DEVICES = ("gpu", "cpu")
#: what a preset is (``reading`` in systems.toml; docs/policies.md, "Readings")
READINGS = ("paper", "best", "ours", "baseline", "bound", "reference")
FAMILIES: dict[str, Registry] = {"placement": PLACEMENTS, "cache": CACHES, "prefetch": PREFETCHERS}


@dataclass(frozen=True)
class PolicyChoice:
    family: str
    name: str
    config: PolicyConfig

    def build(self) -> Policy:
        return FAMILIES[self.family].get(self.name)(self.config)

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.name, **dataclasses.asdict(self.config)}


@dataclass(frozen=True)
class SystemConfig:
    """A resolved preset. A *time bound* (``time_bound``, preset key ``bound = "time"``: ``lower-bound``)
    has no policies (``placement``, ``cache`` and ``prefetch`` are None): the simulator computes its time
    directly (``dali_sim.sim.lower_bound``), and the executor refuses it."""

    name: str
    description: str
    placement: PolicyChoice | None
    cache: PolicyChoice | None
    prefetch: PolicyChoice | None
    memory: MemoryConfig
    dense_device: str = "gpu"  # where attention, router and shared experts run
    implementation: str = "bare"  # how the system's code runs (dali_sim/hardware/implementations.toml)
    time_bound: bool = False
    reading: str = ""  # one of READINGS ('' for a system built in code)
    source: str = ""  # where the reading was read (repository, commit, file, function)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "reading": self.reading,
            "description": self.description,
            "placement": self.placement.to_dict() if self.placement else None,
            "cache": self.cache.to_dict() if self.cache else None,
            "prefetch": self.prefetch.to_dict() if self.prefetch else None,
            "memory": dataclasses.asdict(self.memory),
            "system": {"dense_device": self.dense_device, "implementation": self.implementation},
        }
        if self.time_bound:
            out["bound"] = "time"
        return out

    def policies(self) -> tuple[PolicyChoice, ...]:
        """The placement, cache and prefetch choices (none for a time bound)."""
        return tuple(c for c in (self.placement, self.cache, self.prefetch) if c is not None)

    @property
    def needs_future(self) -> bool:
        """Whether a policy reads next-use times (``dali trace enrich``), e.g. the ``belady`` cache."""
        return any(c.build().needs_future for c in self.policies())


@functools.lru_cache(maxsize=1)
def _presets() -> dict[str, dict[str, Any]]:
    text = resources.files("dali_sim.policies").joinpath("systems.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


def system_names() -> list[str]:
    return sorted(_presets())


def system_description(name: str) -> str:
    return _presets()[name]["description"]


def system_reading(name: str) -> str:
    """The preset's reading: paper, best, ours, baseline, bound or reference (:data:`READINGS`)."""
    return _presets()[name].get("reading", "")


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, dict[str, str]]:
    """``["cache.policy=lfu", "memory.cache_experts=4"]`` -> ``{"cache": {...}, "memory": {...}}``."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        section, dot, field = key.strip().partition(".")
        if not sep or not dot or not field:
            raise ValueError(f"--set {item!r}: expected [SYSTEM:]section.key=value, e.g. memory.cache_experts=4 or "
                             "dali:prefetch.k=2")
        out.setdefault(section, {})[field] = value.strip()
    return out


def merge_overrides(*parts: Mapping[str, Mapping[str, str]] | None) -> dict[str, dict[str, str]]:
    """Section -> key -> value overrides, later parts winning key by key."""
    out: dict[str, dict[str, str]] = {}
    for part in parts:
        for section, values in (part or {}).items():
            out.setdefault(section, {}).update(values)
    return out


def system_overrides(items: list[str] | tuple[str, ...],
                     systems: Sequence[str]) -> dict[str, dict[str, dict[str, str]]]:
    """``--set`` items per system: ``SYSTEM:section.key=value`` applies to SYSTEM only (and wins over a plain
    ``section.key=value``, which applies to every system). A SYSTEM that is not run is an error."""
    common: list[str] = []
    specific: dict[str, list[str]] = {}
    for item in items:
        key = item.partition("=")[0]
        name, colon, _ = key.partition(":")
        if not colon:
            common.append(item)
            continue
        name = name.strip()
        if name not in systems:
            raise ValueError(f"--set {item!r}: system {name!r} is not one of the systems run here "
                             f"({', '.join(systems)})")
        specific.setdefault(name, []).append(item.split(":", 1)[1])
    base = parse_overrides(common)
    return {name: merge_overrides(base, parse_overrides(specific.get(name, []))) for name in systems}


def _choice(family: str, preset: Mapping[str, Any], overrides: Mapping[str, str], system: str) -> PolicyChoice:
    merged = {**preset, **overrides}
    name = merged.pop("policy", None)
    if name is None:
        raise ValueError(f"system {system!r}: no {family} policy")
    cls = FAMILIES[family].get(name)
    config = cls.Config().with_overrides(merged, family)
    return PolicyChoice(family, name, config)


def _for_model(section: Mapping[str, Any], family: str | None) -> dict[str, Any]:
    """Per-model preset values: ``{ default = X, mixtral = Y }`` picks by the model's family."""
    out = {}
    for key, value in section.items():
        if isinstance(value, Mapping):
            if "default" not in value:
                raise ValueError(f"per-model preset value {key} = {dict(value)} needs a 'default'")
            value = value.get(family, value["default"]) if family else value["default"]
        out[key] = value
    return out


def resolve_system(name: str, overrides: Mapping[str, Mapping[str, str]] | None = None,
                   model: ModelSpec | None = None) -> SystemConfig:
    """A preset with ``overrides`` (section -> key -> value) applied and every value typed and checked.

    Preset values given per model family (e.g. DALI's prefetch size) are taken for ``model``'s family,
    or their ``default`` when no model is given."""
    presets = _presets()
    if name not in presets:
        raise UnknownNameError(f"unknown system {name!r}; known: {', '.join(sorted(presets))}")
    family = model.family if model is not None else None
    p = {k: _for_model(v, family) if isinstance(v, Mapping) else v for k, v in presets[name].items()}
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - {"placement", "cache", "prefetch", "memory", "system"})
    if unknown:
        raise ValueError(f"unknown --set section(s) {unknown}; sections: placement, cache, prefetch, memory, system")
    reading = p.get("reading", "")
    if reading not in READINGS:
        raise ValueError(f"system {name!r}: reading = {reading!r}; one of {', '.join(READINGS)}")
    time_bound = p.get("bound") == "time"
    if "bound" in p and not time_bound:
        raise ValueError(f"system {name!r}: bound = {p['bound']!r}; the only kind is \"time\"")
    choices: dict[str, PolicyChoice | None] = dict.fromkeys(FAMILIES)
    for family in FAMILIES:
        if time_bound:
            if overrides.get(family):
                raise ValueError(f"system {name!r} is a time bound with no {family} policy: drop the --set "
                                 f"{family}.* overrides for it")
            continue
        preset_part = dict(p[family])
        if "policy" in overrides.get(family, {}) and overrides[family]["policy"] != preset_part["policy"]:
            preset_part = {"policy": overrides[family]["policy"]}  # a new policy starts from its defaults
        choices[family] = _choice(family, preset_part, overrides.get(family, {}), name)
    memory = MemoryConfig().with_overrides({**p.get("memory", {}), **overrides.get("memory", {})}, "memory")
    system = {"dense_device": "gpu", "implementation": "bare", **p.get("system", {})}
    sys_over = dict(overrides.get("system", {}))
    bad = sorted(set(sys_over) - {"dense_device", "implementation"})
    if bad:
        raise ValueError(f"unknown parameter system.{bad[0]}; system parameters: dense_device, implementation")
    system.update(sys_over)
    if system["dense_device"] not in DEVICES:
        raise ValueError(f"system.dense_device must be gpu or cpu, got {system['dense_device']!r}")
    if system["implementation"] == ANY:
        if not time_bound:
            raise ValueError(f"system {name!r}: system.implementation={ANY} is only for a time bound (lower-bound)")
    else:
        get_implementation(system["implementation"])  # an unknown name fails here, listing the known ones
    return SystemConfig(name, p["description"], choices["placement"], choices["cache"], choices["prefetch"],
                        memory, system["dense_device"], system["implementation"], time_bound, reading,
                        p.get("source", ""))


__all__ = ["READINGS", "PolicyChoice", "SystemConfig", "merge_overrides", "parse_overrides", "resolve_system",
           "system_names", "system_overrides", "system_reading"]
