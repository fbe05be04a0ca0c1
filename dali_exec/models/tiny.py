"""Tiny randomly initialised models of every supported family, and a character tokenizer for them.

For tests and benchmarks that must not download anything: the configs keep each family's structure
(dense first blocks, shared experts, group-limited routing, sliding windows) at toy sizes.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch

PAD, EOS, BOS, UNK = 0, 1, 2, 3
_SPECIALS = ("<pad>", "</s>", "<s>", "<unk>")
_CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"
VOCAB_SIZE = 128  # >= len(_SPECIALS) + len(_CHARS) = 100

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, initializer_range=0.1, pad_token_id=PAD, eos_token_id=EOS,
               bos_token_id=BOS, tie_word_embeddings=False)

# per family: (config class name, fields); block indices that are dense noted in comments
_TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=3, intermediate_size=16, num_local_experts=6,
                                      num_experts_per_tok=2)),
    # block 0 dense (mlp_only_layers), blocks 1-2 MoE with a shared expert
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
                                         mlp_only_layers=[0])),
    # block 1 dense
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
                                         num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1],
                                         norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(num_hidden_layers=3, intermediate_size=16, num_experts=6, num_experts_per_tok=2)),
    # block 0 dense (first_k_dense_replace); MLA attention; shared experts
    "deepseek_v2": ("DeepseekV2Config", dict(num_hidden_layers=3, num_key_value_heads=4, intermediate_size=48,
                                             moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                                             n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                                             q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                             topk_method="greedy", routed_scaling_factor=1.0)),
    # block 0 dense; group-limited sigmoid routing with a selection bias
    "deepseek_v3": ("DeepseekV3Config", dict(num_hidden_layers=3, num_key_value_heads=4, intermediate_size=48,
                                             moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                                             n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                                             q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                             n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # DeepSeek-V3 routing with GQA attention; block 0 dense
    "glm4_moe": ("Glm4MoeConfig", dict(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
                                       n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                       first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5)),
    "flex_olmo": ("FlexOlmoConfig", dict(num_hidden_layers=2, intermediate_size=16, num_experts=5,
                                         num_experts_per_tok=2)),
    # alternating sliding-window / full attention, router bias, attention sinks
    "gpt_oss": ("GptOssConfig", dict(num_hidden_layers=3, intermediate_size=16, num_local_experts=6,
                                     num_experts_per_tok=2, head_dim=8, sliding_window=8)),
}


def tiny_model_types() -> list[str]:
    return sorted(_TINY)


def tiny_config(model_type: str, **overrides: Any):
    """A toy-sized transformers config of ``model_type`` (see ``tiny_model_types()``)."""
    import transformers

    if model_type not in _TINY:
        raise ValueError(f"no tiny config for {model_type!r}; known: {', '.join(tiny_model_types())}")
    cls_name, fields = _TINY[model_type]
    return getattr(transformers, cls_name)(**(_COMMON | fields | overrides))


def tiny_model(model_type: str, seed: int = 0, **overrides: Any):
    """A randomly initialised ``*ForCausalLM`` in eval mode (float32, deterministic for a seed).

    DeepSeek-V3's selection bias starts at zero; it is drawn at random so that tests exercise it.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).eval()
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    return model


def char_tokenizer():
    """A character-level fast tokenizer matching the tiny models' vocabulary (left padding)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIALS + tuple(_CHARS))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                  unk_token="<unk>", padding_side="left")
    return tok


def save_tiny(model_type: str, folder: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny model and its tokenizer to ``folder`` (a local "checkpoint" for CLI tests)."""
    folder = Path(folder)
    tiny_model(model_type, seed, **overrides).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder
