"""Trace format v1: column layout and file-level metadata (see docs/trace-format.md)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from dali_sim.models.spec import ModelSpec, typed_fields

if TYPE_CHECKING:
    import pyarrow as pa

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (1,)
META_KEY = "dali.trace"
PHASES = ("prefill", "decode")
PREFILL, DECODE = 0, 1
LOOKAHEAD_PREFIX = "lookahead:"
STATUS_COMPLETE, STATUS_PARTIAL = "complete", "partial"
PARTIAL_SUFFIX = ".partial"


class TraceError(ValueError):
    """A trace file that cannot be used: the message names the file and, where known, the row."""


@dataclass(frozen=True)
class PredictorInfo:
    """A lookahead column: predicted router logits of the MoE layer ``target_offset`` MoE layers later.

    Row (token, MoE layer l) holds the prediction for (token, MoE layer l + target_offset), made with
    what is known at layer l; rows whose target layer does not exist hold no prediction (all NaN; an Arrow
    null in files written before 2026-12).
    """

    name: str
    target_offset: int = 1
    description: str = ""

    @property
    def column(self) -> str:
        return LOOKAHEAD_PREFIX + self.name


@dataclass(frozen=True)
class SequenceInfo:
    """Per-sequence facts that do not fit in rows (prompt length even when prefill is not traced)."""

    seq_id: int
    name: str = ""
    prompt_tokens: int | None = None
    generated_tokens: int | None = None
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HiddenStatesInfo:
    """Hidden states kept in a sidecar Parquet file beside the trace (not inside every row)."""

    file: str  # name relative to the trace's folder
    dim: int
    dtype: str = "float16"
    what: str = "gate input (the hidden state fed to the MoE router) of each (token, MoE layer)"


@dataclass
class TraceMeta:
    """Everything a reader needs to interpret the columns; stored as JSON under ``dali.trace``."""

    model: ModelSpec
    provenance: dict[str, Any] = field(default_factory=dict)
    has_weights: bool = True
    has_router_logits: bool = False
    predictors: dict[str, PredictorInfo] = field(default_factory=dict)
    hidden_states: HiddenStatesInfo | None = None
    sequences: list[SequenceInfo] = field(default_factory=list)
    weights_note: str = "gate weights of the top-k experts as the model applies them"
    schema_version: int = SCHEMA_VERSION
    status: str = STATUS_COMPLETE
    partial_reason: str = ""
    num_rows: int = 0

    @property
    def top_k(self) -> int:
        return self.model.top_k

    @property
    def num_experts(self) -> int:
        return self.model.num_experts

    @property
    def layers(self) -> tuple[int, ...]:
        return self.model.moe_layers

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["model"] = self.model.to_dict()
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> "TraceMeta":
        try:
            d = json.loads(text)
        except UnicodeDecodeError as exc:
            raise TraceError(f"{where}: '{META_KEY}' metadata is not UTF-8 text ({exc.reason} at byte "
                             f"{exc.start})") from None
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: '{META_KEY}' metadata is not valid JSON ({exc})") from None
        if not isinstance(d, dict):
            raise TraceError(f"{where}: '{META_KEY}' metadata is not a JSON object")
        version = d.get("schema_version")
        if version not in SUPPORTED_SCHEMA_VERSIONS or isinstance(version, bool):
            raise TraceError(
                f"{where}: unknown trace schema version {version!r}; this dali reads {list(SUPPORTED_SCHEMA_VERSIONS)}"
            )
        try:
            return cls(**_checked_meta(d))
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{where}: bad '{META_KEY}' metadata: {exc}") from None

    def sequence_map(self) -> dict[int, SequenceInfo]:
        return {s.seq_id: s for s in self.sequences}


#: limits of the column types: expert ids are int16, layers int16, ranks int8 (in the workload)
MAX_EXPERTS = 1 << 15
MAX_LAYERS = (1 << 15) - 1
MAX_TOP_K = 127


def _checked_meta(d: dict[str, Any]) -> dict[str, Any]:
    """The metadata JSON object with every field's type and range checked (errors name the field), and
    nested objects built."""
    d = typed_fields(TraceMeta, d, "metadata")
    model = ModelSpec.from_dict(d["model"])
    if model.num_experts > MAX_EXPERTS:
        raise ValueError(f"model.num_experts = {model.num_experts} exceeds {MAX_EXPERTS} (expert ids are int16)")
    if model.num_layers > MAX_LAYERS:
        raise ValueError(f"model.num_layers = {model.num_layers} exceeds {MAX_LAYERS} (layers are int16)")
    if model.top_k > MAX_TOP_K:
        raise ValueError(f"model.top_k = {model.top_k} exceeds {MAX_TOP_K} (ranks are int8)")
    d["model"] = model
    if not isinstance(d.get("provenance", {}), dict):
        raise ValueError(f"provenance must be an object, got {d['provenance']!r}")
    predictors = d.get("predictors", {})
    if not isinstance(predictors, dict):
        raise ValueError(f"predictors must be an object (name -> predictor), got {predictors!r}")
    d["predictors"] = {}
    for key, value in predictors.items():
        p = PredictorInfo(**typed_fields(PredictorInfo, value, f"predictors.{key}"))
        if p.name != key or not p.name:
            raise ValueError(f"predictors.{key}.name must be {key!r}, got {p.name!r}")
        if p.target_offset < 1:
            raise ValueError(f"predictors.{key}.target_offset must be >= 1, got {p.target_offset}")
        d["predictors"][key] = p
    sequences = d.get("sequences", [])
    if not isinstance(sequences, list):
        raise ValueError(f"sequences must be a list, got {sequences!r}")
    d["sequences"] = []
    for i, value in enumerate(sequences):
        where = f"sequences[{i}]"
        if isinstance(value, dict):
            for opt in ("prompt_tokens", "generated_tokens"):  # int or null
                v = value.get(opt)
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                    raise ValueError(f"{where}.{opt} must be a non-negative integer or null, got {v!r}")
        seq = SequenceInfo(**typed_fields(SequenceInfo, value, where,
                                          skip=("prompt_tokens", "generated_tokens")))
        if seq.seq_id < 0 or not isinstance(seq.attrs, dict):
            raise ValueError(f"{where}: seq_id must be >= 0 and attrs an object, got {seq.seq_id!r}, {seq.attrs!r}")
        d["sequences"].append(seq)
    hidden = d.get("hidden_states")
    if hidden is not None:
        h = HiddenStatesInfo(**typed_fields(HiddenStatesInfo, hidden, "hidden_states"))
        if not h.file or Path(h.file).name != h.file or h.file in (".", ".."):
            raise ValueError(f"hidden_states.file must be a file name beside the trace, got {h.file!r}")
        if h.dim < 1 or h.dtype != "float16":
            raise ValueError(f"hidden_states: dim must be >= 1 and dtype float16, got {h.dim!r}, {h.dtype!r}")
        d["hidden_states"] = h
    if d.get("status", STATUS_COMPLETE) not in (STATUS_COMPLETE, STATUS_PARTIAL):
        raise ValueError(f"status must be {STATUS_COMPLETE!r} or {STATUS_PARTIAL!r}, got {d['status']!r}")
    if d.get("num_rows", 0) < 0:
        raise ValueError(f"num_rows must be >= 0, got {d['num_rows']!r}")
    return d


def fixed_list(value_type: pa.DataType, width: int) -> pa.DataType:
    import pyarrow as pa

    return pa.list_(value_type, width)


def arrow_schema(meta: TraceMeta) -> pa.Schema:
    """The Arrow schema of a trace with these optional columns."""
    import pyarrow as pa  # here, not at the top: the commands import this module for TraceError

    k, e = meta.top_k, meta.num_experts
    fields = [
        pa.field("seq_id", pa.int32(), nullable=False),
        pa.field("phase", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("pos", pa.int32(), nullable=False),
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("experts", fixed_list(pa.int16(), k), nullable=False),
    ]
    if meta.has_weights:
        fields.append(pa.field("weights", fixed_list(pa.float32(), k), nullable=False))
    if meta.has_router_logits:
        fields.append(pa.field("router_logits", fixed_list(pa.float32(), e), nullable=False))
    for p in meta.predictors.values():
        fields.append(pa.field(p.column, fixed_list(pa.float32(), e), nullable=True))
    return pa.schema(fields)


def partial_path(path: Path) -> Path:
    return path.with_name(path.name + PARTIAL_SUFFIX)


def hidden_sidecar_name(trace_path: Path) -> str:
    stem = trace_path.name[: -len(".parquet")] if trace_path.name.endswith(".parquet") else trace_path.name
    return stem + ".hidden.parquet"


def meta_from_mapping(raw: Mapping[bytes, bytes] | None, where: str) -> TraceMeta:
    key = META_KEY.encode()
    if not raw or key not in raw:
        raise TraceError(f"{where}: not a dali trace (Parquet file without '{META_KEY}' metadata)")
    return TraceMeta.from_json(raw[key], where)
