"""Nothing silently wrong: every field of a trace's metadata is checked for type and range when it is
loaded, and the error names the field (item 4 of the field-readiness issue)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from conftest import random_rows, tiny_model
from dali_sim.cli.main import cli
from dali_sim.trace import TraceError, TraceWriter, read_meta, read_trace
from dali_sim.trace.schema import META_KEY


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("meta") / "good.parquet"
    model = tiny_model()
    with TraceWriter(path, model) as w:
        w.write(**random_rows(model, 2, 4))
    return path


def with_meta(good: Path, tmp_path: Path, change) -> Path:
    """``good`` with its metadata JSON changed by ``change(dict)`` (no checksum record, as an older dali
    or a hand-edited file would have: the field checks must catch it on their own)."""
    table = pq.read_table(good)
    meta = json.loads(pq.read_metadata(good).metadata[META_KEY.encode()])
    change(meta)
    out = tmp_path / "changed.parquet"
    pq.write_table(table.replace_schema_metadata({META_KEY: json.dumps(meta)}), out)
    return out


def refused(path: Path, field: str) -> str:
    with pytest.raises(TraceError) as err:
        read_meta(path)
    msg = str(err.value)
    assert str(path) in msg and field in msg, msg
    r = CliRunner().invoke(cli, ["trace", "validate", str(path)])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and field in r.output, r.output
    return msg


def _set(path: str, value):
    def change(meta):
        *parents, last = path.split(".")
        d = meta
        for p in parents:
            d = d[p]
        d[last] = value
    return change


def test_negative_bytes_per_param_is_refused(good, tmp_path):
    refused(with_meta(good, tmp_path, _set("model.precision.bytes_per_param", -2)), "bytes_per_param")


def test_top_k_beyond_int8_ranks_is_refused(good, tmp_path):
    def change(meta):
        meta["model"]["top_k"] = 200
        meta["model"]["num_experts"] = 256
    refused(with_meta(good, tmp_path, change), "top_k")


def test_huge_expert_count_is_refused(good, tmp_path):
    refused(with_meta(good, tmp_path, _set("model.num_experts", 400_000_000)), "num_experts")


def test_bogus_status_is_refused(good, tmp_path):
    refused(with_meta(good, tmp_path, _set("status", "bogus")), "status")


def test_predictors_as_a_list_is_refused(good, tmp_path):
    refused(with_meta(good, tmp_path, _set("predictors", ["next-gate"])), "predictors")


def test_precision_as_a_string_is_refused(good, tmp_path):
    refused(with_meta(good, tmp_path, _set("model.precision", "bf16")), "model.precision")


@pytest.mark.parametrize("field, value", [
    ("model.num_layers", "3"), ("model.hidden_size", 8.5), ("model.moe_layers", "all"), ("model.family", 3),
    ("model.norm_topk_prob", "yes"), ("model.attention.num_heads", -1), ("has_weights", 1), ("num_rows", -5),
    ("weights_note", None), ("sequences", {"0": {}}), ("provenance", "x"), ("hidden_states", {"file": "x"}),
    ("model.dense_intermediate_size", -4),
])
def test_mistyped_metadata_field_is_refused(good, tmp_path, field, value):
    refused(with_meta(good, tmp_path, _set(field, value)), field.split(".")[-1])


def test_bad_sequence_and_predictor_entries_are_refused(good, tmp_path):
    refused(with_meta(good, tmp_path, _set("sequences", [{"seq_id": -1}])), "seq_id")
    refused(with_meta(good, tmp_path, _set("sequences", [{"seq_id": 0, "prompt_tokens": "4"}])), "prompt_tokens")
    refused(with_meta(good, tmp_path, _set("predictors", {"a": {"name": "b", "target_offset": 1}})), "predictors.a")
    refused(with_meta(good, tmp_path, _set("predictors", {"a": {"name": "a", "target_offset": 0}})), "target_offset")


def test_hidden_state_file_outside_the_trace_folder_is_refused(good, tmp_path):
    refused(with_meta(good, tmp_path, _set("hidden_states", {"file": "../../etc/passwd", "dim": 8})), "hidden_states")


def test_metadata_that_is_not_utf8_names_the_file(good, tmp_path):
    table = pq.read_table(good)
    out = tmp_path / "latin1.parquet"
    raw = pq.read_metadata(good).metadata[META_KEY.encode()].replace(b'"source"', b'"s\xe9urce"')
    pq.write_table(table.replace_schema_metadata({META_KEY.encode(): raw}), out)
    refused(out, "UTF-8")


def test_good_metadata_still_reads(good):
    assert len(read_trace(good)) == 2 * 4 * 3
