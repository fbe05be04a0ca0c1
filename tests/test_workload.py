"""The workload builder (dali_sim/workload/builder.py) on small hand-made traces.

Every expected number below is worked out by hand from the rows listed in the test: sequences ->
batches -> steps, the per-step token counts, context and KV reads, and the touch order of the
activated experts (descending workload, then best rank among the step's tokens, then lower id).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_model

from dali_sim.trace import TraceWriter, read_trace
from dali_sim.workload.builder import Workload, WorkloadConfig

PRE, DEC = 0, 1


def write_trace(path: Path, model, tokens) -> Path:
    """``tokens``: (seq_id, pos, phase, [experts of MoE layer 0, of layer 1, ...]) in any order."""
    with TraceWriter(path, model, provenance={"source": "hand-written", "command": "tests/test_workload.py"}) as w:
        for seq, pos, phase, per_layer in tokens:
            assert len(per_layer) == model.num_moe_layers
            for ordinal, experts in enumerate(per_layer):
                k = len(experts)
                weights = np.full((1, k), 1.0 / k, np.float32)
                w.write(seq_id=seq, phase=phase, pos=pos, layer=model.moe_layers[ordinal],
                        experts=np.array([experts]), weights=weights)
    return path


def build(tmp_path, model, tokens, batch_size=1, prefill_chunk=0, name="t.parquet") -> Workload:
    trace = read_trace(write_trace(tmp_path / name, model, tokens))
    return Workload(trace, WorkloadConfig(batch_size, prefill_chunk))


MODEL = tiny_model(num_layers=2, moe_layers=(0, 1), num_experts=4, top_k=2)

# Three sequences with prefill and decode of different lengths (routing is irrelevant here, but each
# token gets distinct experts so that per-step workloads can be checked):
#   seq 0: prefill pos 0, 1, 2;  decode pos 3, 4
#   seq 1: prefill pos 0;        decode pos 1, 2, 3
#   seq 2: prefill pos 0, 1;     no decode
# Written in a scrambled order: the builder must sort by (seq_id, pos).
MIXED = [
    (1, 2, "decode", [[0, 1], [2, 3]]),
    (0, 0, "prefill", [[0, 1], [0, 1]]),
    (0, 1, "prefill", [[0, 2], [1, 0]]),
    (2, 1, "prefill", [[3, 2], [3, 0]]),
    (0, 2, "prefill", [[1, 2], [2, 1]]),
    (0, 3, "decode", [[0, 3], [3, 2]]),
    (0, 4, "decode", [[2, 3], [0, 3]]),
    (1, 0, "prefill", [[3, 0], [1, 2]]),
    (1, 1, "decode", [[1, 3], [0, 2]]),
    (1, 3, "decode", [[2, 0], [1, 3]]),
    (2, 0, "prefill", [[2, 1], [0, 1]]),
]


def test_batch2_whole_prompt(tmp_path):
    """batch_size 2, prefill_chunk 0.

    batch 0 = seqs 0, 1; batch 1 = seq 2.
    step 0: batch 0 prefill = seq 0 pos 0,1,2 + seq 1 pos 0          -> 4 tokens
    steps 1..3: batch 0 decode, max(2, 3) = 3 steps:
        step 1 = seq 0 pos 3 + seq 1 pos 1; step 2 = seq 0 pos 4 + seq 1 pos 2; step 3 = seq 1 pos 3
    step 4: batch 1 prefill = seq 2 pos 0, 1                          -> 2 tokens
    context = mean(pos + 1) over the step's tokens:
        step 0: (1+2+3+1)/4 = 1.75; step 1: (4+2)/2 = 3; step 2: (5+3)/2 = 4; step 3: 4; step 4: (1+2)/2 = 1.5
    kv = sum over the step's sequences of the longest (pos + 1):
        step 0: 3 + 1 = 4; step 1: 4 + 2 = 6; step 2: 5 + 3 = 8; step 3: 4; step 4: 2
    """
    w = build(tmp_path, MODEL, MIXED, batch_size=2)
    assert w.num_steps == 5
    assert w.num_layers == 2 and w.num_experts == 4 and w.top_k == 2
    assert w.step_tokens.tolist() == [4, 2, 2, 1, 2]
    assert w.step_phase.tolist() == [PRE, DEC, DEC, DEC, PRE]
    assert w.step_batch.tolist() == [0, 0, 0, 0, 1]
    assert w.step_context.tolist() == [1.75, 3.0, 4.0, 4.0, 1.5]
    assert w.step_kv.tolist() == [4, 6, 8, 4, 2]
    assert w.max_batch_context == 8

    seqs = w.sequences.set_index("seq_id")
    assert seqs.index.tolist() == [0, 1, 2]
    assert seqs["batch"].tolist() == [0, 0, 1]
    assert seqs["prompt_tokens_traced"].tolist() == [3, 1, 2]
    assert seqs["decode_tokens"].tolist() == [2, 3, 0]
    assert seqs["first_prefill_step"].tolist() == [0, 0, 4]
    assert seqs["last_prefill_step"].tolist() == [0, 0, 4]
    assert seqs["first_decode_step"].tolist() == [1, 1, -1]
    assert seqs["last_decode_step"].tolist() == [2, 3, -1]
    assert w.describe() == {"steps": 5, "prefill_steps": 2, "decode_steps": 3, "batches": 2, "sequences": 3,
                            "tokens": 11}

    # step 0, layer 0: seq 0 pos 0..2 route [0,1], [0,2], [1,2]; seq 1 pos 0 routes [3,0]
    #   workloads: 0 -> 3 (best rank 0), 1 -> 2 (rank 0), 2 -> 2 (rank 1), 3 -> 1 (rank 0)
    e, c, r = w.activated(0, 0)
    assert e.tolist() == [0, 1, 2, 3] and c.tolist() == [3, 2, 2, 1] and r.tolist() == [0, 0, 1, 0]
    # step 0, layer 1: [0,1], [1,0], [2,1], [1,2] -> 1: 4 (rank 0); 0: 2 (rank 0); 2: 2 (rank 0): ties -> id
    e, c, r = w.activated(0, 1)
    assert e.tolist() == [1, 0, 2] and c.tolist() == [4, 2, 2] and r.tolist() == [0, 0, 0]
    # step 3 (seq 1 pos 3 alone): layer 0 [2, 0] -> rank order; layer 1 [1, 3]
    e, c, r = w.activated(3, 0)
    assert e.tolist() == [2, 0] and c.tolist() == [1, 1] and r.tolist() == [0, 1]
    assert w.activated(3, 1)[0].tolist() == [1, 3]
    # step 1 layer 1: seq 0 pos 3 -> [3, 2]; seq 1 pos 1 -> [0, 2]: 2 has workload 2
    e, c, r = w.activated(1, 1)
    assert e.tolist() == [2, 0, 3] and c.tolist() == [2, 1, 1] and r.tolist() == [1, 0, 0]

    # total workload per (layer, expert), summed over all 11 tokens
    freq = w.frequencies()
    assert freq.shape == (2, 4)
    assert freq.sum(axis=1).tolist() == [22, 22]  # 11 tokens x top-2
    assert freq[0].tolist() == [6, 5, 6, 5]
    assert freq[1].tolist() == [6, 6, 5, 5]


def test_batch2_prefill_chunks(tmp_path):
    """prefill_chunk 2 splits seq 0's 3-token prompt into 2 steps (pos 0,1 | pos 2); seq 1's single
    prompt token goes into the first chunk; decode follows the longest prefill.

    step 0: seq 0 pos 0,1 + seq 1 pos 0 (3 tokens; context (1+2+1)/3 = 4/3; kv 2 + 1 = 3)
    step 1: seq 0 pos 2 (1 token; context 3; kv 3)
    steps 2, 3, 4: decode as before; step 5: seq 2 prefill pos 0, 1 (one chunk of 2)
    """
    w = build(tmp_path, MODEL, MIXED, batch_size=2, prefill_chunk=2)
    assert w.num_steps == 6
    assert w.step_tokens.tolist() == [3, 1, 2, 2, 1, 2]
    assert w.step_phase.tolist() == [PRE, PRE, DEC, DEC, DEC, PRE]
    assert w.step_context.tolist() == pytest.approx([4 / 3, 3.0, 3.0, 4.0, 4.0, 1.5], abs=0, rel=1e-15)
    assert w.step_kv.tolist() == [3, 3, 6, 8, 4, 2]
    seqs = w.sequences.set_index("seq_id")
    assert seqs["first_prefill_step"].tolist() == [0, 0, 5]
    assert seqs["last_prefill_step"].tolist() == [1, 0, 5]
    assert seqs["first_decode_step"].tolist() == [2, 2, -1]
    assert seqs["last_decode_step"].tolist() == [3, 4, -1]
    # step 1 is seq 0 pos 2 alone: layer 0 routes [1, 2]
    e, c, r = w.activated(1, 0)
    assert e.tolist() == [1, 2] and c.tolist() == [1, 1] and r.tolist() == [0, 1]


def test_chunk_of_one_and_batch_of_one(tmp_path):
    """batch 1, chunk 1: every token is its own step, sequences one after another (11 steps)."""
    w = build(tmp_path, MODEL, MIXED, batch_size=1, prefill_chunk=1)
    assert w.num_steps == 11
    assert w.step_tokens.tolist() == [1] * 11
    # seq 0: pos 0..4 (3 prefill, 2 decode); seq 1: pos 0..3 (1 prefill); seq 2: pos 0, 1 (prefill)
    assert w.step_phase.tolist() == [PRE, PRE, PRE, DEC, DEC, PRE, DEC, DEC, DEC, PRE, PRE]
    assert w.step_context.tolist() == [1, 2, 3, 4, 5, 1, 2, 3, 4, 1, 2]
    assert w.step_kv.tolist() == [1, 2, 3, 4, 5, 1, 2, 3, 4, 1, 2]
    assert w.step_batch.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    # a prefill step of one token routes exactly its own top-k, in rank order
    assert w.activated(2, 1)[0].tolist() == [2, 1]
    assert w.activated(10, 0)[0].tolist() == [3, 2]


def test_batch_larger_than_trace(tmp_path):
    """batch_size 8 > 3 sequences: one batch; prefill step (6 tokens), then 3 decode steps."""
    w = build(tmp_path, MODEL, MIXED, batch_size=8)
    assert w.num_steps == 4
    assert w.step_tokens.tolist() == [6, 2, 2, 1]
    assert w.step_phase.tolist() == [PRE, DEC, DEC, DEC]
    # kv of step 0: seq 0 -> 3, seq 1 -> 1, seq 2 -> 2
    assert w.step_kv.tolist() == [6, 6, 8, 4]
    assert w.sequences["batch"].tolist() == [0, 0, 0]


def test_decode_only_like_gpt_oss(tmp_path):
    """Decode-only sequences (the prompt was not traced, positions start late), ids not contiguous.

    seq 7: decode pos 10, 11, 12; seq 3: decode pos 5; seq 9: decode pos 20, 21.
    Sorted by seq_id: 3, 7, 9. batch 2: batch 0 = {3, 7} -> 3 decode steps; batch 1 = {9} -> 2 steps.
    step 0: seq 3 pos 5 + seq 7 pos 10: context (6 + 11)/2 = 8.5, kv 6 + 11 = 17
    step 1: seq 7 pos 11: context 12, kv 12;  step 2: seq 7 pos 12: 13
    step 3: seq 9 pos 20: 21; step 4: seq 9 pos 21: 22
    """
    toks = [
        (7, 10, "decode", [[0, 1], [1, 2]]),
        (7, 11, "decode", [[0, 2], [1, 3]]),
        (7, 12, "decode", [[3, 2], [0, 1]]),
        (3, 5, "decode", [[1, 0], [2, 1]]),
        (9, 20, "decode", [[2, 3], [3, 0]]),
        (9, 21, "decode", [[3, 1], [0, 3]]),
    ]
    w = build(tmp_path, MODEL, toks, batch_size=2)
    assert w.num_steps == 5
    assert w.step_phase.tolist() == [DEC] * 5
    assert w.step_tokens.tolist() == [2, 1, 1, 1, 1]
    assert w.step_context.tolist() == [8.5, 12, 13, 21, 22]
    assert w.step_kv.tolist() == [17, 12, 13, 21, 22]
    seqs = w.sequences
    assert seqs["seq_id"].tolist() == [3, 7, 9]
    assert seqs["batch"].tolist() == [0, 0, 1]
    assert seqs["prompt_tokens_traced"].tolist() == [0, 0, 0]
    assert seqs["first_prefill_step"].tolist() == [-1, -1, -1]
    assert seqs["last_prefill_step"].tolist() == [-1, -1, -1]
    assert seqs["first_decode_step"].tolist() == [0, 0, 3]
    assert seqs["last_decode_step"].tolist() == [0, 2, 4]
    assert w.describe()["prefill_steps"] == 0
    # step 0 layer 0: seq 3 [1, 0] and seq 7 [0, 1]: both count 2, both best rank 0 -> id order
    e, c, r = w.activated(0, 0)
    assert e.tolist() == [0, 1] and c.tolist() == [2, 2] and r.tolist() == [0, 0]
    # step 0 layer 1: seq 3 [2, 1], seq 7 [1, 2]: same
    assert w.activated(0, 1)[0].tolist() == [1, 2]
    # batch 1: the same trace at batch 1 has 6 steps, seq 3 first
    w1 = build(tmp_path, MODEL, toks, batch_size=1, name="t1.parquet")
    assert w1.num_steps == 6
    assert w1.step_context.tolist() == [6, 11, 12, 13, 21, 22]
    assert w1.activated(0, 0)[0].tolist() == [1, 0]  # batch 1: touch order = rank order


def test_touch_order(tmp_path):
    """Touch order = descending workload, then best rank among the step's tokens, then lower id.

    One prefill step of 5 tokens, 6 experts, top-2. Layer 0 rows (rank 0, rank 1):
        [5, 0] [5, 2] [2, 5] [4, 0] [1, 3]
    workloads: 5 -> 3 (best rank 0); 2 -> 2 (rank 0); 0 -> 2 (rank 1); 4 -> 1 (rank 0); 1 -> 1 (rank 0);
    3 -> 1 (rank 1). Order: 5; then 2 before 0 (same workload, better rank, although 0 < 2);
    then 1 before 4 (same workload and rank: lower id); then 3.
    Layer 1 rows: [1, 0] five times: 1 and 0 both have workload 5; 1 has rank 0 -> [1, 0].
    """
    model = tiny_model(num_layers=2, moe_layers=(0, 1), num_experts=6, top_k=2)
    rows0 = [[5, 0], [5, 2], [2, 5], [4, 0], [1, 3]]
    toks = [(0, p, "prefill", [rows0[p], [1, 0]]) for p in range(5)]
    w = build(tmp_path, model, toks)
    assert w.num_steps == 1 and w.step_tokens.tolist() == [5]
    e, c, r = w.activated(0, 0)
    assert e.tolist() == [5, 2, 0, 1, 4, 3]
    assert c.tolist() == [3, 2, 2, 1, 1, 1]
    assert r.tolist() == [0, 0, 1, 0, 0, 1]
    e, c, r = w.activated(0, 1)
    assert e.tolist() == [1, 0] and c.tolist() == [5, 5] and r.tolist() == [0, 1]
    # context: (1+2+3+4+5)/5 = 3; kv: one sequence, longest context 5
    assert w.step_context.tolist() == [3.0] and w.step_kv.tolist() == [5]
    # chunk 2: steps {0,1}, {2,3}, {4}; step 1 layer 0 = [2, 5], [4, 0] -> all workload 1:
    # rank 0: 2, 4 (id order); rank 1: 0, 5 (id order)
    wc = build(tmp_path, model, toks, prefill_chunk=2, name="c.parquet")
    assert wc.num_steps == 3 and wc.step_tokens.tolist() == [2, 2, 1]
    assert wc.activated(1, 0)[0].tolist() == [2, 4, 0, 5]
    assert wc.activated(0, 0)[0].tolist() == [5, 0, 2]  # [5,0] [5,2]: 5 x2; 0 and 2 rank 1 -> id
    assert wc.step_kv.tolist() == [2, 4, 5]
    assert wc.step_context.tolist() == [1.5, 3.5, 5.0]


def test_three_layer_model_with_dense_block(tmp_path):
    """MoE ordinals index the MoE layers only: blocks 1 and 2 of a 3-block model with a dense block 0."""
    model = tiny_model(num_layers=3, moe_layers=(1, 2), num_experts=4, top_k=2)
    toks = [(0, 0, "decode", [[3, 1], [2, 0]]), (0, 1, "decode", [[0, 1], [1, 3]])]
    w = build(tmp_path, model, toks)
    assert w.num_layers == 2 and w.num_steps == 2
    assert w.activated(0, 0)[0].tolist() == [3, 1]
    assert w.activated(0, 1)[0].tolist() == [2, 0]
    assert w.activated(1, 1)[0].tolist() == [1, 3]


def test_empty_trace_is_an_error(tmp_path):
    path = write_trace(tmp_path / "empty.parquet", MODEL, [])
    trace = read_trace(path)
    assert len(trace) == 0
    with pytest.raises(ValueError, match=r"empty\.parquet.*no rows"):
        Workload(trace)


@pytest.mark.parametrize("kw, word", [({"batch_size": 0}, "batch_size"), ({"prefill_chunk": -1}, "prefill_chunk")])
def test_bad_config(kw, word):
    with pytest.raises(ValueError, match=word):
        WorkloadConfig(**kw)


def test_batch_mixing_prefill_and_decode_only_sequences(tmp_path):
    """seq 0: prefill pos 0, 1 + decode pos 2; seq 1: decode-only pos 10, 11 (its prompt untraced).
    batch 2: step 0 = seq 0's prefill alone (context (1+2)/2 = 1.5, kv 2); seq 1 waits for the batch's
    prefill; step 1 = seq 0 pos 2 + seq 1 pos 10 (context (3+11)/2 = 7, kv 3 + 11 = 14);
    step 2 = seq 1 pos 11 (12). A prefill chunk larger than the prompt changes nothing."""
    toks = [(0, 0, "prefill", [[0, 1], [1, 2]]), (0, 1, "prefill", [[0, 2], [1, 3]]), (0, 2, "decode", [[3, 1], [2, 0]]),
            (1, 10, "decode", [[1, 0], [0, 3]]), (1, 11, "decode", [[2, 3], [3, 1]])]
    for chunk in (0, 5):
        w = build(tmp_path, MODEL, toks, batch_size=2, prefill_chunk=chunk, name=f"m{chunk}.parquet")
        assert w.num_steps == 3
        assert w.step_tokens.tolist() == [2, 2, 1]
        assert w.step_phase.tolist() == [PRE, DEC, DEC]
        assert w.step_context.tolist() == [1.5, 7.0, 12.0]
        assert w.step_kv.tolist() == [2, 14, 12]
        seqs = w.sequences
        assert seqs["first_prefill_step"].tolist() == [0, -1]
        assert seqs["first_decode_step"].tolist() == [1, 1]
        assert seqs["last_decode_step"].tolist() == [1, 2]
        # step 1 layer 0: [3, 1] and [1, 0] -> 1 twice
        e, c, r = w.activated(1, 0)
        assert e.tolist() == [1, 3, 0] and c.tolist() == [2, 1, 1] and r.tolist() == [0, 0, 1]


def test_sparse_counts_against_a_plain_reference():
    # per (step, layer): each expert's count and best rank, ordered by (-count, best rank, id); the compiled pass
    # (when numba is on) and the sorting path give the same arrays
    from dali_sim.workload.builder import _sparse_counts, _sparse_counts_sorted

    rng = np.random.default_rng(11)
    for _ in range(40):
        S, L, E, k = (int(rng.integers(1, 12)), int(rng.integers(1, 5)), int(rng.integers(2, 40)),
                      int(rng.integers(1, 9)))
        m = int(rng.integers(0, 200))
        step, layer = np.repeat(rng.integers(0, S, m), k), np.repeat(rng.integers(0, L, m), k)
        ids = rng.integers(0, E, m * k).astype(np.int16)
        ranks = np.tile(np.arange(k, dtype=np.int8), m)
        got = _sparse_counts(step, layer, ids, ranks, S, L, E)
        sorted_ = _sparse_counts_sorted(step.astype(np.int64) * L + layer, ids, ranks, S, L, E)
        for a, b in zip((got.ptr, got.expert, got.count, got.rank),
                        (sorted_.ptr, sorted_.expert, sorted_.count, sorted_.rank)):
            assert a.dtype == b.dtype and a.tolist() == b.tolist()
        for seg in range(S * L):
            sel = step * L + layer == seg
            stats = {}
            for e, r in zip(ids[sel].tolist(), ranks[sel].tolist()):
                n, best = stats.get(e, (0, k))
                stats[e] = (n + 1, min(best, r))
            want = sorted(stats, key=lambda e: (-stats[e][0], stats[e][1], e))
            lo, hi = got.ptr[seg], got.ptr[seg + 1]
            assert got.expert[lo:hi].tolist() == want
            assert got.count[lo:hi].tolist() == [stats[e][0] for e in want]
            assert got.rank[lo:hi].tolist() == [stats[e][1] for e in want]


def test_sparse_counts_of_an_id_outside_the_experts_take_the_sorting_path():
    from dali_sim.workload.builder import _sparse_counts, _sparse_counts_sorted

    step, layer = np.zeros(4, np.int64), np.array([0, 0, 1, 1])
    ids, ranks = np.array([1, 3, 0, 5], np.int16), np.array([0, 1, 0, 1], np.int8)  # 5: beyond E = 4
    got = _sparse_counts(step, layer, ids, ranks, 1, 2, 4)
    want = _sparse_counts_sorted(layer, ids, ranks, 1, 2, 4)
    assert [a.tolist() for a in (got.ptr, got.expert, got.count, got.rank)] == \
        [a.tolist() for a in (want.ptr, want.expert, want.count, want.rank)]
