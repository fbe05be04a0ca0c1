"""Measured hardware profiles: tables of timings written by the executor's calibration (JSON).

The format (``docs/hardware.md``) records what was measured (devices, the model shape, provenance)
and the tables; :class:`TableCosts` turns them into the same cost functions the roofline gives.

Interpolation rule, the same on every axis: below the first point the first value (fixed costs
dominate there), linear between points, and past the last point the line through the last two
points, with a negative slope treated as flat so times never fall below the last measurement.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from dali_sim.files import write_text_atomic
from dali_sim.hardware.contention import lane_combinations
from dali_sim.hardware.profile import MAX_MEMORY_GIB, FieldReader, ProfileError, check_device, check_number
from dali_sim.models.spec import ModelSpec

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # format 1: no contention, no host costs, no d2h table
CURVE_TABLES = {"gpu_expert": "tokens", "cpu_expert": "tokens", "h2d": "bytes"}
OPTIONAL_CURVE_TABLES = {"d2h": "bytes"}
DENSE_TABLES = ("gpu_dense", "cpu_dense")
OPTIONAL_DENSE_TABLES = ("gpu_dense_block", "cpu_dense_block")
#: the dense tables in prefill layout, each optional: without one, prefill steps use the decode-layout table
PREFILL_TABLES = {f"{k}_prefill": k for k in DENSE_TABLES + OPTIONAL_DENSE_TABLES}
#: ``lane_wake``'s entries: the two lanes' calls after their thread slept, the host's hand-over to such a thread;
#: ``*_spinning``: the same where the CPU lane's worker still spins for its next job (a profile of an executor whose
#: worker spins, ``provenance.waiting.spin_s``)
WAKE_KEYS = ("gpu", "cpu", "host", "gpu_spinning", "cpu_spinning", "host_spinning")


@dataclass(frozen=True)
class CurveTable:
    """Seconds at increasing positive ``x`` (tokens or bytes)."""

    x: tuple[float, ...]
    seconds: tuple[float, ...]


@dataclass(frozen=True)
class DenseTable:
    """``seconds[i][j]``: time at ``context_lens[i]`` and ``tokens[j]`` (decode layout: each of the
    ``tokens`` queries attends to ``context_lens[i]`` cached tokens of its own sequence)."""

    tokens: tuple[float, ...]
    context_lens: tuple[float, ...]
    seconds: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class PrefillTable:
    """``seconds[i][j]``: time at ``queries[i]`` and ``sequences[j]`` (prefill layout: each of the
    ``sequences`` sequences has ``queries`` new tokens at positions ``0 .. queries - 1``, each attending
    to its own sequence's positions up to its own, with nothing cached before them)."""

    sequences: tuple[float, ...]
    queries: tuple[float, ...]
    seconds: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class HostCosts:
    """The executor's own host time, measured on the machine (seconds): per MoE layer visit, plus per
    GPU expert, per CPU expert and per copy the layer issues, and the policies' decision time per layer
    visit for each system measured (``Controller.plan``; docs/validation.md). Used by the
    ``dali-executor`` implementation, whose time the simulator predicts in a validation."""

    layer_s: float
    gpu_expert_s: float
    cpu_expert_s: float
    copy_s: float
    decision_s: Mapping[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"layer_s": self.layer_s, "gpu_expert_s": self.gpu_expert_s, "cpu_expert_s": self.cpu_expert_s,
                "copy_s": self.copy_s, "decision_s": dict(self.decision_s)}


@dataclass(frozen=True)
class MeasuredDevice:
    name: str
    memory_gib: float


@dataclass(frozen=True)
class ModelShape:
    """The model shape a measured profile was taken for; every field but ``model`` must match the
    simulated model (a fine-tune of the same shape may reuse the tables)."""

    model: str
    precision: str
    expert_params: int
    expert_bytes: int
    hidden_size: int
    expert_intermediate_size: int
    dense_params_per_moe_layer: int
    kv_cache_elements_per_token: int

    @classmethod
    def of(cls, spec: ModelSpec) -> "ModelShape":
        return cls(
            model=spec.name, precision=spec.precision.name, expert_params=spec.expert_params,
            expert_bytes=spec.expert_bytes, hidden_size=spec.hidden_size,
            expert_intermediate_size=spec.expert_intermediate_size,
            dense_params_per_moe_layer=spec.dense_params_per_moe_layer(),
            kv_cache_elements_per_token=spec.attention.kv_cache_elements_per_token(),
        )


@dataclass(frozen=True)
class MeasuredProfile:
    name: str
    description: str
    gpu: MeasuredDevice
    cpu: MeasuredDevice
    link_name: str
    model: ModelShape
    gpu_expert: CurveTable
    cpu_expert: CurveTable
    h2d: CurveTable
    gpu_dense: DenseTable
    cpu_dense: DenseTable
    provenance: Mapping[str, Any]
    gpu_dense_block: DenseTable | None = None
    cpu_dense_block: DenseTable | None = None
    # the same parts in prefill layout (PREFILL_TABLES); None = prefill steps use the decode-layout table
    gpu_dense_prefill: PrefillTable | None = None
    cpu_dense_prefill: PrefillTable | None = None
    gpu_dense_block_prefill: PrefillTable | None = None
    cpu_dense_block_prefill: PrefillTable | None = None
    d2h: CurveTable | None = None  # device-to-host copies (activations of CPU experts); None on the CPU device
    contention: Mapping[str, Mapping[str, float]] | None = None  # slowdowns per set of busy lanes (contention.py)
    host: HostCosts | None = None
    # seconds a lane pays once per layer it computes in, besides its experts' table times: the fixed part
    # of the executor's grouped call (index building, gather, scatter); None = 0 (profiles measured with a
    # call per expert, whose expert tables include it)
    lanes: Mapping[str, float] | None = None
    # seconds a lane's call costs more when its thread slept before it (the executor's CPU-lane worker waits
    # on its queue between layers; the machine then runs its next call on a cold, possibly slowed core), and
    # ("host") what handing work to such a sleeping thread costs the calling thread; None = 0
    lane_wake: Mapping[str, float] | None = None
    path: str = field(default="", compare=False)

    kind = "measured"

    @property
    def gpu_memory_bytes(self) -> int:
        return int(self.gpu.memory_gib * (1 << 30))

    def check_model(self, spec: ModelSpec) -> None:
        """Raise :class:`ProfileError` if ``spec`` differs in shape from what was measured."""
        want = ModelShape.of(spec)
        for f in ModelShape.__dataclass_fields__:
            if f == "model":
                continue
            have, need = getattr(self.model, f), getattr(want, f)
            if have != need:
                raise ProfileError(
                    f"{self.path or self.name}: model.{f}: measured for {have!r} ({self.model.model}), but the "
                    f"simulated model {spec.name!r} at {spec.precision.name} has {need!r}; calibrate for this "
                    "model or use an analytic profile"
                )

    def to_dict(self) -> dict[str, Any]:
        def curve(t: CurveTable, axis: str) -> dict[str, Any]:
            return {axis: list(t.x), "seconds": list(t.seconds)}

        def dense(t: DenseTable) -> dict[str, Any]:
            return {"tokens": list(t.tokens), "context_lens": list(t.context_lens), "seconds": [list(r) for r in t.seconds]}

        tables: dict[str, Any] = {k: curve(getattr(self, k), axis) for k, axis in CURVE_TABLES.items()}
        for k, axis in OPTIONAL_CURVE_TABLES.items():
            if getattr(self, k) is not None:
                tables[k] = curve(getattr(self, k), axis)
        for k in DENSE_TABLES + OPTIONAL_DENSE_TABLES:
            if getattr(self, k) is not None:
                tables[k] = dense(getattr(self, k))
        for k in PREFILL_TABLES:
            t = getattr(self, k)
            if t is not None:
                tables[k] = {"sequences": list(t.sequences), "queries": list(t.queries),
                             "seconds": [list(r) for r in t.seconds]}
        extra: dict[str, Any] = {}
        if self.contention is not None:
            extra["contention"] = {k: dict(v) for k, v in self.contention.items()}
        if self.host is not None:
            extra["host"] = self.host.to_dict()
        if self.lanes is not None:
            extra["lanes"] = dict(self.lanes)
        if self.lane_wake is not None:
            extra["lane_wake"] = dict(self.lane_wake)
        return {
            "kind": self.kind,
            "format_version": FORMAT_VERSION,
            "name": self.name,
            "description": self.description,
            "gpu": {"name": self.gpu.name, "memory_gib": self.gpu.memory_gib},
            "cpu": {"name": self.cpu.name, "memory_gib": self.cpu.memory_gib},
            "link": {"name": self.link_name},
            "model": dataclasses.asdict(self.model),
            "tables": tables,
            **extra,
            "provenance": dict(self.provenance),
        }


# ---- parsing and validation ------------------------------------------------------------------
def _axis(r: FieldReader, key: str, *, minimum: float, strict: bool, min_len: int) -> tuple[float, ...]:
    values = r.raw(key)
    if not isinstance(values, list) or len(values) < min_len:
        raise r.error(key, f"must be a list of at least {min_len} numbers, got {values!r}")
    out = tuple(check_number(v, r, f"{key}[{i}]", minimum=minimum, strict=strict) for i, v in enumerate(values))
    for i in range(1, len(out)):
        if out[i] <= out[i - 1]:
            raise r.error(key, f"must be strictly increasing, but [{i - 1}]={out[i - 1]:g} >= [{i}]={out[i]:g}")
    return out


def _seconds(r: FieldReader, key: str, values: Any, n: int) -> tuple[float, ...]:
    if not isinstance(values, list) or len(values) != n:
        raise r.error(key, f"must be a list of {n} numbers (one per point), got {values!r}")
    return tuple(check_number(v, r, f"{key}[{i}]", strict=False) for i, v in enumerate(values))


def _curve(r: FieldReader, axis: str) -> CurveTable:
    r.reject_unknown({axis, "seconds"})
    x = _axis(r, axis, minimum=0.0, strict=True, min_len=2)
    return CurveTable(x, _seconds(r, "seconds", r.raw("seconds"), len(x)))


def _grid(r: FieldReader, cols: str, rows: str, *, rows_positive: bool):
    """A two-dimensional table: ``seconds``, one row per ``rows`` point, one number per ``cols`` point."""
    r.reject_unknown({cols, rows, "seconds"})
    x = _axis(r, cols, minimum=0.0, strict=True, min_len=2)
    y = _axis(r, rows, minimum=0.0, strict=rows_positive, min_len=1)
    values = r.raw("seconds")
    if not isinstance(values, list) or len(values) != len(y):
        raise r.error("seconds", f"must be a list of {len(y)} rows (one per {rows} entry)")
    return x, y, tuple(_seconds(r, f"seconds[{i}]", row, len(x)) for i, row in enumerate(values))


def _dense(r: FieldReader) -> DenseTable:
    return DenseTable(*_grid(r, "tokens", "context_lens", rows_positive=False))


def _prefill(r: FieldReader) -> PrefillTable:
    return PrefillTable(*_grid(r, "sequences", "queries", rows_positive=True))


def _integer(r: FieldReader, key: str) -> int:
    v = r.raw(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise r.error(key, f"must be a non-negative integer, got {v!r}")
    return v


def measured_profile_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> MeasuredProfile:
    """Validate and build a measured profile from its JSON structure."""
    top = FieldReader(source, data)
    if top.string("kind") != "measured":
        raise top.error("kind", f"must be 'measured' in a JSON profile, got {top.raw('kind')!r}")
    version = top.raw("format_version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise top.error("format_version", f"must be one of {list(READABLE_VERSIONS)}, got {version!r}")
    allowed = {"kind", "format_version", "name", "description", "gpu", "cpu", "link", "model", "tables", "provenance"}
    top.reject_unknown(allowed | ({"contention", "host", "lanes", "lane_wake"} if version >= 2 else set()))

    devices = {}
    for dev in ("gpu", "cpu"):
        dr = top.table(dev)
        dr.reject_unknown({"name", "memory_gib"})
        devices[dev] = MeasuredDevice(dr.string("name"), dr.number("memory_gib", maximum=MAX_MEMORY_GIB))
    lr = top.table("link")
    lr.reject_unknown({"name"})

    mr = top.table("model")
    mr.reject_unknown(set(ModelShape.__dataclass_fields__))
    shape = ModelShape(
        model=mr.string("model"), precision=mr.string("precision"),
        **{f: _integer(mr, f) for f in ModelShape.__dataclass_fields__ if f not in ("model", "precision")},
    )

    tr = top.table("tables")
    tr.reject_unknown(set(CURVE_TABLES) | set(DENSE_TABLES) | set(OPTIONAL_DENSE_TABLES)
                      | (set(OPTIONAL_CURVE_TABLES) | set(PREFILL_TABLES) if version >= 2 else set()))
    curves = {k: _curve(tr.table(k), axis) for k, axis in CURVE_TABLES.items()}
    curves.update({k: _curve(tr.table(k), axis) for k, axis in OPTIONAL_CURVE_TABLES.items() if tr.has(k)})
    dense = {k: _dense(tr.table(k)) for k in DENSE_TABLES}
    dense.update({k: _dense(tr.table(k)) for k in OPTIONAL_DENSE_TABLES if tr.has(k)})
    for k, decode in PREFILL_TABLES.items():
        if tr.has(k):
            if decode not in dense:
                raise tr.error(k, f"a prefill-layout table needs the decode-layout table {decode!r} beside it")
            dense[k] = _prefill(tr.table(k))

    pr = top.table("provenance")
    pr.string("command")
    pr.string("date")
    versions = pr.table("versions")
    for k in versions.data:
        versions.string(k)

    contention = _contention(top.table("contention")) if top.has("contention") else None
    host = _host(top.table("host")) if top.has("host") else None
    lanes = None
    if top.has("lanes"):
        lr2 = top.table("lanes")
        lr2.reject_unknown({"gpu", "cpu"})
        lanes = {d: lr2.number(d, strict=False) for d in ("gpu", "cpu")}
    lane_wake = None
    if top.has("lane_wake"):
        wr = top.table("lane_wake")
        wr.reject_unknown(set(WAKE_KEYS))
        lane_wake = {d: wr.number(d, strict=False) for d in WAKE_KEYS if wr.has(d)}
    return MeasuredProfile(
        name=top.string("name"), description=top.string("description", default="", nonempty=False),
        gpu=devices["gpu"], cpu=devices["cpu"], link_name=lr.string("name"), model=shape,
        provenance=dict(pr.data), path=source if source != "<dict>" else "", contention=contention, host=host,
        lanes=lanes, lane_wake=lane_wake, **curves, **dense,
    )


def _contention(r: FieldReader) -> dict[str, dict[str, float]]:
    """Every combination of two or more lanes, each lane's slowdown (>= 1)."""
    r.reject_unknown(set(lane_combinations()))
    out = {}
    for key in lane_combinations():
        cr = r.table(key)
        lanes = key.split("+")
        cr.reject_unknown(set(lanes))
        out[key] = {lane: cr.number(lane, minimum=1.0, strict=False) for lane in lanes}
    return out


def _host(r: FieldReader) -> HostCosts:
    keys = ("layer_s", "gpu_expert_s", "cpu_expert_s", "copy_s")
    r.reject_unknown(set(keys) | {"decision_s"})
    values = {k: r.number(k, strict=False) for k in keys}
    dr = r.table("decision_s")
    decision = {name: dr.number(name, strict=False) for name in dr.data}
    return HostCosts(**values, decision_s=decision)


def read_measured_profile(path: str | Path) -> MeasuredProfile:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not valid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise ProfileError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return measured_profile_from_dict(data, str(path))


def write_measured_profile(path: str | Path, profile: MeasuredProfile) -> Path:
    """Validate ``profile`` and write it as JSON, atomically (a temp file renamed into place)."""
    path = Path(path)
    data = profile.to_dict()
    measured_profile_from_dict(data, str(path))  # same checks as the reader
    return write_text_atomic(path, json.dumps(data, indent=1, allow_nan=False) + "\n")


# ---- interpolation -----------------------------------------------------------------------------
def interp_extrap(x: np.ndarray, xp: np.ndarray, fp: np.ndarray) -> np.ndarray:
    """The module's interpolation rule along one axis (``xp`` increasing, at least 2 points)."""
    y = np.interp(x, xp, fp)
    slope = max((fp[-1] - fp[-2]) / (xp[-1] - xp[-2]), 0.0)
    return np.where(x > xp[-1], fp[-1] + slope * (x - xp[-1]), y)


def _interp_rows(c: np.ndarray, cp: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Interpolate ``rows`` (shape ``(len(cp), *c.shape)``) along the context axis at ``c``."""
    if len(cp) == 1:
        return rows[0]
    i = np.clip(np.searchsorted(cp, c, side="right") - 1, 0, len(cp) - 2)
    lo, hi = np.take_along_axis(rows, i[None], 0)[0], np.take_along_axis(rows, i[None] + 1, 0)[0]
    t = np.maximum((c - cp[i]) / (cp[i + 1] - cp[i]), 0.0)
    inside = lo + np.minimum(t, 1.0) * (hi - lo)
    return inside + np.maximum(t - 1.0, 0.0) * np.maximum(hi - lo, 0.0)


def prefill_layout(n: np.ndarray, ctx: np.ndarray, kv: np.ndarray):
    """Steps given as (query tokens ``n``, mean context ``ctx``, KV entries read ``kv``), as equal sequences:
    ``(shared, s, q, c0)``, where ``shared`` marks the steps whose queries share their sequences' context
    (prefill; a decode step has ``kv == n * ctx``), and ``s`` sequences of ``q`` new tokens after ``c0``
    cached ones give the same three numbers: ``n = s q``, ``ctx = c0 + (q + 1) / 2``, ``kv = s (c0 + q)``
    (exact for a step of equal prompts or equal chunks; other steps get the equal ones with their
    totals). Steps that do not share have ``q = 1``."""
    n, ctx, kv = np.broadcast_arrays(np.asarray(n, float), np.asarray(ctx, float), np.asarray(kv, float))
    per_token = kv / np.maximum(n, 1e-300)
    q = (ctx - 0.5) / np.maximum(per_token - 0.5, 1e-12)
    shared = q > 1.0 + 1e-9
    q = np.where(shared, q, 1.0)
    return shared, n / q, q, np.where(shared, np.maximum(q * (per_token - 1.0), 0.0), 0.0)


class TableCosts:
    """Cost functions interpolated from a measured profile; same interface as ``RooflineCosts``.

    Dense tables are in decode layout (see :class:`DenseTable`); a step whose queries share their
    sequences' context (:func:`prefill_layout`) takes the prefill-layout table where the profile has one
    (:class:`PrefillTable`), plus, for a chunk after ``c0`` cached tokens, what attending to ``c0`` more
    cached tokens per query costs in decode layout. Without one, prefill steps use the decode layout,
    whose per-query KV reads and attention calls over-estimate a prefill.
    """

    def __init__(self, profile: MeasuredProfile, model: ModelSpec):
        profile.check_model(model)
        self.profile = profile
        self._curves = {}
        for k in (*CURVE_TABLES, *OPTIONAL_CURVE_TABLES):
            t: CurveTable | None = getattr(profile, k)
            if t is not None:
                self._curves[k] = (np.asarray(t.x, float), np.asarray(t.seconds, float))
        self._dense = {k: self._dense_arrays(getattr(profile, k))
                       for k in (*DENSE_TABLES, *OPTIONAL_DENSE_TABLES, *PREFILL_TABLES)}

    @staticmethod
    def _dense_arrays(t: DenseTable | PrefillTable | None):
        """(column axis, row axis, seconds) of a two-dimensional table."""
        if t is None:
            return None
        cols, rows = (t.tokens, t.context_lens) if isinstance(t, DenseTable) else (t.sequences, t.queries)
        return np.asarray(cols, float), np.asarray(rows, float), np.asarray(t.seconds, float)

    def expert(self, device: str, n: np.ndarray) -> np.ndarray:
        check_device(device)
        return interp_extrap(n, *self._curves[f"{device}_expert"])

    def lane(self, device: str) -> float:
        """A lane's fixed seconds per layer it computes in (``MeasuredProfile.lanes``; 0 when not measured)."""
        return float((self.profile.lanes or {}).get(device, 0.0))

    def wake(self, key: str) -> float:
        """What a lane's call costs more after its thread slept, or (``"host"``) what waking such a thread with
        work costs the calling thread; ``*_spinning`` keys: the same where it still spun for the work
        (``MeasuredProfile.lane_wake``, ``WAKE_KEYS``; 0 when not measured)."""
        return float((self.profile.lane_wake or {}).get(key, 0.0))

    def transfer(self, n_bytes: np.ndarray) -> np.ndarray:
        return interp_extrap(n_bytes, *self._curves["h2d"])

    def activation_copy(self, n_bytes: np.ndarray) -> np.ndarray:
        """One host<->device copy of activations: the measured d2h table; 0 when the accelerator is the CPU
        device (the executor hands the CPU lane the same tensor); the h2d table for a format-1 profile."""
        if "d2h" in self._curves:
            return interp_extrap(n_bytes, *self._curves["d2h"])
        if self.profile.provenance.get("devices", {}).get("gpu_is_cpu_device"):
            return np.zeros_like(np.asarray(n_bytes, float))
        return self.transfer(n_bytes)

    def contention(self):
        from dali_sim.hardware.contention import MeasuredSlowdowns

        return MeasuredSlowdowns(self.profile.contention) if self.profile.contention is not None else None

    def host_demand(self, device: str, n: np.ndarray) -> np.ndarray:
        """Measured slowdowns do not use demands."""
        return np.zeros_like(np.asarray(n, float))

    def copy_demand(self, pageable: bool) -> float:
        return 0.0

    @staticmethod
    def _grid_at(arrays, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        cols, rows_axis, seconds = arrays
        x, y = np.broadcast_arrays(x, y)
        return _interp_rows(y, rows_axis, np.stack([interp_extrap(x, cols, row) for row in seconds]))

    def _dense_lookup(self, key: str, n: np.ndarray, ctx: np.ndarray, kv: np.ndarray) -> np.ndarray:
        arrays = self._dense[key]
        if arrays is None:
            raise ProfileError(f"{self.profile.path or self.profile.name}: tables.{key}: missing; the model has dense "
                               "(non-MoE) blocks, so calibrate them or use an analytic profile")
        decode = self._grid_at(arrays, n, ctx)
        prefill = self._dense[f"{key}_prefill"]
        if prefill is None:
            return decode
        shared, s, q, c0 = prefill_layout(n, ctx, kv)
        if not shared.any():
            return decode
        cached = np.maximum(decode - self._grid_at(arrays, n, ctx - c0), 0.0)  # the c0 cached tokens per query
        return np.where(shared, self._grid_at(prefill, s, q) + np.where(c0 > 0, cached, 0.0), decode)

    def dense(self, device: str, n: np.ndarray, ctx: np.ndarray, kv: np.ndarray) -> np.ndarray:
        check_device(device)
        return self._dense_lookup(f"{device}_dense", n, ctx, kv)

    def dense_block(self, device: str, n: np.ndarray, ctx: np.ndarray, kv: np.ndarray) -> np.ndarray:
        check_device(device)
        return self._dense_lookup(f"{device}_dense_block", n, ctx, kv)
