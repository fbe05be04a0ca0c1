"""DALI residual vectors: the calibrated mean of x_{l+1} - x_l, the file format and its checks; prompt files."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dali_exec.models import get_adapter  # noqa: E402
from dali_exec.models.tiny import char_tokenizer, tiny_model  # noqa: E402
from dali_exec.recorder import ResidualVectors, calibrate_residuals, read_prompts  # noqa: E402

torch.set_num_threads(1)

TEXTS = [[5, 9, 14, 20, 33, 40, 41], [7, 8], [60, 61, 62, 63, 64]]


def _gate_inputs(model, ids):
    adapter = get_adapter(model)
    blocks = adapter.blocks(model)
    seen = {}
    handles = [b.router.register_forward_hook(
        lambda m, inp, out, i=i: seen.__setitem__(i, inp[0].reshape(-1, inp[0].shape[-1]).double()))
        for i, b in enumerate(blocks)]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), use_cache=False)
    for h in handles:
        h.remove()
    return blocks, [seen[i] for i in range(len(blocks))]


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen2_moe", "mixtral"])
def test_residuals_are_mean_differences_of_consecutive_gate_inputs(family):
    model = tiny_model(family, seed=2)
    res = calibrate_residuals(model, get_adapter(model), TEXTS, batch_size=2)  # padded batches
    sums, tokens = None, 0
    for ids in TEXTS:  # one by one, no padding
        blocks, xs = _gate_inputs(model, ids)
        diffs = [(xs[i + 1] - xs[i]).sum(0) for i in range(len(xs) - 1)]
        sums = diffs if sums is None else [a + b for a, b in zip(sums, diffs)]
        tokens += len(ids)
    assert sorted(res.vectors) == [b.layer for b in blocks[:-1]]  # every MoE block but the last
    for block, s in zip(blocks[:-1], sums):
        torch.testing.assert_close(res.vectors[block.layer], (s / tokens).float(), atol=1e-5, rtol=1e-4)
    assert res.meta["num_tokens"] == tokens == sum(map(len, TEXTS))
    assert res.meta["moe_layers"] == [b.layer for b in blocks]
    assert res.meta["model_type"] == family


def test_residual_file_round_trip_and_errors(tmp_path):
    model = tiny_model("olmoe", seed=1)
    res = calibrate_residuals(model, get_adapter(model), TEXTS, meta={"texts": "calib.txt"})
    path = res.save(tmp_path / "r.safetensors")
    back = ResidualVectors.load(path)
    assert back.source == str(path) and back.meta == res.meta and back.meta["texts"] == "calib.txt"
    assert back.meta["format"] == "dali-residual-v1" and "mean over calibration tokens" in back.meta["what"]
    for layer, v in res.vectors.items():
        assert torch.equal(back.vectors[layer], v)
    back.check_matches(model, [0, 1, 2], str(path))
    with pytest.raises(ValueError, match="calibrated on a 'olmoe' model, this model is 'mixtral'"):
        back.check_matches(tiny_model("mixtral"), [0, 1, 2], str(path))
    with pytest.raises(FileNotFoundError, match="no such residual file"):
        ResidualVectors.load(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    save_file({"layer.0": torch.zeros(32)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="plain.safetensors: not a dali residual file \\(no 'dali.residual'"):
        ResidualVectors.load(tmp_path / "plain.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="junk.safetensors: not a dali residual file"):
        ResidualVectors.load(tmp_path / "junk.safetensors")


def test_calibration_refuses_empty_input():
    model = tiny_model("olmoe")
    with pytest.raises(ValueError, match="no calibration tokens"):
        calibrate_residuals(model, get_adapter(model), [[]])
    single = tiny_model("qwen3_moe", num_hidden_layers=1, mlp_only_layers=[])
    with pytest.raises(ValueError, match="single MoE layer"):
        calibrate_residuals(single, get_adapter(single), TEXTS)


def test_prompt_files(tmp_path):
    (tmp_path / "p.txt").write_text("first prompt\n\n  second\n")
    assert [p.text for p in read_prompts(tmp_path / "p.txt")] == ["first prompt", "  second"]
    lines = [json.dumps({"text": "a", "name": "alpha", "domain": "web", "start": 5, "tags": ["x"]}), "",
             json.dumps("plain"), json.dumps({"input_ids": [3, 4]})]
    (tmp_path / "p.jsonl").write_text("\n".join(lines))
    prompts = read_prompts(tmp_path / "p.jsonl")
    assert [(p.index, p.name, p.text, p.input_ids) for p in prompts] == [
        (0, "alpha", "a", None), (1, "prompt-1", "plain", None), (2, "prompt-2", None, (3, 4))]
    assert prompts[0].attrs == {"domain": "web", "start": 5} and prompts[1].attrs == {}  # scalars kept
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "both.json").write_text(json.dumps([{"text": "x", "input_ids": [1]}]))
    with pytest.raises(ValueError, match=r"both.json: item 0: give exactly one of 'text'"):
        read_prompts(tmp_path / "both.json")
    (tmp_path / "neg.json").write_text(json.dumps([{"input_ids": [1, -2]}]))
    with pytest.raises(ValueError, match="non-negative integers"):
        read_prompts(tmp_path / "neg.json")
    (tmp_path / "p.csv").write_text("x")
    with pytest.raises(ValueError, match="unknown prompt file type '.csv'; use .txt, .jsonl or .json"):
        read_prompts(tmp_path / "p.csv")
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="empty.txt: no prompts"):
        read_prompts(tmp_path / "empty.txt")


def test_char_tokenizer_round_trips_text():
    tok = char_tokenizer()
    ids = tok("Hi, you!")["input_ids"]
    assert len(ids) == 8 and max(ids) < 128
    assert np.all(np.array(ids) > 3)  # no special or unknown token
    assert tok.decode(ids) == "Hi, you!"
