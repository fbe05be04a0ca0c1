"""Build a :class:`ModelSpec` from a Hugging Face ``config.json`` (no transformers import needed).

Each supported ``model_type`` has a small reader that knows its field names and which blocks are MoE.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

from dali_sim.files import check_input
from dali_sim.models.presets import apply_precision
from dali_sim.models.spec import AttentionSpec, ModelSpec
from dali_sim.registry import Registry

ConfigReader = Callable[[Mapping[str, Any]], dict[str, Any]]
HF_READERS: Registry[ConfigReader] = Registry("HF model_type")

_DTYPE_TO_PRECISION = {"bfloat16": "bf16", "float16": "bf16", "float32": "fp32"}


class _Config:
    """Field access that names the config file and the missing key."""

    def __init__(self, data: Mapping[str, Any], where: str):
        self.data, self.where = data, where

    def __call__(self, *keys: str, default: Any = KeyError) -> Any:
        for key in keys:
            if key in self.data and self.data[key] is not None:
                return self.data[key]
        if default is KeyError:
            raise ValueError(f"{self.where}: missing field {' or '.join(repr(k) for k in keys)}")
        return default


def _gqa(c: _Config) -> AttentionSpec:
    heads = int(c("num_attention_heads"))
    return AttentionSpec(
        kind="gqa",
        num_heads=heads,
        num_kv_heads=int(c("num_key_value_heads", default=heads)),
        head_dim=int(c("head_dim", default=int(c("hidden_size")) // heads)),
        bias=bool(c("attention_bias", "qkv_bias", default=False)),
    )


def _common(c: _Config, inter_key: str) -> dict[str, Any]:
    return {
        "num_layers": int(c("num_hidden_layers")),
        # transformers 5 renamed some of these keys; checkpoints on the hub still use the old ones
        "num_experts": int(c("num_experts", "num_local_experts", "n_routed_experts")),
        "top_k": int(c("num_experts_per_tok", "experts_per_token")),
        "hidden_size": int(c("hidden_size")),
        "expert_intermediate_size": int(c(inter_key)),
        "vocab_size": int(c("vocab_size")),
        "tie_word_embeddings": bool(c("tie_word_embeddings", default=False)),
    }


def _every_block_moe(norm_topk_default: bool, **fixed: Any) -> ConfigReader:
    """Reader for architectures whose every block is MoE with a plain ``intermediate_size``."""

    def read(c: _Config) -> dict[str, Any]:
        d = _common(c, "intermediate_size")
        return d | {
            "moe_layers": tuple(range(d["num_layers"])),
            "attention": _gqa(c),
            "norm_topk_prob": bool(c("norm_topk_prob", default=norm_topk_default)),
            **fixed,
        }

    return read


HF_READERS.add("mixtral", _every_block_moe(True))
HF_READERS.add("olmoe", _every_block_moe(False))
HF_READERS.add("gpt_oss", _every_block_moe(True, expert_bias=True))


def _dense_size(c: _Config, num_layers: int, moe: tuple[int, ...]) -> int:
    """The dense MLP width, only where some block is dense (else the field is unused)."""
    return int(c("intermediate_size")) if len(moe) < num_layers else 0


def _qwen_moe(c: _Config, shared: bool) -> dict[str, Any]:
    d = _common(c, "moe_intermediate_size")
    step = int(c("decoder_sparse_step", default=1))
    mlp_only = set(c("mlp_only_layers", default=[]))
    moe = tuple(i for i in range(d["num_layers"]) if i not in mlp_only and step > 0 and (i + 1) % step == 0)
    d |= {
        "moe_layers": moe,
        "attention": _gqa(c),
        "norm_topk_prob": bool(c("norm_topk_prob", default=False)),
        "dense_intermediate_size": _dense_size(c, d["num_layers"], moe),
    }
    shared_size = int(c("shared_expert_intermediate_size", default=0)) if shared else 0
    if shared_size:
        d |= {"num_shared_experts": 1, "shared_expert_intermediate_size": shared_size}
    return d


HF_READERS.add("qwen2_moe", lambda c: _qwen_moe(c, shared=True))
HF_READERS.add("qwen3_moe", lambda c: _qwen_moe(c, shared=False))


def _deepseek(c: _Config) -> dict[str, Any]:
    d = _common(c, "moe_intermediate_size")
    first_dense = int(c("first_k_dense_replace", default=0))
    freq = int(c("moe_layer_freq", default=1))
    moe = tuple(i for i in range(d["num_layers"]) if i >= first_dense and i % freq == 0)
    n_shared = int(c("n_shared_experts", default=0))
    attention = AttentionSpec(
        kind="mla",
        num_heads=int(c("num_attention_heads")),
        q_lora_rank=int(c("q_lora_rank", default=0)),
        kv_lora_rank=int(c("kv_lora_rank")),
        qk_nope_head_dim=int(c("qk_nope_head_dim")),
        qk_rope_head_dim=int(c("qk_rope_head_dim")),
        v_head_dim=int(c("v_head_dim")),
    )
    d |= {
        "moe_layers": moe,
        "attention": attention,
        "norm_topk_prob": bool(c("norm_topk_prob", default=False)),
        "dense_intermediate_size": _dense_size(c, d["num_layers"], moe),
    }
    if n_shared:
        # DeepSeek builds its shared experts as one MLP of n_shared * moe_intermediate_size; the
        # parameter count is the same as n_shared experts of moe_intermediate_size each.
        d |= {"num_shared_experts": n_shared, "shared_expert_intermediate_size": d["expert_intermediate_size"]}
    return d


HF_READERS.add("deepseek_v2", _deepseek)
HF_READERS.add("deepseek_v3", _deepseek)


def _glm4_moe(c: _Config) -> dict[str, Any]:
    """GLM-4.5/4.6 MoE: dense first ``first_k_dense_replace`` blocks, optional shared experts."""
    d = _common(c, "moe_intermediate_size")
    moe = tuple(range(int(c("first_k_dense_replace", default=0)), d["num_layers"]))
    d |= {"moe_layers": moe, "attention": _gqa(c), "norm_topk_prob": bool(c("norm_topk_prob", default=True)),
          "dense_intermediate_size": _dense_size(c, d["num_layers"], moe)}
    n_shared = int(c("n_shared_experts", default=0))
    if n_shared:
        d |= {"num_shared_experts": n_shared, "shared_expert_intermediate_size": d["expert_intermediate_size"]}
    return d


HF_READERS.add("glm4_moe", _glm4_moe)
HF_READERS.add("flex_olmo", _every_block_moe(False))


@HF_READERS.register("switch_transformers")
def _switch(c: _Config) -> dict[str, Any]:
    layers = int(c("num_layers"))
    sparse = int(c("num_sparse_encoder_layers"))
    step = layers // sparse if sparse else 0
    # transformers' SwitchTransformersStack: block i is sparse iff i % step == 1 (or step == 1)
    moe = tuple(i for i in range(layers) if step and (step == 1 or i % step == 1))
    heads = int(c("num_heads"))
    return {
        "num_layers": layers,
        "moe_layers": moe,
        "num_experts": int(c("num_experts")),
        "top_k": 1,
        "hidden_size": int(c("d_model")),
        "expert_intermediate_size": int(c("d_ff")),
        "dense_intermediate_size": int(c("d_ff")),
        "ffn_matrices": 2,
        "vocab_size": int(c("vocab_size")),
        "tie_word_embeddings": bool(c("tie_word_embeddings", default=True)),
        "norm_topk_prob": False,
        "attention": AttentionSpec(kind="gqa", num_heads=heads, num_kv_heads=heads, head_dim=int(c("d_kv"))),
        "notes": "encoder stack only",
    }


def spec_from_hf_config(config: Mapping[str, Any] | str | Path, name: str | None = None,
                        precision: str | None = None) -> ModelSpec:
    """A spec from a config dict, a ``config.json`` path, or a model directory containing one."""
    where = "config"
    if not isinstance(config, Mapping):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        where = str(path)
        check_input(path, "model config")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(config).__name__}")
    c = _Config(config, where)
    model_type = c("model_type")
    if model_type not in HF_READERS:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(HF_READERS)}")
    fields = HF_READERS.get(model_type)(c)
    if precision is None:
        quant = c("quantization_config", default={}) or {}
        dtype = _DTYPE_TO_PRECISION.get(str(c("torch_dtype", "dtype", default="bfloat16")), "bf16")
        # MXFP4 checkpoints (gpt-oss) quantise the routed experts only; the rest stays at the dtype
        precision = f"mxfp4/{dtype}" if quant.get("quant_method") == "mxfp4" else dtype
    source = f"HF config.json ({where})" if where != "config" else "HF config"
    fields.setdefault("notes", "")
    spec = ModelSpec(
        name=name or str(c("_name_or_path", default=model_type)),
        family=model_type,
        source=source,
        **fields,
    )
    return apply_precision(spec, precision)
