"""Bad input gets one line naming the file or parameter, before any work: non-finite residual vectors,
memory sizes that are not sizes, requests that cannot fit, undecodable files, FIFOs, broken model folders
(items 5, 6, 9 and 10 of the field-readiness issue)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import REPO
from dali_sim.cli.main import cli
from dali_sim.models.spec import AttentionSpec, ModelSpec
from dali_sim.trace import TraceWriter
from dali_sim.trace.synth import SynthConfig, synthesize

MODEL = REPO / "models" / "dali-tiny-moe"
RESIDUAL = MODEL / "residual.safetensors"
PROFILE = REPO / "dali_sim" / "hardware" / "profiles" / "rtx3090-epyc7532.toml"


def dali(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_line(result, *words, code: int = 1) -> str:
    """Exit ``code`` with a single ``Error:`` line that contains every word."""
    assert result.exit_code == code, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, result.output
    for w in words:
        assert str(w) in errors[0], (w, result.output)
    return errors[0]


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bad") / "t.parquet"
    synthesize(SynthConfig("mixtral-8x7b", sequences=2, prompt_len=4, gen_len=4), path, progress=False)
    return path


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "p.txt"
    path.write_text("hello there\n")
    return path


def _residual(tmp_path: Path, change) -> Path:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    with safe_open(str(RESIDUAL), framework="pt") as f:
        meta = f.metadata()
    tensors = {k: change(v) for k, v in load_file(str(RESIDUAL)).items()}
    out = tmp_path / "res.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out), metadata=meta)
    assert torch is not None
    return out


# ---- 5. non-finite residual vectors ---------------------------------------------------------------
def test_all_nan_residual_file_is_refused_by_record(tmp_path, prompts):
    bad = _residual(tmp_path, lambda v: v * float("nan"))
    r = dali("trace", "record", "--model", MODEL, "--prompts", prompts, "--residual", bad, "-q", "-o",
             tmp_path / "t.parquet")
    one_line(r, bad, "non-finite")
    assert not (tmp_path / "t.parquet").exists()


def test_all_nan_residual_file_is_refused_by_generate(tmp_path, prompts):
    bad = _residual(tmp_path, lambda v: v * float("nan"))
    r = dali("exec", "generate", "--model", MODEL, "--prompts", prompts, "--system", "dali", "--residual", bad,
             "--cache-experts", "8", "-q")
    one_line(r, bad, "non-finite")


def test_residual_tensor_of_wrong_shape_is_refused(tmp_path, prompts):
    bad = _residual(tmp_path, lambda v: v.reshape(1, -1))
    r = dali("trace", "record", "--model", MODEL, "--prompts", prompts, "--residual", bad, "-q", "-o",
             tmp_path / "t.parquet")
    one_line(r, bad, "shape")


# ---- 6. memory sizes that are not sizes ------------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "0", "inf", "-3", "lots"])
def test_gpu_memory_that_is_not_a_size_is_refused(trace, value):
    r = dali("sim", "run", "--trace", trace, "--system", "gpu-lru", "--no-timing", "--gpu-memory", value)
    one_line(r, "--gpu-memory", code=2)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_set_gpu_memory_gib_that_is_not_a_size_is_refused(trace, value):
    r = dali("sim", "run", "--trace", trace, "--system", "gpu-lru", "--no-timing", "--set",
             f"memory.gpu_memory_gib={value}")
    one_line(r, "gpu_memory_gib")


def test_profile_memory_of_1e300_gib_is_refused(tmp_path, trace):
    text = PROFILE.read_text().replace("memory_gib = 24\n", "memory_gib = 1e300\n", 1)
    assert "1e300" in text
    huge = tmp_path / "huge.toml"
    huge.write_text(text)
    one_line(dali("sim", "run", "--trace", trace, "--system", "gpu-lru", "--no-timing", "--hardware", huge),
             huge, "gpu.memory_gib")


# ---- 9. requests that cannot fit --------------------------------------------------------------------
def test_synth_request_that_cannot_fit_is_refused(tmp_path):
    out = tmp_path / "huge.parquet"
    r = dali("trace", "synth", "--model", "mixtral-8x7b", "--sequences", "100000", "--prompt-len", "100000000",
             "--gen-len", "50000000", "-q", "-o", out)
    one_line(r, out, "480,000,000,000,000 rows", "free")
    assert list(tmp_path.iterdir()) == []


def test_synth_with_more_sequences_than_the_metadata_can_list_is_refused(tmp_path):
    one_line(dali("trace", "synth", "--model", "mixtral-8x7b", "--sequences", "5000000", "-o", tmp_path / "x.parquet"),
             "sequences")


def test_prompt_over_the_models_positions_is_refused_by_record(tmp_path):
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"name": "long", "input_ids": [65] * 600}) + "\n")
    r = dali("trace", "record", "--model", MODEL, "--prompts", long, "-q", "-o", tmp_path / "t.parquet")
    one_line(r, "long", "600 tokens", "512 positions")
    assert not [p for p in tmp_path.iterdir() if p.suffix != ".jsonl"]


# ---- 10. unnamed errors and tracebacks --------------------------------------------------------------
def test_profile_that_is_not_utf8_names_the_file(tmp_path, trace):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(PROFILE.read_bytes().replace(b"RTX 3090", b"RTX \xe9090", 1))
    one_line(dali("sim", "run", "--trace", trace, "--system", "gpu-lru", "--hardware", bad), bad, "UTF-8")


def test_prompt_file_that_is_not_utf8_names_the_file(tmp_path):
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"caf\xe9\n")
    one_line(dali("trace", "record", "--model", MODEL, "--prompts", bad, "-q", "-o", tmp_path / "t.parquet"),
             bad, "UTF-8")


def test_model_config_that_is_not_utf8_names_the_file(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"model_type": "qwen3_moe\xe9"}')
    one_line(dali("model", "show", tmp_path), "config.json", "UTF-8")


def test_model_folder_without_weights_gives_one_line(tmp_path, prompts):
    folder = tmp_path / "noweights"
    folder.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL / f, folder / f)
    one_line(dali("trace", "record", "--model", folder, "--prompts", prompts, "-q", "-o", tmp_path / "t.parquet"),
             folder, "cannot load the weights")


def test_unreadable_pickle_weight_file_gives_one_line(tmp_path, prompts):
    folder = tmp_path / "pickle"
    folder.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL / f, folder / f)
    # fixed bytes (a seeded draw): random ones could by chance start like a zip archive or a valid pickle
    (folder / "pytorch_model.bin").write_bytes(random.Random(0).randbytes(4096))
    one_line(dali("trace", "record", "--model", folder, "--prompts", prompts, "-q", "-o", tmp_path / "t.parquet"),
             folder, "pickle")


@pytest.mark.parametrize("command", [["sim", "run", "--system", "gpu-lru"], ["trace", "synth", "--model", "x"],
                                     ["exec", "run", "--system", "gpu-lru"]])
def test_negative_seed_is_refused(trace, command):
    args = [*command, "--seed", "-5"] + (["--trace", trace] if command[0] != "trace" else ["-o", "x.parquet"])
    one_line(dali(*args), "--seed", code=2)


@pytest.mark.parametrize("make_args", [
    lambda fifo, t: ["trace", "validate", fifo],
    lambda fifo, t: ["trace", "info", fifo],
    lambda fifo, t: ["sim", "run", "--trace", t, "--system", "gpu-lru", "--hardware", fifo.with_suffix(".toml")],
    lambda fifo, t: ["trace", "record", "--model", MODEL, "--prompts", fifo.with_suffix(".txt"), "-o", "x.parquet"],
    lambda fifo, t: ["trace", "import", "--format", "gpt-oss-fingerprint", fifo.with_suffix(".json"), "-o", "x.parquet"],
    lambda fifo, t: ["trace", "synth", "--model", "mixtral-8x7b", "--popularity-from", fifo.with_suffix(".json"),
                     "-o", "x.parquet"],
], ids=["validate", "info", "hardware", "prompts", "import", "popularity-from"])
def test_fifo_as_input_gives_one_line_instead_of_hanging(tmp_path, trace, make_args):
    fifo = tmp_path / "pipe"
    for suffix in ("", ".toml", ".txt", ".json"):
        os.mkfifo(fifo.with_suffix(suffix))
    args = [str(a) for a in make_args(fifo, trace)]
    r = subprocess.run([sys.executable, "-m", "dali_sim", *args], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert r.returncode in (1, 2), r.stderr
    assert "pipe" in r.stderr and ("FIFO" in r.stderr or "regular file" in r.stderr), r.stderr
    assert "Traceback" not in r.stderr


def _gpt_oss_doc(change) -> dict:
    layers = {f"layer_{i}": {"selected_experts": [0, 1, 2, 3], "selected_probs": [0.4, 0.3, 0.2, 0.1]}
              for i in range(24)}
    doc = {"full_text": ["x"] * 5, "generated_only": ["x"] * 3,
           "router_data": [{f"token_{2 + i}": json.loads(json.dumps(layers))} for i in range(2)]}
    change(doc)
    return doc


@pytest.mark.parametrize("change, words", [
    (lambda d: d["router_data"][1]["token_3"]["layer_5"].update(selected_experts=[3, 3, 1, 2]), ["duplicate"]),
    (lambda d: d["router_data"][1]["token_3"]["layer_5"].update(selected_probs=[float("nan"), 0.3, 0.2, 0.1]),
     ["finite"]),
    (lambda d: d["router_data"][1]["token_3"]["layer_5"].update(selected_probs=[1.3, -0.3, 0.0, 0.0]),
     ["non-negative"]),
], ids=["duplicate-ids", "nan-prob", "negative-prob"])
def test_importer_value_errors_name_the_input_file_and_entry(tmp_path, change, words):
    src = tmp_path / "gen.json"
    src.write_text(json.dumps(_gpt_oss_doc(change)))
    r = dali("trace", "import", "--format", "gpt-oss-fingerprint", src, "-o", tmp_path / "out.parquet")
    one_line(r, src, "router_data[1]", "layer_5", *words)


def test_record_without_torch_gives_the_same_line_as_exec(tmp_path, trace, prompts):
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "from dali_sim.cli.main import cli; cli()")
    lines = []
    for args in (["trace", "record", "--model", str(MODEL), "--prompts", str(prompts), "-o", str(tmp_path / "t.parquet")],
                 ["exec", "run", "--trace", str(trace), "--system", "gpu-lru"],
                 ["exec", "generate", "--model", str(MODEL), "--prompts", str(prompts), "--system", "gpu-lru"]):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        lines.append(r.stderr.strip().splitlines()[-1])
    assert len(set(lines)) == 1 and "pip install" in lines[0], lines


def test_trace_info_escapes_terminal_codes(tmp_path):
    model = ModelSpec(name="evil\x1b[2J\x1b]0;owned\x07", family="test", num_layers=1, moe_layers=(0,),
                      num_experts=4, top_k=2, hidden_size=8, expert_intermediate_size=8, vocab_size=8,
                      attention=AttentionSpec(kind="gqa", num_heads=1, num_kv_heads=1, head_dim=8))
    path = tmp_path / "evil.parquet"
    with TraceWriter(path, model, provenance={"source": "x\x1b[31mred", "command": "rm -rf \x1b[8m"}) as w:
        w.write(seq_id=0, phase="decode", pos=0, layer=0, experts=np.array([[0, 1]]),
                weights=np.array([[0.5, 0.5]], np.float32))
    r = dali("trace", "info", path)
    assert r.exit_code == 0 and "\x1b" not in r.output and "\x07" not in r.output
    assert "evil\\x1b[2J" in r.output and "x\\x1b[31mred" in r.output
