"""Model specifications: the shape of an MoE model, from which every size is derived.

Sizes in bytes are never typed in: they follow from the shapes and a :class:`Precision`.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Mapping

#: bytes per parameter of the widest format (float64), an upper bound for a sane precision
MAX_BYTES_PER_PARAM = 8.0


@dataclass(frozen=True)
class Precision:
    """Storage format of weights. ``bytes_per_param`` includes block scales of quantised formats."""

    name: str
    bytes_per_param: float
    description: str = ""

    def __post_init__(self) -> None:
        b = self.bytes_per_param
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) \
                or not 0 < b <= MAX_BYTES_PER_PARAM:
            raise ValueError(f"precision {self.name!r}: bytes_per_param must be a number in (0, "
                             f"{MAX_BYTES_PER_PARAM:g}], got {b!r}")


@dataclass(frozen=True)
class AttentionSpec:
    """Attention block shape. ``kind`` is ``gqa`` (MHA/GQA/MQA) or ``mla`` (DeepSeek multi-head latent)."""

    kind: str
    num_heads: int
    num_kv_heads: int = 0
    head_dim: int = 0
    bias: bool = False
    # MLA only
    q_lora_rank: int = 0  # 0 = plain q projection (DeepSeek-V2-Lite)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("gqa", "mla"):
            raise ValueError(f"attention.kind must be 'gqa' or 'mla', got {self.kind!r}")
        if self.num_heads <= 0:
            raise ValueError("attention.num_heads must be positive")
        if self.kind == "gqa" and (self.num_kv_heads <= 0 or self.head_dim <= 0):
            raise ValueError("gqa attention needs positive num_kv_heads and head_dim")
        if self.kind == "mla" and (self.kv_lora_rank <= 0 or self.v_head_dim <= 0):
            raise ValueError("mla attention needs positive kv_lora_rank and v_head_dim")
        for f in ("num_kv_heads", "head_dim", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim"):
            if getattr(self, f) < 0:
                raise ValueError(f"attention.{f} must not be negative, got {getattr(self, f)}")

    def params(self, hidden: int) -> int:
        """Weight parameters of one attention block (projections and their biases)."""
        h = self.num_heads
        if self.kind == "gqa":
            q = hidden * h * self.head_dim
            kv = 2 * hidden * self.num_kv_heads * self.head_dim
            o = h * self.head_dim * hidden
            bias = (h + 2 * self.num_kv_heads) * self.head_dim + hidden if self.bias else 0
            return q + kv + o + bias
        qk_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank:
            q = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * qk_dim
        else:
            q = hidden * h * qk_dim
        kv_a = hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv_b = self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        o = h * self.v_head_dim * hidden
        return q + kv_a + kv_b + o

    def kv_cache_elements_per_token(self) -> int:
        """Elements cached per token and layer (K and V, or MLA's compressed latent + rope key)."""
        if self.kind == "gqa":
            return 2 * self.num_kv_heads * self.head_dim
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelSpec:
    """Shape of an MoE transformer.

    ``moe_layers`` are the indices (0-based, among ``num_layers`` blocks) of the blocks whose MLP is
    a routed MoE; the others have a dense MLP of ``dense_intermediate_size``. Trace rows name layers
    by these block indices.
    """

    name: str
    family: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate_size: int
    attention: AttentionSpec
    vocab_size: int
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    dense_intermediate_size: int = 0
    ffn_matrices: int = 3  # 3 for gated (SwiGLU) FFNs, 2 for plain up/down FFNs
    expert_bias: bool = False
    norm_topk_prob: bool = True  # top-k gate weights renormalised to sum to 1
    tie_word_embeddings: bool = False
    precision: Precision = Precision("bf16", 2.0)  # the routed experts' weight format
    #: everything else (attention, router, shared experts, dense FFNs, embedding, LM head); None = ``precision``
    dense_precision: Precision | None = None
    source: str = ""
    notes: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layers", tuple(int(x) for x in self.moe_layers))
        for name in ("num_layers", "num_experts", "top_k", "hidden_size", "expert_intermediate_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {self.name!r}: {name} must be positive, got {getattr(self, name)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"model {self.name!r}: top_k={self.top_k} not in 1..num_experts={self.num_experts}")
        if not self.moe_layers:
            raise ValueError(f"model {self.name!r}: moe_layers is empty")
        if list(self.moe_layers) != sorted(set(self.moe_layers)):
            raise ValueError(f"model {self.name!r}: moe_layers must be strictly increasing, got {self.moe_layers}")
        if self.moe_layers[0] < 0 or self.moe_layers[-1] >= self.num_layers:
            raise ValueError(f"model {self.name!r}: moe_layers must lie in 0..{self.num_layers - 1}")
        if self.num_dense_layers and self.dense_intermediate_size <= 0:
            raise ValueError(f"model {self.name!r}: dense layers need dense_intermediate_size")
        if self.num_shared_experts and self.shared_expert_intermediate_size <= 0:
            raise ValueError(f"model {self.name!r}: shared experts need shared_expert_intermediate_size")
        if self.ffn_matrices not in (2, 3):
            raise ValueError(f"model {self.name!r}: ffn_matrices must be 2 or 3")
        for name in ("num_shared_experts", "shared_expert_intermediate_size", "dense_intermediate_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"model {self.name!r}: {name} must not be negative, got {getattr(self, name)}")

    # ---- derived shapes -------------------------------------------------------------------
    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - len(self.moe_layers)

    def _ffn_params(self, intermediate: int, bias: bool = False) -> int:
        h = self.hidden_size
        weights = self.ffn_matrices * h * intermediate
        biases = ((self.ffn_matrices - 1) * intermediate + h) if bias else 0
        return weights + biases

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert."""
        return self._ffn_params(self.expert_intermediate_size, self.expert_bias)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert at this spec's precision (what one PCIe transfer moves)."""
        return int(round(self.expert_params * self.precision.bytes_per_param))

    @property
    def shared_expert_params(self) -> int:
        """Parameters of all shared experts of one MoE layer."""
        return self.num_shared_experts * self._ffn_params(self.shared_expert_intermediate_size)

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def attention_params(self) -> int:
        return self.attention.params(self.hidden_size)

    def dense_params_per_moe_layer(self) -> int:
        """Parameters of an MoE layer that always run (attention, router, shared experts, norms)."""
        return self.attention_params + self.router_params + self.shared_expert_params + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def non_expert_params(self) -> int:
        """Everything except routed experts: the part that normally stays on the GPU."""
        moe = self.num_moe_layers * self.dense_params_per_moe_layer()
        dense = self.num_dense_layers * (
            self.attention_params + self._ffn_params(self.dense_intermediate_size) + 2 * self.hidden_size
        )
        return moe + dense + self.embedding_params + self.hidden_size

    @property
    def total_params(self) -> int:
        return self.non_expert_params + self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters used per token (top-k routed experts plus everything dense)."""
        return self.non_expert_params + self.num_moe_layers * self.top_k * self.expert_params

    @property
    def dense_format(self) -> Precision:
        """The weight format of everything but the routed experts."""
        return self.dense_precision or self.precision

    @property
    def precision_label(self) -> str:
        """``mxfp4`` when the whole model has one format, else ``experts/dense`` (e.g. ``mxfp4/bf16``)."""
        d = self.dense_format
        return self.precision.name if d.name == self.precision.name else f"{self.precision.name}/{d.name}"

    def bytes_of(self, params: int) -> int:
        """Bytes of ``params`` non-expert parameters (at :attr:`dense_format`)."""
        return int(round(params * self.dense_format.bytes_per_param))

    def moe_layer_index(self, layer: int) -> int:
        """Ordinal (0..num_moe_layers-1) of a block index that is an MoE layer."""
        try:
            return self.moe_layers.index(layer)
        except ValueError:
            raise ValueError(f"model {self.name!r}: layer {layer} is not an MoE layer {list(self.moe_layers)}") from None

    # ---- variants and serialisation ------------------------------------------------------
    def with_precision(self, precision: Precision, dense: Precision | None = None) -> "ModelSpec":
        """Experts at ``precision`` and the rest at ``dense`` (default: the same: a whole-model format)."""
        return dataclasses.replace(self, precision=precision, dense_precision=None if dense == precision else dense)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelSpec":
        """From :meth:`to_dict`'s structure (e.g. a trace's metadata), every field's type checked by name."""
        if not isinstance(d, Mapping):
            raise ValueError(f"model spec must be an object, got {type(d).__name__}")
        d = typed_fields(cls, d, "model")
        attn = d["attention"]
        d["attention"] = attn if isinstance(attn, AttentionSpec) else AttentionSpec(**typed_fields(
            AttentionSpec, attn, "model.attention"))
        for key in ("precision", "dense_precision"):
            prec = d.get(key)
            if prec is not None and not isinstance(prec, Precision):
                d[key] = Precision(**typed_fields(Precision, prec, f"model.{key}"))
        return cls(**d)

    def summary(self) -> dict[str, Any]:
        """Derived numbers for display."""
        return {
            "name": self.name,
            "moe_layers": self.num_moe_layers,
            "dense_layers": self.num_dense_layers,
            "experts": self.num_experts,
            "top_k": self.top_k,
            "shared_experts": self.num_shared_experts,
            "precision": self.precision_label,
            "expert_params": self.expert_params,
            "expert_bytes": self.expert_bytes,
            "all_experts_bytes": self.num_moe_layers * self.num_experts * self.expert_bytes,
            "non_expert_bytes": self.bytes_of(self.non_expert_params),
            "total_params": self.total_params,
            "active_params": self.active_params,
        }



def _type_ok(value: Any, hint: Any) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if typing.get_origin(hint) is tuple:  # tuple[int, ...]
        return isinstance(value, (list, tuple)) and all(_type_ok(v, typing.get_args(hint)[0]) for v in value)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, (hint, Mapping))
    return True


def typed_fields(cls: type, d: Any, where: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """``d`` (a mapping of dataclass ``cls``'s fields) checked: no unknown or missing field, each value of
    its field's type (but those in ``skip``, checked by the caller); errors name ``where.field``."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{where} must be an object, got {d!r}")
    fields = dataclasses.fields(cls)
    unknown = sorted(set(d) - {f.name for f in fields})
    if unknown:
        raise ValueError(f"{where} has unknown fields {unknown}")
    missing = [f.name for f in fields if f.name not in d and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{where} lacks required fields {missing}")
    hints = typing.get_type_hints(cls)
    for name, value in d.items():
        hint = hints[name]
        if name not in skip and not _type_ok(value, hint):
            kind = getattr(hint, "__name__", None) or str(hint)
            raise ValueError(f"{where}.{name} must be {'an object' if dataclasses.is_dataclass(hint) else kind}, "
                             f"got {value!r}")
    return dict(d)
