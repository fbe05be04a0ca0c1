"""Reading only what a run needs (``read_trace(needs=...)``) and building the workload a block of steps at a
time: the same arrays, the same workload and the same errors as a full read, with bounded memory."""

from __future__ import annotations

import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO, random_rows
from dali_sim.trace import PredictorInfo, TraceError, read_trace
from dali_sim.trace.checksum import CHECKSUM_KEY
from dali_sim.trace.lookahead import pack_top_k, predicted_top_k
from dali_sim.trace.reader import Needs
from dali_sim.trace.synth import SynthConfig, synthesize
from dali_sim.workload import builder
from dali_sim.workload.builder import Workload, WorkloadConfig, _sparse_counts
from test_trace_format import rewrite, set_column, write_trace

sys.path.insert(0, str(REPO / "benchmarks"))
import corruption  # noqa: E402  (the flip experiment, shared with the benchmark)

LOOKS = ("residual", "next-gate", "gate2")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """Jittered lengths, three lookahead columns."""
    path = tmp_path_factory.mktemp("needs") / "s.parquet"
    synthesize(SynthConfig("olmoe-1b-7b", sequences=5, prompt_len=12, gen_len=20, prompt_len_jitter=0.5,
                           gen_len_jitter=0.5, seed=4, lookahead=("residual=0.9", "next-gate=0.7", "gate2=0.6@2")),
               path, progress=False)
    return path


@pytest.fixture(scope="module")
def shuffled(synthetic):
    """The same rows in a random order, in several row groups (the checksum record, over the values in file
    order, is left out: such files read without it)."""
    table = pq.read_table(synthetic)
    perm = np.random.default_rng(0).permutation(table.num_rows)
    meta = {k: v for k, v in pq.read_metadata(synthetic).metadata.items() if k != CHECKSUM_KEY.encode()}
    path = synthetic.with_name("shuffled.parquet")
    pq.write_table(table.take(pa.array(perm)).replace_schema_metadata(meta), path, row_group_size=500)
    return path


def reference_workload_counts(trace, config, predictors):
    """The per (step, layer) counts as the builder made them before blocks: one grouping over all rows
    of the sorted trace, predictions ranked from the whole logits column."""
    w = Workload(trace, config)  # for the step of every token
    t = trace.sorted()
    L, k, E = w.num_layers, w.top_k, w.num_experts
    row_step = np.repeat(w._token_step, L)
    layer = t.layer_index.astype(np.int64)
    actual = _sparse_counts(np.repeat(row_step, k), np.repeat(layer, k), t.experts.reshape(-1),
                            np.tile(np.arange(k, dtype=np.int8), len(t)), w.num_steps, L, E)
    predicted = {}
    for name in predictors:
        logits = t.lookahead(name)
        off = t.meta.predictors[name].target_offset
        has = ~np.isnan(logits).all(axis=1) & (layer + off < L)
        top = predicted_top_k(logits[has], k)
        predicted[name] = _sparse_counts(np.repeat(row_step[has], k), np.repeat(layer[has] + off, k), top.reshape(-1),
                                         np.tile(np.arange(k, dtype=np.int8), len(top)), w.num_steps, L, E)
    return actual, predicted


def same_counts(a, b) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("ptr", "expert", "count", "rank"))


@pytest.mark.parametrize("name", ["synthetic", "shuffled"])
def test_needed_columns_read_back_as_a_full_read(request, name):
    path = request.getfixturevalue(name)
    full = read_trace(path)
    part = read_trace(path, needs=Needs(predictors=("residual", "gate2")))
    assert (full.row_order is None) == (name == "synthetic")
    for col in ("seq_id", "phase", "pos", "layer", "experts"):
        np.testing.assert_array_equal(getattr(part, col), getattr(full, col))
    for name in ("residual", "gate2"):
        np.testing.assert_array_equal(part.predicted_top_k(name), pack_top_k(full.lookahead(name), full.top_k))
    assert part.table.column_names == ["seq_id", "phase", "pos", "layer", "experts"]
    with pytest.raises(TraceError, match="column 'weights' was not read"):
        part.weights
    with pytest.raises(TraceError, match="column 'lookahead:residual' was not read"):
        part.lookahead("residual")
    with pytest.raises(TraceError, match="no lookahead column 'gate9'"):
        read_trace(path, needs=Needs(predictors=("gate9",)))
    with_weights = read_trace(path, needs=Needs(weights=True))
    np.testing.assert_array_equal(with_weights.weights, full.weights)


@pytest.mark.parametrize("batch,chunk", [(1, 0), (3, 0), (2, 5), (8, 4)])
def test_block_built_workload_equals_the_one_pass_build(shuffled, monkeypatch, batch, chunk):
    config = WorkloadConfig(batch, chunk)
    full = read_trace(shuffled)
    actual, predicted = reference_workload_counts(full, config, LOOKS)
    part = read_trace(shuffled, needs=Needs(predictors=LOOKS))
    monkeypatch.setattr(builder, "BUILD_ROWS", 50)  # many blocks, some of a single step
    for trace in (full, part):
        w = Workload(trace, config, predictors=LOOKS)
        assert same_counts(w.actual, actual)
        assert all(same_counts(w.predicted[n], predicted[n]) for n in LOOKS)
        seg = np.repeat(np.arange(w.num_steps * w.num_layers), np.diff(actual.ptr))
        freq = np.zeros((w.num_layers, w.num_experts), np.int64)
        np.add.at(freq, (seg % w.num_layers, actual.expert.astype(np.int64)), actual.count)
        np.testing.assert_array_equal(w.frequencies(), freq)


def test_a_shared_workload_is_read_only_and_restricted_per_run(synthetic):
    trace = read_trace(synthetic, needs=Needs(predictors=LOOKS))
    w = Workload(trace, WorkloadConfig(2), predictors=LOOKS)
    with pytest.raises(ValueError, match="read-only"):
        w.actual.count[0] = 7
    with pytest.raises(ValueError, match="read-only"):
        w.step_tokens[0] = 0
    view = w.with_predictors(("gate2",))
    assert tuple(view.predicted) == ("gate2",) and view.actual is w.actual and tuple(w.predicted) == LOOKS
    with pytest.raises(ValueError, match=r"\['gate3'\] were not loaded"):
        w.with_predictors(("gate3",))


def test_a_split_trace_keeps_its_packed_predictions_and_a_shared_workload_must_be_of_the_evaluated_part(synthetic):
    """The profiling split of a trace read with ``needs`` keeps each kept row's packed predicted top-k; a
    run given a workload of the whole trace (not of its evaluated sequences) is refused."""
    from dali_sim.sim.simulate import simulate
    from dali_sim.workload.profiling import apply_profile

    full = read_trace(synthetic)
    profiled = apply_profile(read_trace(synthetic, needs=Needs(predictors=LOOKS)))
    keep = np.isin(full.seq_id, np.unique(profiled.evaluated.seq_id))
    assert 0 < keep.sum() < len(full)
    for name in LOOKS:
        np.testing.assert_array_equal(profiled.evaluated.predicted_top_k(name), full.predicted_top_k(name)[keep])
    shared = Workload(profiled.evaluated, WorkloadConfig(2), predictors=LOOKS)
    a = simulate(profiled.evaluated, "dali", batch_size=2, profiling=profiled, workload=shared)
    b = simulate(synthetic, "dali", batch_size=2)
    assert a.summary["hit_rate"] == b.summary["hit_rate"] and a.summary["makespan_s"] == b.summary["makespan_s"]
    whole = Workload(full, WorkloadConfig(2), predictors=LOOKS)
    with pytest.raises(ValueError, match="not for the 3 evaluated sequences"):
        simulate(profiled.evaluated, "dali", batch_size=2, profiling=profiled, workload=whole)


def test_routing_of_the_steps_follows_the_file_rows(shuffled):
    """dali_exec reads the routing of each step's tokens: the same through the row order as through a
    sorted copy of the trace."""
    full = read_trace(shuffled)
    w = Workload(full, WorkloadConfig(3))
    t = full.sorted()
    for step in (0, 1, w.num_steps - 1):
        rows = w.step_token_ids(step) * w.num_layers + 2
        ids, weights = w.routing(step, 2)
        np.testing.assert_array_equal(ids, t.experts[rows])
        np.testing.assert_array_equal(weights, t.weights[rows])


def test_needed_read_of_many_row_groups_and_blocks(tmp_path, tiny, monkeypatch):
    from dali_sim.trace import reader

    rows = random_rows(tiny, seqs=3, tokens=10)
    rng = np.random.default_rng(2)
    la = rng.normal(size=(len(rows["seq_id"]), tiny.num_experts)).astype(np.float32)
    la[rows["layer"] == tiny.moe_layers[-1]] = np.nan
    path = write_trace(tmp_path / "g.parquet", tiny, {**rows, "lookahead": {"next": la}},
                       predictors=[PredictorInfo("next")], row_group_size=7)
    monkeypatch.setattr(reader, "READ_ROWS", 5)
    t = read_trace(path, needs=Needs(weights=True, predictors=("next",)))
    np.testing.assert_array_equal(t.experts, rows["experts"])
    np.testing.assert_array_equal(t.weights, rows["weights"])
    np.testing.assert_array_equal(t.predicted_top_k("next"), pack_top_k(la, tiny.top_k))
    assert (t.predicted_top_k("next")[rows["layer"] == tiny.moe_layers[-1]] == -1).all()


def bad_files(tmp_path, tiny):
    rows = random_rows(tiny, 2, 4)
    experts = rows["experts"].copy()
    experts[13, 1] = 4
    weights = rows["weights"].copy()
    weights[7, 0] = np.inf
    yield rewrite(tmp_path, tiny, lambda t: set_column(t, "experts", experts, 2))
    yield rewrite(tmp_path, tiny, lambda t: set_column(t, "weights", weights, 2))
    yield rewrite(tmp_path, tiny, lambda t: pa.concat_tables([t.slice(0, 10), t.slice(11)]))
    yield rewrite(tmp_path, tiny, lambda t: pa.concat_tables([t, t.slice(5, 1)]))
    yield rewrite(tmp_path, tiny, mutate_meta=lambda m: m.update(schema_version=99))


def test_bad_files_give_the_full_reads_error(tmp_path, tiny):
    for path in bad_files(tmp_path, tiny):
        with pytest.raises(TraceError) as full:
            read_trace(path)
        with pytest.raises(TraceError) as part:
            read_trace(path, needs=Needs(weights=True))
        assert str(part.value) == str(full.value)


def test_byte_flips_are_rejected_or_harmless_when_reading_what_is_needed(synthetic):
    def content(p):
        t = read_trace(p, needs=Needs(weights=True, predictors=LOOKS))
        return t.meta.to_json(), [t.seq_id, t.phase, t.pos, t.layer, t.experts, t.weights,
                                  *(t.predicted_top_k(n) for n in LOOKS)]

    counts = corruption.run(synthetic, 80, 3, content)
    assert counts["silently_different"] == 0 and counts["crashed"] == 0, counts
    assert counts["rejected"] >= 0.9 * 80, counts
