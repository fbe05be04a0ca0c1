"""Model presets: derived sizes against published parameter counts; HF config.json reading."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dali_sim.cli.main import cli
from dali_sim.models import get_model, get_precision, model_names, spec_from_hf_config
from dali_sim.models.spec import AttentionSpec, ModelSpec
from dali_sim.registry import UnknownNameError

# (total, active) parameters published by the model authors, in billions. Active counts here include
# both embedding matrices; gpt-oss's model card counts the unembedding only (3.61B and 5.13B), hence 4.19 and 5.71.
PUBLISHED = {
    "mixtral-8x7b": (46.7, 12.9),
    "deepseek-v2-lite": (15.7, None),
    "qwen3-30b-a3b": (30.5, 3.3),
    "qwen1.5-moe-a2.7b": (14.3, 2.7),
    "gpt-oss-20b": (20.9, 3.61 + 201088 * 2880 / 1e9),
    "gpt-oss-120b": (116.8, 5.13 + 201088 * 2880 / 1e9),
    "olmoe-1b-7b": (6.9, 1.3),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_published_sizes(name):
    spec = get_model(name)
    total, active = PUBLISHED[name]
    assert spec.total_params / 1e9 == pytest.approx(total, rel=0.01)
    if active:
        assert spec.active_params / 1e9 == pytest.approx(active, rel=0.04)


def test_required_presets_exist():
    assert {"mixtral-8x7b", "deepseek-v2-lite", "qwen3-30b-a3b", "gpt-oss-20b", "olmoe-1b-7b",
            "switch-base-8"} <= set(model_names())


def test_expert_bytes_derived_from_shape_and_precision():
    m = get_model("mixtral-8x7b", "bf16")
    assert m.expert_params == 3 * 4096 * 14336
    assert m.expert_bytes == 3 * 4096 * 14336 * 2  # 336 MiB in bf16
    assert get_model("mixtral-8x7b", "q4_0").expert_bytes == round(3 * 4096 * 14336 * 18 / 32)
    assert get_model("mixtral-8x7b", "q8_0").expert_bytes == round(3 * 4096 * 14336 * 34 / 32)
    g = get_model("gpt-oss-20b", "mxfp4")
    # gpt-oss experts have biases on gate_up (2 x 2880) and down (2880)
    assert g.expert_params == 3 * 2880 * 2880 + 3 * 2880
    assert g.expert_bytes == round(g.expert_params * 17 / 32)


def test_deepseek_layers_and_shared_experts():
    d = get_model("deepseek-v2-lite")
    assert d.moe_layers == tuple(range(1, 27)) and d.num_dense_layers == 1
    assert d.shared_expert_params == 2 * 3 * 2048 * 1408
    s = get_model("switch-base-8")
    assert s.moe_layers == (1, 3, 5, 7, 9, 11) and s.ffn_matrices == 2


def test_unknown_names_are_clear():
    with pytest.raises(UnknownNameError, match="unknown model preset 'mixtral'; known: .*mixtral-8x7b"):
        get_model("mixtral")
    with pytest.raises(UnknownNameError, match="unknown precision 'int3'"):
        get_precision("int3")


def test_spec_validation():
    attn = AttentionSpec(kind="gqa", num_heads=1, num_kv_heads=1, head_dim=4)
    base = dict(name="m", family="x", num_layers=2, moe_layers=(0, 1), num_experts=4, top_k=2, hidden_size=4,
                expert_intermediate_size=8, attention=attn, vocab_size=8)
    ModelSpec(**base)
    with pytest.raises(ValueError, match="top_k=5 not in 1..num_experts=4"):
        ModelSpec(**base | {"top_k": 5})
    with pytest.raises(ValueError, match="moe_layers must lie in 0..1"):
        ModelSpec(**base | {"moe_layers": (0, 2)})
    with pytest.raises(ValueError, match="dense layers need dense_intermediate_size"):
        ModelSpec(**base | {"moe_layers": (1,)})
    spec = ModelSpec(**base)
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


# ---- HF config.json -----------------------------------------------------------------------------
def test_hf_config_mixtral_file(tmp_path):
    cfg = {"model_type": "mixtral", "num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
           "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
           "vocab_size": 32000, "torch_dtype": "bfloat16", "_name_or_path": "mistralai/Mixtral-8x7B-v0.1"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = spec_from_hf_config(tmp_path)  # a model folder (its torch_dtype: bf16)
    preset = get_model("mixtral-8x7b", "bf16")
    assert spec.name == "mistralai/Mixtral-8x7B-v0.1"
    assert (spec.total_params, spec.expert_bytes, spec.moe_layers) == (preset.total_params, preset.expert_bytes, preset.moe_layers)


def test_hf_config_deepseek_dense_first_layer_and_qwen_sparse_step():
    ds = {"model_type": "deepseek_v2", "num_hidden_layers": 27, "n_routed_experts": 64, "num_experts_per_tok": 6,
          "n_shared_experts": 2, "moe_intermediate_size": 1408, "intermediate_size": 10944, "hidden_size": 2048,
          "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_attention_heads": 16, "kv_lora_rank": 512,
          "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
          "vocab_size": 102400}
    spec = spec_from_hf_config(ds, name="dsv2l")
    assert spec.total_params == get_model("deepseek-v2-lite").total_params
    qw = {"model_type": "qwen2_moe", "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
          "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "intermediate_size": 64,
          "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10, "decoder_sparse_step": 2,
          "mlp_only_layers": [3]}
    spec = spec_from_hf_config(qw)
    assert spec.moe_layers == (1,) and spec.dense_intermediate_size == 64 and spec.num_shared_experts == 1


def test_hf_config_from_transformers_defaults():
    transformers = pytest.importorskip("transformers")
    # transformers' default configs are real models: Mixtral-8x7B, DeepSeek-V3 (671B), gpt-oss-120b
    assert spec_from_hf_config(transformers.MixtralConfig().to_dict()).total_params == get_model("mixtral-8x7b").total_params
    assert spec_from_hf_config(transformers.DeepseekV3Config().to_dict()).total_params / 1e9 == pytest.approx(671, rel=0.01)
    assert spec_from_hf_config(transformers.GptOssConfig().to_dict()).total_params / 1e9 == pytest.approx(116.8, rel=0.01)


def test_hf_config_errors(tmp_path):
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        spec_from_hf_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="missing field 'num_experts_per_tok' or 'experts_per_token'"):
        spec_from_hf_config({"model_type": "olmoe", "num_hidden_layers": 2, "num_experts": 4})
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        spec_from_hf_config(tmp_path / "config.json")


def test_cli_model_commands():
    r = CliRunner().invoke(cli, ["model", "list"])
    # each preset at its default precision: Mixtral's 4-bit experts (94.5 MiB), gpt-oss as released
    rows = {line.split()[0]: line.split() for line in r.output.splitlines()[1:-1]}
    assert r.exit_code == 0 and rows["mixtral-8x7b"][1:2] == ["q4_0"] and rows["mixtral-8x7b"][5] == "94.5"
    assert rows["gpt-oss-20b"][1] == "mxfp4/bf16" and rows["olmoe-1b-7b"][1] == "bf16"
    r = CliRunner().invoke(cli, ["model", "show", "olmoe-1b-7b", "--precision", "q4_0", "--json"])
    data = json.loads(r.output)
    assert data["derived"]["expert_bytes"] == round(3 * 2048 * 1024 * 0.5625)
    r = CliRunner().invoke(cli, ["model", "show", "nope"])
    assert r.exit_code == 1 and "Error:" in r.output


def test_default_precisions_match_how_each_model_is_run():
    """gpt-oss-20b as released: MXFP4 experts, bf16 elsewhere; the DALI paper's three models at 4-bit
    (q4_0: 18 bytes per 32 weights, whole model); the others bf16. --precision still overrides."""
    g = get_model("gpt-oss-20b")
    assert (g.precision.name, g.dense_format.name, g.precision_label) == ("mxfp4", "bf16", "mxfp4/bf16")
    assert g.expert_bytes == round(g.expert_params * 17 / 32)
    assert g.bytes_of(g.non_expert_params) == round(g.non_expert_params * 2)
    for name in ("mixtral-8x7b", "deepseek-v2-lite", "qwen3-30b-a3b"):
        m = get_model(name)
        assert m.precision_label == "q4_0" and m.expert_bytes == round(m.expert_params * 18 / 32), name
    for name in ("olmoe-1b-7b", "qwen1.5-moe-a2.7b", "switch-base-8"):
        assert get_model(name).precision_label == "bf16"
    assert get_model("mixtral-8x7b", "bf16").precision_label == "bf16"
    assert get_model("gpt-oss-20b", "bf16").precision_label == "bf16"  # a whole-model format replaces both
