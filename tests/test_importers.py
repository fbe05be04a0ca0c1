"""Importers against the real files in ../shared/validation-traces, and their bad-input errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from dali_sim.cli.main import cli
from dali_sim.registry import UnknownNameError
from dali_sim.trace import read_trace
from dali_sim.trace.importers import import_trace

GPT = "GPT-OSS-MoE-ExpertFingerprinting/examples"
SWITCH = "stratamoe-lab/router-trace.v2.json"


@pytest.fixture(scope="module")
def gpt_trace(tmp_path_factory):
    from conftest import SHARED

    if not SHARED.exists():
        pytest.skip("../shared is not present")
    out = tmp_path_factory.mktemp("gpt") / "gpt.parquet"
    return read_trace(import_trace("gpt-oss-fingerprint", [SHARED / GPT], out))


def test_gpt_oss_counts_and_positions(gpt_trace, shared):
    t = gpt_trace
    files = sorted((shared / GPT).glob("*.json"))
    assert len(files) == 12 == t.num_sequences
    assert len(t) == 2763 * 24  # README: 2,763 decode tokens, 24 layers each
    assert set(t.phase.tolist()) == {1}  # decode only
    for seq in t.meta.sequences:
        doc = json.loads(files[seq.seq_id].read_text())
        prompt = len(doc["full_text"]) - len(doc["generated_only"])
        assert seq.name == files[seq.seq_id].stem
        assert seq.prompt_tokens == prompt and seq.generated_tokens == len(doc["generated_only"])
        pos = np.unique(t.pos[t.seq_id == seq.seq_id])
        np.testing.assert_array_equal(pos, np.arange(prompt, prompt + len(doc["generated_only"]) - 1))


def test_gpt_oss_ids_and_weights_match_source(gpt_trace, shared):
    t = gpt_trace
    seq = next(s for s in t.meta.sequences if s.name == "mmlu_test_machine_learning_True_False")
    assert seq.prompt_tokens == 162 and seq.attrs["category"] == "machine_learning"
    doc = json.loads((shared / GPT / f"{seq.name}.json").read_text())
    mask = t.seq_id == seq.seq_id
    experts, weights, pos, layer = t.experts[mask], t.weights[mask], t.pos[mask], t.layer[mask]
    first = (pos == 162) & (layer == 0)
    assert experts[first].tolist() == [[31, 21, 22, 6]]  # checked by eye in the JSON
    np.testing.assert_allclose(weights[first][0], [0.5, 0.1806640625, 0.16796875, 0.1513671875])
    # every (token, layer) of this file, against the JSON
    for i, entry in enumerate(doc["router_data"]):
        (key, layers), = entry.items()
        p = int(key.split("_")[1])
        for name, rec in layers.items():
            row = np.flatnonzero((pos == p) & (layer == int(name.split("_")[1])))
            assert row.size == 1
            assert experts[row[0]].tolist() == rec["selected_experts"]
            np.testing.assert_array_equal(weights[row[0]], np.float32(rec["selected_probs"]))
    np.testing.assert_allclose(t.weights.sum(axis=1), 1.0, atol=0.004)


def test_switch_router_v2(tmp_path, shared):
    t = read_trace(import_trace("switch-router-v2", [shared / SWITCH], tmp_path / "s.parquet"))
    doc = json.loads((shared / SWITCH).read_text())
    meta = json.loads((shared / "stratamoe-lab/capture-metadata.json").read_text())
    assert t.model.name == "switch-base-8" and t.weights is None
    assert len(t) == 215 * 6 and t.num_sequences == 10 and set(t.phase.tolist()) == {0}
    assert [s.name for s in t.meta.sequences] == [s["id"] for s in meta["prompt_spans"]]
    assert [s.prompt_tokens for s in t.meta.sequences] == [s["non_padding_tokens"] for s in meta["prompt_spans"]]
    s = t.sorted()
    # concatenated token order of the source = (seq, pos) order; layers 1, 3, ..., 11
    np.testing.assert_array_equal(s.experts[:, 0].reshape(215, 6), np.array(doc["selections"])[:, :, 0])
    assert s.layer[:6].tolist() == [1, 3, 5, 7, 9, 11]
    second = s.seq_id == 1
    assert s.pos[second].min() == 0 and s.pos[second].max() == 25  # security-02: 26 tokens


def test_cli_import_and_validate(tmp_path, shared):
    out = tmp_path / "cli.parquet"
    r = CliRunner().invoke(cli, ["trace", "import", "--format", "switch-router-v2", str(shared / SWITCH), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "1290 rows, 10 sequences" in r.output
    r = CliRunner().invoke(cli, ["trace", "validate", str(out)])
    assert r.exit_code == 0 and "ok (1290 rows" in r.output
    assert "dali trace import --format switch-router-v2" in read_trace(out).meta.provenance["command"]


# ---- bad inputs -----------------------------------------------------------------------------
def copy_gpt_file(shared, tmp_path, mutate):
    src = sorted((shared / GPT).glob("*.json"))[0]
    doc = json.loads(src.read_text())
    mutate(doc)
    dst = tmp_path / "one.json"
    dst.write_text(json.dumps(doc))
    return dst


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["router_data"].pop(), r"router_data has \d+ entries; expected len\(generated_only\) - 1"),
    (lambda d: d["router_data"][3].update({"token_9999": d["router_data"][3].popitem()[1]}),
     r"router_data\[3\]: key 'token_9999', expected 'token_\d+'"),
    (lambda d: list(d["router_data"][5].values())[0]["layer_7"].update(selected_experts=[1, 2, 3, 32]),
     r"router_data\[5\] layer_7: expert id out of range 0..31"),
    (lambda d: list(d["router_data"][2].values())[0].pop("layer_23"), r"router_data\[2\] \(token_\d+\): expected 24 layers"),
    (lambda d: list(d["router_data"][1].values())[0]["layer_0"].update(selected_probs=[0.9, 0.9, 0.1, 0.1]),
     r"router_data\[1\] layer_0: selected_probs sum to 2.0000"),
    (lambda d: d.pop("generated_only"), r"missing field 'generated_only'"),
])
def test_gpt_oss_bad_input(shared, tmp_path, mutate, message):
    bad = copy_gpt_file(shared, tmp_path, mutate)
    with pytest.raises(ValueError, match=message):
        import_trace("gpt-oss-fingerprint", [bad], tmp_path / "x.parquet")
    assert not (tmp_path / "x.parquet").exists()


def test_truncated_json_is_named(shared, tmp_path):
    src = sorted((shared / GPT).glob("*.json"))[0]
    bad = tmp_path / "cut.json"
    bad.write_bytes(src.read_bytes()[:5000])
    with pytest.raises(ValueError, match="cut.json: not valid JSON"):
        import_trace("gpt-oss-fingerprint", [bad], tmp_path / "x.parquet")
    r = CliRunner().invoke(cli, ["trace", "import", "--format", "gpt-oss-fingerprint", str(bad), "-o", str(tmp_path / "y.parquet")])
    assert r.exit_code == 1 and r.output.startswith("Error: ") and "cut.json: not valid JSON" in r.output


def test_switch_needs_matching_metadata(shared, tmp_path):
    shutil.copy(shared / SWITCH, tmp_path / "router-trace.v2.json")
    with pytest.raises(ValueError, match="needs capture-metadata.json beside it"):
        import_trace("switch-router-v2", [tmp_path], tmp_path / "x.parquet")
    meta = json.loads((shared / "stratamoe-lab/capture-metadata.json").read_text())
    meta["trace_sha256"] = "0" * 64
    (tmp_path / "capture-metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="does not match router-trace.v2.json"):
        import_trace("switch-router-v2", [tmp_path], tmp_path / "x.parquet")


def test_unknown_format():
    with pytest.raises(UnknownNameError, match="unknown import format 'nope'; known: gpt-oss-fingerprint, switch-router-v2"):
        import_trace("nope", ["x"], "y")
