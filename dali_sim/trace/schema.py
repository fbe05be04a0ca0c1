"""Trace format v1: column layout and file-level metadata (see docs/trace-format.md)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import pyarrow as pa

from dali_sim.models.spec import ModelSpec

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
    what is known at layer l; rows whose target layer does not exist are null.
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
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: '{META_KEY}' metadata is not valid JSON ({exc})") from None
        if not isinstance(d, dict):
            raise TraceError(f"{where}: '{META_KEY}' metadata is not a JSON object")
        version = d.get("schema_version")
        if version not in SUPPORTED_SCHEMA_VERSIONS:
            raise TraceError(
                f"{where}: unknown trace schema version {version!r}; this dali reads {list(SUPPORTED_SCHEMA_VERSIONS)}"
            )
        try:
            d["model"] = ModelSpec.from_dict(d["model"])
            d["predictors"] = {k: PredictorInfo(**v) for k, v in d.get("predictors", {}).items()}
            d["sequences"] = [SequenceInfo(**s) for s in d.get("sequences", [])]
            if d.get("hidden_states") is not None:
                d["hidden_states"] = HiddenStatesInfo(**d["hidden_states"])
            return cls(**d)
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{where}: bad '{META_KEY}' metadata: {exc}") from None

    def sequence_map(self) -> dict[int, SequenceInfo]:
        return {s.seq_id: s for s in self.sequences}


def fixed_list(value_type: pa.DataType, width: int) -> pa.DataType:
    return pa.list_(value_type, width)


def arrow_schema(meta: TraceMeta) -> pa.Schema:
    """The Arrow schema of a trace with these optional columns."""
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
