"""Sweep specs (TOML): traces x hardware x grid x systems -> one :class:`RunConfig` per configuration.

The format is in docs/sweeps.md. :func:`load_spec` reads and checks a spec completely, resolving every
configuration's system (so an unknown system, grid key or bad value is one line naming the spec file
and key before anything runs); :func:`plan_runs` then synthesises the recipe traces into the output
folder and gives each configuration its stable hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from dali_sim.files import check_input
from dali_sim.hardware.profile import DEFAULT_HARDWARE, MAX_MEMORY_GIB, load_profile, resolve_profile_path
from dali_sim.models.presets import apply_precision
from dali_sim.models.spec import ModelSpec
from dali_sim.policies.systems import SystemConfig, merge_overrides, parse_overrides, resolve_system, system_overrides
from dali_sim.trace.provenance import file_sha256
from dali_sim.workload.profiling import DEFAULT_PROFILE_SHARE, ProfileSpec

#: bumped when the meaning of a configuration hash changes (every stored result then reruns)
HASH_FORMAT = 2  # 2: the profiling split (profile_share) is part of a configuration
TOP_KEYS = ("traces", "systems", "hardware", "grid", "set", "baseline", "timing", "profile_share")
#: grid keys that are not ``[SYSTEM:]section.key`` overrides
BATCHING_KEYS = ("batch_size", "prefill_chunk")
MEMORY_KEYS = {"cache_ratio": "cache_ratio", "cache_experts": "cache_experts", "cache_init": "cache_init",
               "gpu_memory": "gpu_memory_gib"}
RUN_KEYS = ("seed", "precision")
GRID_KEYS = BATCHING_KEYS + tuple(MEMORY_KEYS) + RUN_KEYS
DEFAULTS = {"batch_size": 1, "prefill_chunk": 0, "seed": 0, "precision": None}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class SweepError(ValueError):
    """A sweep that cannot run or a results folder that cannot be used; the message names the file."""


class SpecError(SweepError):
    """A spec that cannot run; the message names the spec file and the key."""


@dataclass(frozen=True)
class TraceSource:
    """A trace of the spec: a file, or a recipe of ``dali trace synth`` made once into ``OUT/traces``."""

    name: str
    model: ModelSpec
    predictors: frozenset[str]  # its lookahead columns
    path: Path | None = None
    synth: Any = None  # dali_sim.trace.synth.SynthConfig
    grid: tuple[tuple[str, tuple[Any, ...]], ...] = ()  # this trace's own values of grid keys

    def output_path(self, out: Path) -> Path:
        return self.path if self.path is not None else out / "traces" / f"{self.name}.parquet"


@dataclass(frozen=True)
class RunConfig:
    """One configuration of a sweep, resolved. ``grid``: its value of every grid key of the spec (None where
    a ``SYSTEM:`` key is for another system); ``overrides``: what :func:`resolve_system` was given."""

    index: int
    trace: str
    model: str
    system: str
    hardware: str
    batch_size: int
    prefill_chunk: int
    seed: int
    precision: str | None
    timing: bool
    profile_share: float  # the first share of the trace's sequences profile, the rest are evaluated
    overrides: dict[str, dict[str, str]]
    grid: dict[str, Any]
    predictors: tuple[str, ...]
    needs_future: bool
    system_config: dict[str, Any]
    trace_path: str = ""
    trace_sha256: str = ""
    hardware_ref: str = ""  # the profile to load: a shipped name, or the file's path
    hardware_sha256: str = ""
    precision_name: str = ""

    @property
    def hash(self) -> str:
        """SHA-256 (16 hex digits) of what determines the result: the trace's bytes, the resolved system,
        the hardware profile's bytes, batching, seed, precision, timing and profiling split (not names or paths)."""
        key = {"format": HASH_FORMAT, "trace_sha256": self.trace_sha256, "system": self.system_config,
               "hardware": self.hardware_sha256, "batch_size": self.batch_size, "prefill_chunk": self.prefill_chunk,
               "seed": self.seed, "precision": self.precision_name, "timing": self.timing,
               "profile_share": self.profile_share}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"config_hash": self.hash}


@dataclass(frozen=True)
class SweepSpec:
    path: Path
    traces: tuple[TraceSource, ...]
    systems: tuple[str, ...]
    hardware: tuple[str, ...]
    grid: dict[str, tuple[Any, ...]]
    sets: tuple[str, ...] = ()
    baseline: str | None = None
    timing: bool = True
    profile_share: float = DEFAULT_PROFILE_SHARE
    runs: tuple[RunConfig, ...] = field(default_factory=tuple)

    def error(self, key: str, problem: str) -> SpecError:
        return SpecError(f"{self.path}: {key}: {problem}")


def _err(path: Path, key: str, problem: str) -> SpecError:
    return SpecError(f"{path}: {key}: {problem}")


def _string_list(path: Path, data: Mapping[str, Any], key: str, default: tuple[str, ...] | None) -> tuple[str, ...]:
    value = data.get(key, default)
    if value is None:
        raise _err(path, key, "missing (a list of names)")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v for v in value):
        raise _err(path, key, f"expected a non-empty list of names, got {value!r}")
    dup = sorted({v for v in value if list(value).count(v) > 1})
    if dup:
        raise _err(path, key, f"{dup[0]!r} is listed twice")
    return tuple(value)


def _local_path(spec_path: Path, text: str) -> Path:
    p = Path(text).expanduser()
    return p if p.is_absolute() else spec_path.parent / p


def _trace_source(path: Path, name: str, entry: Any, systems: tuple[str, ...]) -> TraceSource:
    key = f"traces.{name}"
    if not _NAME.match(name):
        raise _err(path, key, "a trace name must be letters, digits, '.', '_' or '-' (it names OUT/traces/NAME.parquet)")
    if not isinstance(entry, Mapping) or sorted(set(entry) - {"grid"}) not in (["path"], ["synth"]):
        raise _err(path, key, "give exactly one of path = \"FILE.parquet\" or synth = { model = ..., ... } "
                              "(the arguments of `dali trace synth`), and optionally grid = { KEY = [values] }")
    own = _trace_grid(path, key, entry.get("grid", {}), systems)
    source = _trace_file_or_recipe(path, name, key, entry)
    return dataclasses.replace(source, grid=own)


def _trace_grid(path: Path, key: str, data: Any, systems: tuple[str, ...]) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """A trace's own values of grid keys (checked like the grid's; that the keys are in [grid] is checked
    by :func:`load_spec`)."""
    if not isinstance(data, Mapping):
        raise _err(path, f"{key}.grid", f"expected a table of KEY = [values], got {data!r}")
    checked = _grid(path, data, systems, table=f"{key}.grid")
    return tuple(checked.items())


def _trace_file_or_recipe(path: Path, name: str, key: str, entry: Mapping[str, Any]) -> TraceSource:
    if "path" in entry:
        from dali_sim.trace.reader import read_meta

        if not isinstance(entry["path"], str):
            raise _err(path, f"{key}.path", f"expected a file name, got {entry['path']!r}")
        file = _local_path(path, entry["path"])
        try:
            check_input(file, "trace")
            meta = read_meta(file)
        except (OSError, ValueError) as exc:
            raise _err(path, f"{key}.path", str(exc)) from None
        return TraceSource(name, meta.model, frozenset(meta.predictors), path=file)
    config = _synth(path, key, entry["synth"])
    return TraceSource(name, config.spec(), frozenset(x.name for x in config.lookahead), synth=config)


def _synth(path: Path, key: str, recipe: Any):
    from dali_sim.trace.synth import SynthConfig

    key = f"{key}.synth"
    if not isinstance(recipe, Mapping):
        raise _err(path, key, f"expected a table of `dali trace synth` arguments, got {recipe!r}")
    known = [f.name for f in dataclasses.fields(SynthConfig)]
    unknown = sorted(set(recipe) - set(known))
    if unknown:
        raise _err(path, f"{key}.{unknown[0]}", f"not an argument of dali trace synth; known: {', '.join(known)}")
    args = dict(recipe)
    if "popularity_from" in args and isinstance(args["popularity_from"], str):
        args["popularity_from"] = str(_local_path(path, args["popularity_from"]))
    if isinstance(args.get("lookahead"), str):
        args["lookahead"] = [args["lookahead"]]
    if "lookahead" in args:
        args["lookahead"] = tuple(args["lookahead"])
    try:
        config = SynthConfig(**args)
    except (TypeError, ValueError) as exc:
        raise _err(path, key, str(exc)) from None
    return config


def _grid(path: Path, data: Any, systems: tuple[str, ...], table: str = "grid") -> dict[str, tuple[Any, ...]]:
    """The checked grid ``data`` (``table``: how the spec names it, ``grid`` or ``traces.NAME.grid``)."""
    if not isinstance(data, Mapping):
        raise _err(path, table, f"expected a table of KEY = [values], got {data!r}")
    if "cache_ratio" in data and "cache_experts" in data:
        raise _err(path, table, "give cache_ratio or cache_experts, not both")
    grid: dict[str, tuple[Any, ...]] = {}
    for key, values in data.items():
        where = _grid_key(key, table)
        if key not in GRID_KEYS:
            name, colon, rest = key.partition(":")
            target = rest if colon else key
            section, dot, param = target.partition(".")
            if not dot or not section or not param:
                raise _err(path, where, f"unknown grid key; grid keys: {', '.join(GRID_KEYS)}, or SECTION.KEY / "
                                        "SYSTEM:SECTION.KEY of --set (e.g. \"prefetch.k\", \"dali:prefetch.k\")")
            if colon and name not in systems:
                raise _err(path, where, f"system {name!r} is not one of the systems of this sweep ({', '.join(systems)})")
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        if not values:
            raise _err(path, where, "an empty list: give at least one value")
        for v in values:
            if not isinstance(v, (str, int, float, bool)):
                raise _err(path, where, f"values must be numbers, strings or booleans, got {v!r}")
        if len({json.dumps(v) for v in values}) != len(values):
            raise _err(path, where, f"a value is listed twice in {values!r}")
        _check_grid_values(path, where, key, values)
        grid[key] = tuple(values)
    return grid


def _check_grid_values(path: Path, where: str, key: str, values: list[Any]) -> None:
    def need(ok: Callable[[Any], bool], what: str) -> None:
        for v in values:
            if not ok(v):
                raise _err(path, where, f"{v!r}: expected {what}")

    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    is_num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    if key == "batch_size":
        need(lambda v: is_int(v) and v >= 1, "an integer >= 1")
    elif key in ("prefill_chunk", "seed", "cache_experts"):
        need(lambda v: is_int(v) and v >= 0, "an integer >= 0")
    elif key == "cache_ratio":
        need(lambda v: is_num(v) and 0 <= v <= 1, "a number in [0, 1]")
    elif key == "gpu_memory":
        need(lambda v: is_num(v) and 0 < v <= MAX_MEMORY_GIB, "a number of GiB > 0")
    elif key == "cache_init":
        need(lambda v: v in ("empty", "random", "frequency"), "empty, random or frequency")
    elif key == "precision":
        need(lambda v: isinstance(v, str) and bool(v), "a weight format such as bf16, q8_0, q4_0, mxfp4")


def _override_text(value: Any) -> str:
    """A TOML value as the ``--set`` text the policy configs parse."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def load_spec(path: str | Path) -> SweepSpec:
    """Read, check and expand a sweep spec (see the module docstring); :class:`SpecError` on any problem."""
    path = Path(path)
    try:
        check_input(path, "sweep spec")
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not UTF-8 text ({exc.reason})") from None
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise _err(path, unknown[0], f"unknown key; a sweep spec has: {', '.join(TOP_KEYS)}")
    traces_data = data.get("traces")
    if not isinstance(traces_data, Mapping) or not traces_data:
        raise _err(path, "traces", "missing: give at least one [traces.NAME] with path = ... or synth = {...}")
    systems = _string_list(path, data, "systems", None)
    from dali_sim.policies.systems import system_names

    for name in systems:
        if name not in system_names():
            raise _err(path, "systems", f"unknown system {name!r}; known: {', '.join(system_names())}")
    traces = tuple(_trace_source(path, name, entry, systems) for name, entry in traces_data.items())
    hardware = _string_list(path, data, "hardware", (DEFAULT_HARDWARE,))
    for i, h in enumerate(hardware):
        try:
            load_profile(_hardware_ref(path, h))
        except (OSError, ValueError) as exc:
            raise _err(path, f"hardware[{i}]", str(exc)) from None
    grid = _grid(path, data.get("grid", {}), systems)
    for t in traces:
        for k, _ in t.grid:
            if k not in grid:
                raise _err(path, _grid_key(k, f"traces.{t.name}.grid"),
                           "not a key of [grid]: a trace's grid replaces the values of a grid key for that trace")
    sets = data.get("set", [])
    if isinstance(sets, str):
        sets = [sets]
    if not isinstance(sets, list) or not all(isinstance(s, str) for s in sets):
        raise _err(path, "set", f"expected a list of \"[SYSTEM:]section.key=value\" strings, got {sets!r}")
    try:
        system_overrides(sets, list(systems))
    except ValueError as exc:
        raise _err(path, "set", str(exc)) from None
    baseline = data.get("baseline")
    if baseline is not None and baseline not in systems:
        raise _err(path, "baseline", f"{baseline!r} is not one of the systems of this sweep ({', '.join(systems)})")
    timing = data.get("timing", True)
    if not isinstance(timing, bool):
        raise _err(path, "timing", f"expected true or false, got {timing!r}")
    share = data.get("profile_share", DEFAULT_PROFILE_SHARE)
    try:
        ProfileSpec(share=share)
    except ValueError as exc:
        raise _err(path, "profile_share", str(exc)) from None
    spec = SweepSpec(path, traces, systems, hardware, grid, tuple(sets), baseline, timing, float(share))
    return dataclasses.replace(spec, runs=tuple(_expand(spec)))


def _hardware_ref(spec_path: Path, text: str) -> str:
    """A hardware entry: a shipped profile name, or a file relative to the spec."""
    if "/" in text or text.endswith((".toml", ".json")):
        return str(_local_path(spec_path, text))
    return text


def _expand(spec: SweepSpec):
    """Every configuration in the spec's order: traces, hardware, the shared grid keys (in the order the
    spec lists them; the last varies fastest), systems, then the system's own ``SYSTEM:`` keys."""
    shared = [k for k in spec.grid if ":" not in k]
    own = {s: [k for k in spec.grid if k.partition(":")[0] == s and ":" in k] for s in spec.systems}
    fixed = system_overrides(list(spec.sets), list(spec.systems))
    index = itertools.count()
    for trace in spec.traces:
        values_of = spec.grid | dict(trace.grid)  # the trace's own values replace the shared ones
        for hardware in spec.hardware:
            for values in itertools.product(*(values_of[k] for k in shared)):
                point = dict(zip(shared, values))
                for system in spec.systems:
                    for own_values in itertools.product(*(values_of[k] for k in own[system])):
                        grid = {k: None for k in spec.grid} | point | dict(zip(own[system], own_values))
                        yield _resolve(spec, next(index), trace, hardware, system, grid, fixed[system])


def _resolve(spec: SweepSpec, index: int, trace: TraceSource, hardware: str, system: str, grid: dict[str, Any],
             fixed: dict[str, dict[str, str]]) -> RunConfig:
    settings = {k: grid[k] if grid.get(k) is not None else DEFAULTS[k] for k in BATCHING_KEYS + RUN_KEYS}
    grid_over = [_overrides_of(k, v) for k, v in grid.items() if v is not None and k not in BATCHING_KEYS + RUN_KEYS]
    where = f"system {system!r}, trace {trace.name!r}" + "".join(
        f", {k}={v!r}" for k, v in grid.items() if v is not None)
    try:
        model = apply_precision(trace.model, settings["precision"])
    except ValueError as exc:
        raise spec.error("grid.precision", f"{exc} (trace {trace.name!r})") from None
    over = merge_overrides(fixed, *grid_over)
    try:
        sysconf = resolve_system(system, over, model)
        predictors, needs_future = _reads(sysconf)
    except ValueError as exc:
        key = _culprit(system, model, fixed, grid)
        hint = (f"; for one system only, give \"SYSTEM:{key[6:-1]}\"" if key.startswith('grid."') and ":" not in key
                else "")
        raise spec.error(key, f"{exc} ({where}){hint}") from None
    missing = sorted(set(predictors) - trace.predictors)
    if missing:
        raise spec.error(f"traces.{trace.name}", f"system {system!r} reads the lookahead column(s) {missing}, which "
                         f"this trace lacks (it has: {', '.join(sorted(trace.predictors)) or 'none'}); "
                         + ("add them to its recipe (lookahead = [\"NAME=ACCURACY\"])" if trace.synth is not None
                            else "use a trace that has them") + ", or leave the system out")
    if sysconf.time_bound and not spec.timing:
        raise spec.error("timing", f"system {system!r} is a time bound: it has no counts-only mode (timing = false)")
    config = {k: v for k, v in sysconf.to_dict().items() if k != "description"}
    return RunConfig(index, trace.name, trace.model.name, system, hardware, settings["batch_size"],
                     settings["prefill_chunk"], settings["seed"], settings["precision"], spec.timing, spec.profile_share,
                     over, grid,
                     predictors, needs_future, config, precision_name=model.precision_label)


def _overrides_of(key: str, value: Any) -> dict[str, dict[str, str]]:
    if key in MEMORY_KEYS:
        return {"memory": {MEMORY_KEYS[key]: _override_text(value)}}
    return parse_overrides([f"{key.partition(':')[2] or key}={_override_text(value)}"])


def _culprit(system: str, model: ModelSpec, fixed: dict, grid: dict[str, Any]) -> str:
    """The spec key a configuration that does not resolve is wrong in: ``set``, else the first grid key that
    fails on its own, else ``grid`` (a combination)."""
    def fails(over) -> bool:
        try:
            _reads(resolve_system(system, over, model))
        except ValueError:
            return True
        return False

    if fails(fixed):
        return "set"
    for key, value in grid.items():
        if value is not None and key not in BATCHING_KEYS + RUN_KEYS and fails(merge_overrides(fixed, _overrides_of(key, value))):
            return _grid_key(key)
    return "grid"


def _grid_key(key: str, table: str = "grid") -> str:
    """How the spec names a grid key: ``grid.batch_size``, ``grid."dali:prefetch.k"`` (``table`` for a
    trace's own grid)."""
    return f"{table}.{key}" if key in GRID_KEYS or "." not in key and ":" not in key else f'{table}."{key}"'



def _reads(sysconf: SystemConfig) -> tuple[tuple[str, ...], bool]:
    """(lookahead predictors the system's prefetcher reads, whether a policy reads next-use times)."""
    if sysconf.time_bound:
        return (), False
    return tuple(sysconf.prefetch.build().required_predictors()), sysconf.needs_future


def plan_runs(spec: SweepSpec, out: Path, log: Callable[[str], None] = lambda m: None) -> list[RunConfig]:
    """The spec's configurations with their traces on disk (recipes synthesised into ``OUT/traces`` once;
    an existing one is reused if it was made from the same recipe, refused otherwise) and their hashes."""
    from dali_sim.trace.reader import read_meta
    from dali_sim.trace.synth import synthesize

    paths, shas = {}, {}
    for trace in spec.traces:
        path = trace.output_path(out)
        if trace.synth is not None:
            if path.exists():
                made = read_meta(path).provenance.get("synth")
                if json.dumps(made, sort_keys=True) != json.dumps(trace.synth.to_dict(), sort_keys=True):
                    raise spec.error(f"traces.{trace.name}.synth",
                                     f"{path} was synthesised from another recipe; remove it (and the results "
                                     "made from it) or write the sweep to another folder")
            else:
                log(f"synthesising trace {trace.name!r} -> {path}")
                # the same recipe gives the same bytes, whatever the spec file is called
                synthesize(trace.synth, path, command=f"dali sweep (recipe traces.{trace.name})", progress=False)
        paths[trace.name], shas[trace.name] = path.resolve(), file_sha256(path)
    hw = {h: file_sha256(resolve_profile_path(_hardware_ref(spec.path, h))) for h in spec.hardware}
    runs = [dataclasses.replace(r, trace_path=str(paths[r.trace]), trace_sha256=shas[r.trace],
                                hardware_ref=_hardware_ref(spec.path, r.hardware), hardware_sha256=hw[r.hardware])
            for r in spec.runs]
    seen: dict[str, RunConfig] = {}
    for r in runs:
        if r.hash in seen:
            a = seen[r.hash]
            raise spec.error("grid", f"configurations {a.index} ({a.system}, {a.grid}) and {r.index} ({r.system}, "
                                     f"{r.grid}) are the same run (same trace, resolved system and settings)")
        seen[r.hash] = r
    return runs


__all__ = ["GRID_KEYS", "RunConfig", "SpecError", "SweepError", "SweepSpec", "TraceSource", "load_spec", "plan_runs"]
