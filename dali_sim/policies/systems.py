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

from dali_sim.models.spec import ModelSpec
from dali_sim.policies.base import CACHES, PLACEMENTS, PREFETCHERS, Policy, PolicyConfig
from dali_sim.registry import Registry, UnknownNameError
from dali_sim.runtime.memory import MemoryConfig

DEVICES = ("gpu", "cpu")
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
    name: str
    description: str
    placement: PolicyChoice
    cache: PolicyChoice
    prefetch: PolicyChoice
    memory: MemoryConfig
    dense_device: str = "gpu"  # where attention, router and shared experts run

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "placement": self.placement.to_dict(),
            "cache": self.cache.to_dict(),
            "prefetch": self.prefetch.to_dict(),
            "memory": dataclasses.asdict(self.memory),
            "system": {"dense_device": self.dense_device},
        }

    @property
    def needs_future(self) -> bool:
        """Whether a policy reads next-use times (``dali trace enrich``), e.g. the ``belady`` cache."""
        return any(c.build().needs_future for c in (self.placement, self.cache, self.prefetch))


@functools.lru_cache(maxsize=1)
def _presets() -> dict[str, dict[str, Any]]:
    text = resources.files("dali_sim.policies").joinpath("systems.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


def system_names() -> list[str]:
    return sorted(_presets())


def system_description(name: str) -> str:
    return _presets()[name]["description"]


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
    choices = {}
    for family in FAMILIES:
        preset_part = dict(p[family])
        if "policy" in overrides.get(family, {}) and overrides[family]["policy"] != preset_part["policy"]:
            preset_part = {"policy": overrides[family]["policy"]}  # a new policy starts from its defaults
        choices[family] = _choice(family, preset_part, overrides.get(family, {}), name)
    memory = MemoryConfig().with_overrides({**p.get("memory", {}), **overrides.get("memory", {})}, "memory")
    system = {"dense_device": "gpu", **p.get("system", {})}
    sys_over = dict(overrides.get("system", {}))
    bad = sorted(set(sys_over) - {"dense_device"})
    if bad:
        raise ValueError(f"unknown parameter system.{bad[0]}; system parameters: dense_device")
    system.update(sys_over)
    if system["dense_device"] not in DEVICES:
        raise ValueError(f"system.dense_device must be gpu or cpu, got {system['dense_device']!r}")
    return SystemConfig(name, p["description"], choices["placement"], choices["cache"], choices["prefetch"],
                        memory, system["dense_device"])


__all__ = ["PolicyChoice", "SystemConfig", "merge_overrides", "parse_overrides", "resolve_system", "system_names",
           "system_overrides"]
