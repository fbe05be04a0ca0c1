"""Trace format v1: round trips, streaming, partial files and every kind of bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import random_rows, tiny_model
from dali_sim.trace import PredictorInfo, SequenceInfo, TraceError, TraceWriter, read_meta, read_trace
from dali_sim.trace.reader import Needs, fixed_list_to_numpy
from dali_sim.trace.schema import META_KEY


def write_trace(path, model, rows, **kw):
    with TraceWriter(path, model, **kw) as w:
        w.write(**rows)
    return path


def test_round_trip_all_columns(tmp_path, tiny):
    rows = random_rows(tiny, seqs=3, tokens=6)
    n = len(rows["seq_id"])
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(n, tiny.num_experts)).astype(np.float32)
    la = rng.normal(size=(n, tiny.num_experts)).astype(np.float32)
    la[rows["layer"] == tiny.moe_layers[-1]] = np.nan  # no target layer after the last one
    seqs = [SequenceInfo(seq_id=i, name=f"s{i}", prompt_tokens=3, generated_tokens=3) for i in range(3)]
    path = tmp_path / "t.parquet"
    with TraceWriter(path, tiny, router_logits=True, predictors=[PredictorInfo("next-gate")],
                     sequences=seqs, row_group_size=7, provenance={"source": "test"}) as w:
        # several write calls of odd sizes: the streaming path
        for start in range(0, n, 10):
            sl = slice(start, start + 10)
            w.write(**{k: v[sl] for k, v in rows.items()}, router_logits=logits[sl],
                    lookahead={"next-gate": la[sl]})
    t = read_trace(path)
    assert len(t) == n
    np.testing.assert_array_equal(t.seq_id, rows["seq_id"])
    np.testing.assert_array_equal(t.pos, rows["pos"])
    np.testing.assert_array_equal(t.layer, rows["layer"])
    np.testing.assert_array_equal(t.phase, rows["phase"])
    np.testing.assert_array_equal(t.experts, rows["experts"])
    np.testing.assert_array_equal(t.weights, rows["weights"])
    np.testing.assert_array_equal(t.router_logits, logits)
    np.testing.assert_array_equal(t.lookahead("next-gate"), la)  # NaN rows equal NaN rows
    assert t.meta.sequences == seqs
    assert t.meta.model == tiny
    assert t.meta.provenance == {"source": "test"}
    assert pq.read_metadata(path).num_row_groups == -(-n // 7)
    df = t.to_pandas()
    assert list(df["phase"].unique()) == ["prefill", "decode"]
    with pytest.raises(TraceError, match="no lookahead column 'residual'.*dali trace record"):
        t.lookahead("residual")


def _with_lookahead(tmp_path, tiny):
    """A trace whose last MoE layer's lookahead rows have no prediction (all NaN), and those logits."""
    rows = random_rows(tiny, seqs=2, tokens=4)
    la = np.random.default_rng(2).normal(size=(len(rows["seq_id"]), tiny.num_experts)).astype(np.float32)
    la[rows["layer"] == tiny.moe_layers[-1]] = np.nan
    path = write_trace(tmp_path / "t.parquet", tiny, {**rows, "lookahead": {"next-gate": la}},
                       predictors=[PredictorInfo("next-gate")])
    return path, la


def test_rows_without_a_prediction_are_written_as_nan_rows_not_nulls(tmp_path, tiny):
    path, la = _with_lookahead(tmp_path, tiny)
    col = pq.read_table(path).column("lookahead:next-gate")
    assert col.null_count == 0  # pyarrow < 26 reads it back (apache/arrow#35692)
    none = np.isnan(la).all(axis=1)
    assert none.any() and np.isnan(fixed_list_to_numpy(col, tiny.num_experts)[none]).all()


@pytest.mark.skipif(int(pa.__version__.split(".")[0]) < 26, reason="pyarrow < 26 cannot read null fixed-size-list rows")
def test_files_with_null_lookahead_rows_read_as_nan_rows(tmp_path, tiny):
    """Traces written before the NaN rows hold Arrow nulls there: both readers return the same NaN rows, and
    the checksums (taken over NaN rows) still verify."""
    path, la = _with_lookahead(tmp_path, tiny)
    table = pq.read_table(path)
    footer = {k: v for k, v in pq.read_metadata(path).metadata.items() if k != b"ARROW:schema"}  # meta, checksums
    i = table.schema.get_field_index("lookahead:next-gate")
    col = table.column(i).combine_chunks()
    none = np.isnan(la).all(axis=1)
    old = tmp_path / "old.parquet"
    pq.write_table(table.set_column(i, table.schema.field(i), pa.FixedSizeListArray.from_arrays(
        col.values, col.type.list_size, mask=pa.array(none))).replace_schema_metadata(footer), old)
    assert pq.read_table(old).column(i).null_count == none.sum() > 0
    np.testing.assert_array_equal(read_trace(old).lookahead("next-gate"), la)
    streamed = read_trace(old, needs=Needs(predictors=("next-gate",)))
    np.testing.assert_array_equal(streamed.predicted_top_k("next-gate"),
                                  read_trace(path, needs=Needs(predictors=("next-gate",))).predicted_top_k("next-gate"))


def test_a_pyarrow_that_cannot_read_null_rows_is_named(tmp_path, tiny, monkeypatch):
    path, _ = _with_lookahead(tmp_path, tiny)

    def fails(*args, **kwargs):  # what pyarrow < 26 raises on a file with null fixed-size-list rows
        raise pa.ArrowInvalid("Expected all lists to be of size=4 but index 3 had size=0")

    monkeypatch.setattr(pq, "read_table", fails)
    with pytest.raises(TraceError, match=r"t\.parquet: this pyarrow \(.*\) cannot read the trace's null lookahead "
                                         r"rows .*35692.*pyarrow>=26") as err:
        read_trace(path)
    assert "\n" not in str(err.value)


def test_same_input_same_bytes(tmp_path, tiny):
    rows = random_rows(tiny, 2, 4)
    a = write_trace(tmp_path / "a.parquet", tiny, rows, provenance={"source": "x"})
    b = write_trace(tmp_path / "b.parquet", tiny, rows, provenance={"source": "x"})
    assert a.read_bytes() == b.read_bytes()


def test_hidden_states_sidecar(tmp_path, tiny):
    rows = random_rows(tiny, 1, 2)
    hidden = np.arange(2 * 8, dtype=np.float32).reshape(2, 8)
    path = tmp_path / "h.parquet"
    with TraceWriter(path, tiny, hidden_dim=8) as w:
        w.write(**rows)
        w.write_hidden(seq_id=0, pos=np.array([0, 1]), layer=0, hidden=hidden)
    t = read_trace(path)
    assert t.meta.hidden_states.file == "h.hidden.parquet"
    assert "hidden" not in t.table.column_names  # beside the table, not in every row
    keys, h = t.hidden_states()
    assert keys.to_dict("list") == {"seq_id": [0, 0], "pos": [0, 1], "layer": [0, 0]}
    np.testing.assert_array_equal(h, hidden.astype(np.float16))


def test_interrupted_writer_leaves_readable_partial(tmp_path, tiny):
    rows = random_rows(tiny, 2, 4)
    path = tmp_path / "p.parquet"
    with pytest.raises(RuntimeError):
        with TraceWriter(path, tiny, row_group_size=5) as w:
            w.write(**{k: v[:9] for k, v in rows.items()})
            raise RuntimeError("model crashed")
    assert not path.exists()  # never looks complete
    partial = tmp_path / "p.parquet.partial"
    assert partial.exists()
    with pytest.raises(TraceError, match="no such file; a partial trace exists"):
        read_trace(path)
    with pytest.raises(TraceError, match=r"partial trace \(writer stopped: RuntimeError: model crashed\)"):
        read_trace(partial)
    t = read_trace(partial, allow_partial=True)  # 9 rows: the last token lacks a layer, tolerated
    assert len(t) == 9 and t.meta.status == "partial"
    np.testing.assert_array_equal(t.experts, rows["experts"][:9])


def test_killed_writer_is_reported_as_truncated(tmp_path, tiny):
    rows = random_rows(tiny, 2, 4)
    path = tmp_path / "k.parquet"
    w = TraceWriter(path, tiny, row_group_size=4)
    w.write(**rows)  # row groups are on disk (in the writer's temporary file), the footer is not
    [tmp] = tmp_path.glob(".k.parquet.*.partial")
    shutil.copy(tmp, tmp_path / "killed.parquet")
    w.close()
    with pytest.raises(TraceError, match="killed.parquet: not a readable Parquet file"):
        read_trace(tmp_path / "killed.parquet")


def test_truncated_and_garbage_files(tmp_path, tiny):
    good = write_trace(tmp_path / "g.parquet", tiny, random_rows(tiny, 2, 4))
    data = good.read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="cut.parquet: not a readable Parquet file"):
        read_trace(tmp_path / "cut.parquet")
    (tmp_path / "junk.parquet").write_text("hello")
    with pytest.raises(TraceError, match="junk.parquet: not a readable Parquet file"):
        read_trace(tmp_path / "junk.parquet")
    pq.write_table(pa.table({"x": [1]}), tmp_path / "plain.parquet")
    with pytest.raises(TraceError, match="plain.parquet: not a dali trace"):
        read_trace(tmp_path / "plain.parquet")


# ---- files that bypass the writer: the reader must catch them -----------------------------------
def rewrite(tmp_path, tiny, mutate_table=None, mutate_meta=None, rows=None):
    """A valid trace, then its table and/or metadata changed and written with plain pyarrow."""
    src = write_trace(tmp_path / "src.parquet", tiny, rows or random_rows(tiny, 2, 4))
    table = pq.read_table(src)
    meta = json.loads(pq.read_metadata(src).metadata[META_KEY.encode()])
    if mutate_table:
        table = mutate_table(table)
    meta["num_rows"] = table.num_rows
    if mutate_meta:
        mutate_meta(meta)
    out = tmp_path / "bad.parquet"
    pq.write_table(table.replace_schema_metadata({META_KEY: json.dumps(meta)}), out)
    return out


def set_column(table, name, values, width=None):
    arr = np.asarray(values)
    if width:
        col = pa.FixedSizeListArray.from_arrays(pa.array(arr.reshape(-1), type=table.schema.field(name).type.value_type), width)
    else:
        col = pa.array(arr, type=table.schema.field(name).type)
    return table.set_column(table.schema.get_field_index(name), name, col)


def test_reader_reports_out_of_range_id_row(tmp_path, tiny):
    rows = random_rows(tiny, 2, 4)
    experts = rows["experts"].copy()
    experts[13, 1] = 4  # num_experts = 4
    path = rewrite(tmp_path, tiny, lambda t: set_column(t, "experts", experts, 2))
    s, p, l = rows["seq_id"][13], rows["pos"][13], rows["layer"][13]
    with pytest.raises(TraceError, match=rf"bad.parquet: row 13 \(seq_id={s}, phase=\w+, pos={p}, layer={l}\): "
                                         r"expert id out of range 0..3"):
        read_trace(path)


def test_reader_reports_first_of_several_problems(tmp_path, tiny):
    rows = random_rows(tiny, 2, 4)
    experts = rows["experts"].copy()
    weights = rows["weights"].copy()
    experts[20] = [1, 1]  # duplicate ids
    weights[7, 0] = np.inf  # earlier row: this one is reported
    path = rewrite(tmp_path, tiny, lambda t: set_column(set_column(t, "experts", experts, 2), "weights", weights, 2))
    with pytest.raises(TraceError, match=r"row 7 .*gate weight is not finite"):
        read_trace(path)
    weights[7, 0] = 0.5
    path = rewrite(tmp_path, tiny, lambda t: set_column(set_column(t, "experts", experts, 2), "weights", weights, 2))
    with pytest.raises(TraceError, match=r"row 20 .*duplicate expert id within the row"):
        read_trace(path)


def test_reader_reports_missing_layer(tmp_path, tiny):
    # drop row 10 (seq 0, pos 3, layer 1): that token has 2 of 3 layers
    path = rewrite(tmp_path, tiny, lambda t: pa.concat_tables([t.slice(0, 10), t.slice(11)]))
    with pytest.raises(TraceError, match=r"row 9 \(seq_id=0, phase=decode, pos=3, layer=0\): token has 2 of 3 "
                                         r"MoE layers; missing layers \[1\]"):
        read_trace(path)


def test_reader_reports_duplicate_row(tmp_path, tiny):
    path = rewrite(tmp_path, tiny, lambda t: pa.concat_tables([t, t.slice(5, 1)]))
    with pytest.raises(TraceError, match=r"row 24 .*duplicate of row 5"):
        read_trace(path)


def test_reader_reports_prefill_after_decode(tmp_path, tiny):
    rows = random_rows(tiny, 1, 4)
    rows["phase"] = np.where(rows["pos"] == 3, 0, rows["phase"])  # pos 2 decode, pos 3 prefill
    rows["phase"] = np.where(rows["pos"] == 2, 1, rows["phase"])
    path = tmp_path / "order.parquet"
    with pytest.raises(TraceError, match=r"pos=3, layer=0\): prefill position after decode position 2"):
        read_trace(write_trace(path, tiny, rows))


def test_reader_rejects_layer_not_moe(tmp_path):
    model = tiny_model(num_layers=4, moe_layers=(1, 3))
    rows = random_rows(model, 1, 2)
    layer = rows["layer"].copy()
    layer[2] = 2
    path = rewrite(tmp_path, model, lambda t: set_column(t, "layer", layer), rows=rows)
    with pytest.raises(TraceError, match=r"row 2 .*layer=2\): layer is not an MoE layer of tiny-moe \[1, 3\]"):
        read_trace(path)


def test_reader_rejects_unknown_schema_version(tmp_path, tiny):
    path = rewrite(tmp_path, tiny, mutate_meta=lambda m: m.update(schema_version=99))
    with pytest.raises(TraceError, match="unknown trace schema version 99"):
        read_trace(path)
    with pytest.raises(TraceError, match="unknown trace schema version 99"):
        read_meta(path)


def test_reader_rejects_wrong_types_and_missing_columns(tmp_path, tiny):
    path = rewrite(tmp_path, tiny, lambda t: t.drop_columns(["weights"]))
    with pytest.raises(TraceError, match="missing column 'weights'"):
        read_trace(path)
    path = rewrite(tmp_path, tiny, lambda t: t.set_column(2, "pos", pa.array(t.column("pos").to_numpy().astype(float))))
    with pytest.raises(TraceError, match="column 'pos' has type double, expected int32"):
        read_trace(path)
    path = rewrite(tmp_path, tiny, mutate_meta=lambda m: m.update(num_rows=3))
    with pytest.raises(TraceError, match="rows but the metadata says"):
        read_trace(path)


def test_writer_rejects_bad_rows_immediately(tmp_path, tiny):
    rows = random_rows(tiny, 1, 2)
    rows["experts"] = rows["experts"].copy()
    rows["experts"][4, 0] = -1
    with pytest.raises(TraceError, match=r"row 4 .*expert id out of range"):
        with TraceWriter(tmp_path / "w.parquet", tiny) as w:
            w.write(**rows)
    assert not (tmp_path / "w.parquet").exists()
    with pytest.raises(ValueError, match="phase must be one of"):
        TraceWriter(tmp_path / "x.parquet", tiny).write(**(random_rows(tiny, 1, 2) | {"phase": "generate"}))
    with pytest.raises(ValueError, match="not declared as predictors"):
        TraceWriter(tmp_path / "y.parquet", tiny).write(**random_rows(tiny, 1, 2), lookahead={"oracle": None})


def test_sorted_view(tmp_path, tiny):
    rows = random_rows(tiny, 2, 3)
    perm = np.random.default_rng(3).permutation(len(rows["seq_id"]))
    t = read_trace(write_trace(tmp_path / "s.parquet", tiny, {k: v[perm] for k, v in rows.items()}))
    s = t.sorted()
    np.testing.assert_array_equal(s.experts, rows["experts"])
    np.testing.assert_array_equal(s.phase, rows["phase"])
