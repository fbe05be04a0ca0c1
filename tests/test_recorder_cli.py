"""``dali trace record`` and ``dali trace calibrate-residual`` on a tiny checkpoint folder."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dali_exec.models import supported_model_types  # noqa: E402
from dali_exec.models.tiny import save_tiny  # noqa: E402
from dali_sim.cli.main import cli  # noqa: E402
from dali_sim.trace import read_trace  # noqa: E402
from dali_sim.trace.provenance import file_sha256  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    save_tiny("deepseek_v2", d / "ds", seed=3)
    save_tiny("mixtral", d / "mix", seed=3)
    (d / "prompts.jsonl").write_text("\n".join(json.dumps(x) for x in [
        {"text": "tell me a story about a fox", "name": "fox", "domain": "stories"}, {"text": "2 + 2 ="}, "short"]))
    (d / "calib.txt").write_text("calibration text number one\nand a second, somewhat longer calibration line\n")
    return d


def run(*args):
    result = CliRunner().invoke(cli, list(map(str, args)), catch_exceptions=False)
    return result.exit_code, result.output


def test_calibrate_then_record_with_residual(files, tmp_path):
    res = tmp_path / "res.safetensors"
    code, out = run("trace", "calibrate-residual", "--model", files / "ds", "--texts", files / "calib.txt",
                    "--batch-size", "2", "-o", res)
    assert code == 0, out
    assert "wrote" in out and "1 residual vectors of size 32" in out  # MoE blocks 1, 2: one vector (block 1)
    from dali_exec.recorder import ResidualVectors

    meta = ResidualVectors.load(res).meta
    assert meta["texts_sha256"] == file_sha256(files / "calib.txt") and meta["command"].startswith("dali trace")
    assert {"torch", "transformers"} <= set(meta["versions"])

    out_trace = tmp_path / "t.parquet"
    code, out = run("trace", "record", "--model", files / "ds", "--prompts", files / "prompts.jsonl",
                    "--batch-size", "2", "--max-new-tokens", "5", "--prefill-chunk", "4", "--residual", res,
                    "--router-logits", "-q", "-o", out_trace)
    assert code == 0, out
    t = read_trace(out_trace)
    assert set(t.meta.predictors) == {"next-gate", "residual"} and t.meta.has_router_logits
    assert t.layers == (1, 2) and set(np.unique(t.layer)) == {1, 2}  # block 0 is dense
    prov = t.meta.provenance
    assert prov["source"] == "record" and prov["prompts"]["sha256"] == file_sha256(files / "prompts.jsonl")
    assert prov["residual"]["sha256"] == file_sha256(res) and prov["recorder"]["prefill_chunk"] == 4
    assert [s.name for s in t.meta.sequences] == ["fox", "prompt-1", "prompt-2"]
    assert t.meta.sequences[0].attrs["domain"] == "stories" and t.meta.sequences[0].attrs["index"] == 0
    assert t.meta.model.name == "ds" and t.meta.model.precision.name == "fp32"
    lookahead = t.lookahead("residual")
    assert np.isnan(lookahead[t.layer == 2]).all() and np.isfinite(lookahead[t.layer == 1]).all()


def test_record_without_residual_has_only_next_gate(files, tmp_path):
    code, out = run("trace", "record", "--model", files / "mix", "--prompts", files / "prompts.jsonl",
                    "--max-new-tokens", "3", "-o", tmp_path / "a.parquet")
    assert code == 0, out
    assert "wrote" in out and "3 sequences" in out
    assert set(read_trace(tmp_path / "a.parquet").meta.predictors) == {"next-gate"}
    code, out = run("trace", "record", "--model", files / "mix", "--prompts", files / "prompts.jsonl",
                    "--max-new-tokens", "3", "--no-next-gate", "-q", "-o", tmp_path / "b.parquet")
    assert code == 0 and read_trace(tmp_path / "b.parquet").meta.predictors == {}


def test_record_next_gates_gives_hybrimoe_its_lookahead(tmp_path):
    """--next-gates 3 records gate2 and gate3 (routers of MoE layers l+2, l+3 on the gate input x_l), equal to
    a direct computation on the prompt, and HybriMoE, which needs them, then simulates on the recorded trace."""
    from conftest import REPO
    from dali_exec.models import get_adapter
    from dali_exec.recorder import load_model, read_prompts, tokenize
    from dali_sim.sim import simulate
    from dali_sim.workload.profiling import ProfileSpec  # one prompt: the whole trace evaluated

    model_dir = REPO / "models" / "dali-tiny-moe"  # 4 MoE layers
    prompts = tmp_path / "p.txt"
    prompts.write_text("the quick brown fox\n")
    out = tmp_path / "t.parquet"
    code, text = run("trace", "record", "--model", model_dir, "--prompts", prompts, "--max-new-tokens", "3",
                     "--next-gates", "3", "-q", "-o", out)
    assert code == 0, text
    t = read_trace(out).sorted()
    assert {p.name: p.target_offset for p in t.meta.predictors.values()} == {"next-gate": 1, "gate2": 2, "gate3": 3}

    model, tok = load_model(str(model_dir), progress=False)
    adapter = get_adapter(model)
    blocks = adapter.blocks(model)
    ids = tokenize(read_prompts(prompts), tok, "p")[0]
    gate_inputs = {}
    def keep(ordinal):
        return lambda module, inputs, output: gate_inputs.__setitem__(ordinal, inputs[0].reshape(len(ids), -1))

    hooks = [b.router.register_forward_hook(keep(i)) for i, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    prefill = t.phase == 0
    for ordinal, block in enumerate(blocks):
        rows = prefill & (t.layer == block.layer)
        for d, name in ((2, "gate2"), (3, "gate3")):
            got = t.lookahead(name)[rows]
            if ordinal + d >= len(blocks):
                assert np.isnan(got).all()
                continue
            with torch.no_grad():
                want = adapter.router_logits(blocks[ordinal + d], gate_inputs[ordinal]).float().numpy()
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    r = simulate(t, "hybrimoe", overrides={"memory": {"cache_experts": "8"}}, profiling=ProfileSpec(share=0.0))
    assert r.summary["decode_steps"] > 0 and r.config["system"]["prefetch"]["predictor3"] == "gate3"
    # without the option HybriMoE is refused, and the hint names the option
    code, text = run("trace", "record", "--model", model_dir, "--prompts", prompts, "--max-new-tokens", "3", "-q",
                     "-o", tmp_path / "plain.parquet")
    assert code == 0, text
    with pytest.raises(ValueError, match="gate2 and gate3 with --next-gates 3"):
        simulate(read_trace(tmp_path / "plain.parquet"), "hybrimoe", profiling=ProfileSpec(share=0.0))


def test_clear_errors(files, tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=8,
                vocab_size=32).save_pretrained(tmp_path / "llama")
    code, out = run("trace", "record", "--model", tmp_path / "llama", "--prompts", files / "prompts.jsonl",
                    "-o", tmp_path / "x.parquet")
    assert code == 1
    assert "model_type 'llama' has no MoE adapter; supported: " + ", ".join(supported_model_types()) in out

    code, out = run("trace", "record", "--model", tmp_path / "nowhere", "--prompts", files / "prompts.jsonl",
                    "-o", tmp_path / "x.parquet")
    assert code == 1 and "--model" in out and "cannot read a transformers config" in out

    res = tmp_path / "mix.safetensors"
    assert run("trace", "calibrate-residual", "--model", files / "mix", "--texts", files / "calib.txt", "-q",
               "-o", res)[0] == 0
    code, out = run("trace", "record", "--model", files / "ds", "--prompts", files / "prompts.jsonl",
                    "--residual", res, "-o", tmp_path / "x.parquet")
    assert code == 1 and "mix.safetensors: residual vectors are for MoE blocks [0, 1]" in out
    code, out = run("trace", "record", "--model", files / "ds", "--prompts", files / "prompts.jsonl",
                    "--device", "tpu", "-o", tmp_path / "x.parquet")
    assert code == 1 and "--device must be cpu, cuda or cuda:N" in out
    assert not (tmp_path / "x.parquet").exists() and not (tmp_path / "x.parquet.partial").exists()


def test_help_says_what_is_recorded():
    code, out = run("trace", "record", "--help")
    assert code == 0
    flat = " ".join(out.split())
    assert "Without it only the `next-gate` column is recorded" in flat
    for family in supported_model_types():  # the help's family list is kept in step with the adapters
        assert family in flat
    code, out = run("trace", "calibrate-residual", "--help")
    assert code == 0 and "residual vectors" in out
