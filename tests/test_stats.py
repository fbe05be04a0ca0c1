"""Trace statistics (dali_sim.trace.stats, `dali trace stats`): golden numbers derived by hand on
tests/data/golden-tiny.parquet, a brute-force reference on random traces, and edge cases.

The golden trace (rows listed in tests/data/make_golden_tiny.py): model tiny-moe, MoE layers 0, 1, 2,
E = 4 experts, top-k = 2, predictor "next" (target_offset 1). Expert ids in rank order:

    token   phase    layer 0   layer 1   layer 2
    s0p0    prefill  [0,1]     [1,3]     [2,0]
    s0p1    prefill  [0,2]     [1,2]     [2,0]
    s0p2    decode   [0,1]     [1,3]     [0,2]
    s0p3    decode   [1,0]     [3,1]     [2,1]
    s1p0    prefill  [2,3]     [0,2]     [2,3]
    s1p1    decode   [3,2]     [0,2]     [2,3]
    s1p2    decode   [3,0]     [0,2]     [2,1]
    s2p0    prefill  [1,2]     [0,3]     [2,0]

8 tokens (4 prefill, 4 decode), 24 rows, 3 sequences.
"""

from __future__ import annotations

import json
import math
from math import log2
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from click.testing import CliRunner

from dali_sim.cli.trace_stats import stats as stats_command
from dali_sim.models.spec import AttentionSpec, ModelSpec
from dali_sim.trace import PredictorInfo, Trace, TraceError, TraceWriter, read_trace
from dali_sim.trace import stats as S

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "golden-tiny.parquet"


def tiny_model(layers=(0, 1, 2), experts=4, top_k=2, num_layers=None) -> ModelSpec:
    return ModelSpec(
        name="tiny-moe", family="test", num_layers=num_layers or (max(layers) + 1), moe_layers=layers,
        num_experts=experts, top_k=top_k, hidden_size=8, expert_intermediate_size=16,
        attention=AttentionSpec(kind="gqa", num_heads=1, num_kv_heads=1, head_dim=8), vocab_size=16,
        dense_intermediate_size=16,
    )


@pytest.fixture(scope="module")
def golden() -> Trace:
    return read_trace(GOLDEN)


def test_golden_file_is_what_the_script_writes(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_golden_tiny", DATA / "make_golden_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fresh = read_trace(mod.write(tmp_path / "g.parquet"))
    checked_in = read_trace(GOLDEN)
    a, b = fresh.column_arrays(), checked_in.column_arrays()
    assert a.keys() == b.keys() and fresh.table.schema.equals(checked_in.table.schema)
    for name in a:  # (lookahead rows without a prediction are NaN rows: NaN != NaN for Table.equals)
        assert np.array_equal(a[name], b[name], equal_nan=a[name].dtype.kind == "f"), name
    assert fresh.meta.to_json() == checked_in.meta.to_json()


# ---- expert counts and popularity ----------------------------------------------------------------
def test_golden_expert_counts(golden):
    # count of expert e at a layer = rows whose top-2 contains e (either rank); read off the columns:
    # layer 0: e0 in s0p0 s0p1 s0p2 s0p3 s1p2 = 5; e1 in s0p0 s0p2 s0p3 s2p0 = 4;
    #          e2 in s0p1 s1p0 s1p1 s2p0 = 4;       e3 in s1p0 s1p1 s1p2 = 3          (sum 16 = 2 x 8)
    # layer 1: e0 in s1p0 s1p1 s1p2 s2p0 = 4; e1 in s0p0..s0p3 = 4; e2 in s0p1 s1p0 s1p1 s1p2 = 4;
    #          e3 in s0p0 s0p2 s0p3 s2p0 = 4
    # layer 2: e0 in s0p0 s0p1 s0p2 s2p0 = 4; e1 in s0p3 s1p2 = 2; e2 in all 8; e3 in s1p0 s1p1 = 2
    counts = S.expert_counts(golden)
    assert counts.index.name == "layer" and counts.index.tolist() == [0, 1, 2]
    assert counts.to_numpy().tolist() == [[5, 4, 4, 3], [4, 4, 4, 4], [4, 2, 8, 2]]
    # prefill rows only (s0p0 s0p1 s1p0 s2p0): layer 0 = [0,1] [0,2] [2,3] [1,2] -> e0 2, e1 2, e2 3, e3 1
    assert S.expert_counts(golden, "prefill").loc[0].tolist() == [2, 2, 3, 1]
    # decode rows (s0p2 s0p3 s1p1 s1p2): layer 0 = [0,1] [1,0] [3,2] [3,0] -> 3, 2, 1, 2
    assert S.expert_counts(golden, "decode").loc[0].tolist() == [3, 2, 1, 2]
    with pytest.raises(ValueError, match="phase"):
        S.expert_counts(golden, "generate")


def test_golden_popularity(golden):
    pop = S.popularity(golden)
    # shares p_e = c_e / 16.  H = -sum p log2 p = log2(16) - sum c log2 c / 16.
    # layer 0 (5,4,4,3): H = 4 - (5 log2 5 + 4*2 + 4*2 + 3 log2 3) / 16 = 1.977217 bits
    h0 = 4 - (5 * log2(5) + 16 + 3 * log2(3)) / 16
    # layer 1 (4,4,4,4): uniform, H = log2 4 = 2
    # layer 2 (4,2,8,2): p = 1/4, 1/8, 1/2, 1/8 -> H = 0.5 + 0.375 + 0.5 + 0.375 = 1.75
    assert pop["entropy_bits"].tolist() == pytest.approx([h0, 2.0, 1.75], abs=1e-12)
    assert h0 == pytest.approx(1.977217, abs=1e-6)
    # normalised by log2 E = 2
    assert pop["entropy_norm"].tolist() == pytest.approx([h0 / 2, 1.0, 0.875], abs=1e-12)
    # Gini = sum_i (2i - E - 1) c_(i) / (E sum c), counts ascending, i = 1..4 -> coefficients -3 -1 1 3:
    # layer 0 sorted (3,4,4,5): -9 - 4 + 4 + 15 = 6 -> 6 / 64 = 0.09375
    # layer 1: all equal -> 0
    # layer 2 sorted (2,2,4,8): -6 - 2 + 4 + 24 = 20 -> 20 / 64 = 0.3125
    #   (check via mean absolute difference: sum_ij |ci - cj| = 2 x (0+2+2+6+6+4) = 40, / (2*4*16) = 0.3125)
    assert pop["gini"].tolist() == pytest.approx([0.09375, 0.0, 0.3125], abs=1e-12)
    # top-1 share: 5/16, 4/16, 8/16; top-k (k=2) share: 9/16, 8/16, 12/16; max/mean (mean 4): 1.25, 1, 2
    assert pop["top1_share"].tolist() == pytest.approx([5 / 16, 4 / 16, 8 / 16])
    assert pop["topk_share"].tolist() == pytest.approx([9 / 16, 8 / 16, 12 / 16])
    assert pop["max_over_mean"].tolist() == pytest.approx([1.25, 1.0, 2.0])
    # fewest experts covering >= 50 % (8 of 16) / >= 90 % (14.4 of 16), most popular first:
    # layer 0 cum 5,9,13,16 -> 2 / 4; layer 1 cum 4,8,12,16 -> 2 / 4; layer 2 cum 8,12,14,16 -> 1 / 4
    assert pop["experts_50pct"].tolist() == [2, 2, 1]
    assert pop["experts_90pct"].tolist() == [4, 4, 4]
    assert pop["tokens"].tolist() == [8, 8, 8]
    assert pop["unused"].tolist() == [0, 0, 0]


# ---- reuse --------------------------------------------------------------------------------------
def test_golden_reuse(golden):
    r = S.reuse(golden)
    # pairs (token, predecessor pos - 1 of the same sequence): s0p1<-s0p0 (prefill), s0p2<-s0p1,
    # s0p3<-s0p2, s1p1<-s1p0, s1p2<-s1p1 (decode). s0p0, s1p0, s2p0 have none: 5 pairs per layer,
    # 1 prefill + 4 decode (the phase is the later token's: s0p2 is decode although s0p1 is prefill).
    # layer 0: [0,2]v[0,1] 1/2 | [0,1]v[0,2] 1/2, [1,0]v[0,1] 1, [3,2]v[2,3] 1, [3,0]v[3,2] 1/2
    #          overall 3.5/5 = 0.7, prefill 0.5, decode 3/4 = 0.75
    # layer 1: [1,2]v[1,3] 1/2 | [1,3]v[1,2] 1/2, [3,1]v[1,3] 1, [0,2]v[0,2] 1, [0,2]v[0,2] 1
    #          overall 4/5 = 0.8, prefill 0.5, decode 3.5/4 = 0.875
    # layer 2: [2,0]v[2,0] 1 | [0,2]v[2,0] 1, [2,1]v[0,2] 1/2, [2,3]v[2,3] 1, [2,1]v[2,3] 1/2
    #          overall 4/5 = 0.8, prefill 1.0, decode 3/4 = 0.75
    assert r["overall"].tolist() == pytest.approx([0.7, 0.8, 0.8])
    assert r["prefill"].tolist() == pytest.approx([0.5, 0.5, 1.0])
    assert r["decode"].tolist() == pytest.approx([0.75, 0.875, 0.75])
    assert r["pairs"].tolist() == [5, 5, 5]
    assert r["pairs_prefill"].tolist() == [1, 1, 1]
    assert r["pairs_decode"].tolist() == [4, 4, 4]
    # independent-draw reference sum_e f_e^2 / k with f_e = c_e / 8:
    # layer 0: (25+16+16+9)/64/2 = 66/128; layer 1: 64/64/2 = 0.5; layer 2: (16+4+64+4)/64/2 = 88/128
    assert r["indep_baseline"].tolist() == pytest.approx([66 / 128, 0.5, 88 / 128])


def test_golden_summary_json_keys_and_pooled_reuse(golden):
    s = S.summary(golden)
    assert s["num_layers"] == 3 and s["layers"] == [0, 1, 2]
    assert s["num_experts"] == 4 and s["top_k"] == 2
    assert s["sequences"] == 3 and s["rows"] == 24
    assert s["tokens"] == {"prefill": 4, "decode": 4, "total": 8}
    assert s["expert_counts"] == [[5, 4, 4, 3], [4, 4, 4, 4], [4, 2, 8, 2]]
    assert s["reuse"]["overall"] == pytest.approx([0.7, 0.8, 0.8])
    # pooled over layers (each pair weighs the same): overall (3.5 + 4 + 4) / 15, prefill (0.5+0.5+1)/3,
    # decode (3 + 3.5 + 3) / 12
    pooled = s["reuse"]["pooled"]
    assert pooled["overall"] == pytest.approx(11.5 / 15)
    assert pooled["prefill"] == pytest.approx(2 / 3)
    assert pooled["decode"] == pytest.approx(9.5 / 12)
    assert (pooled["pairs"], pooled["pairs_prefill"], pooled["pairs_decode"]) == (15, 3, 12)
    assert s["reuse"]["random_baseline"] == 0.5  # k / E
    json.dumps(s, allow_nan=False)  # strict JSON



def test_golden_reuse_at_longer_lags(golden):
    # lag 2 pairs (token, same sequence pos - 2): s0p2<-s0p0, s0p3<-s0p1, s1p2<-s1p0; all three later
    # tokens are decode, so no prefill pair.
    # layer 0: [0,1]v[0,1] 1, [1,0]v[0,2] 1/2, [3,0]v[2,3] 1/2 -> 2/3
    # layer 1: [1,3]v[1,3] 1, [3,1]v[1,2] 1/2, [0,2]v[0,2] 1   -> 5/6
    # layer 2: [0,2]v[2,0] 1, [2,1]v[2,0] 1/2, [2,1]v[2,3] 1/2 -> 2/3
    r2 = S.reuse(golden, lag=2)
    assert r2.index.tolist() == [0, 1, 2] and r2.columns.tolist() == S.REUSE_COLUMNS
    assert r2["overall"].tolist() == pytest.approx([2 / 3, 5 / 6, 2 / 3])
    assert r2["decode"].tolist() == pytest.approx([2 / 3, 5 / 6, 2 / 3])
    assert r2["prefill"].isna().all()  # no pairs -> NaN, not 0
    assert r2["pairs"].tolist() == [3, 3, 3] and r2["pairs_prefill"].tolist() == [0, 0, 0]
    assert r2["pairs_decode"].tolist() == [3, 3, 3]
    # lag 3: only s0p3<-s0p0: [1,0]v[0,1] 1, [3,1]v[1,3] 1, [2,1]v[2,0] 1/2
    r3 = S.reuse(golden, lag=3)
    assert r3["overall"].tolist() == pytest.approx([1.0, 1.0, 0.5])
    assert r3["pairs"].tolist() == [1, 1, 1]
    # lag 4: no sequence is that long
    r4 = S.reuse(golden, lag=4)
    assert r4["pairs"].tolist() == [0, 0, 0] and r4[["overall", "prefill", "decode"]].isna().all().all()
    # the baseline does not depend on the lag; lag 1 is the default
    assert r2["indep_baseline"].tolist() == pytest.approx([66 / 128, 0.5, 88 / 128])
    pd.testing.assert_frame_equal(S.reuse(golden, lag=1), S.reuse(golden))
    pd.testing.assert_frame_equal(S.reuse(_shuffled(golden), lag=2), r2)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="lag must be an integer >= 1"):
            S.reuse(golden, lag=bad)

# ---- cross-layer --------------------------------------------------------------------------------
def test_golden_crosslayer(golden):
    c = S.crosslayer(golden)
    assert c.index.tolist() == [0, 1] and c["next_layer"].tolist() == [1, 2]
    assert c["tokens"].tolist() == [8, 8]
    # pair 0 -> 1. Co-occurrence C[a, b] = tokens with a in layer-0 set and b in layer-1 set:
    #   a=0 (s0p0 s0p1 s0p2 s0p3 s1p2 -> {1,3} {1,2} {1,3} {1,3} {0,2}): [1, 4, 2, 3]
    #   a=1 (s0p0 s0p2 s0p3 s2p0 -> {1,3} {1,3} {1,3} {0,3}):             [1, 3, 0, 4]
    #   a=2 (s0p1 s1p0 s1p1 s2p0 -> {1,2} {0,2} {0,2} {0,3}):             [3, 1, 3, 1]
    #   a=3 (s1p0 s1p1 s1p2 -> {0,2} x 3):                                [3, 0, 3, 0]
    # scores = sum of the rows of the token's layer-0 set; top-2, ties to the lower id:
    #   {0,1}: [2,7,2,7] -> {1,3}  (s0p0, s0p2, s0p3; true {1,3}: 1 each)
    #   {0,2}: [4,5,5,4] -> {1,2}  (s0p1; true {1,2}: 1)
    #   {2,3}: [6,1,6,1] -> {0,2}  (s1p0, s1p1; true {0,2}: 1 each)
    #   {0,3}: [4,4,5,3] -> 2, then tie 0/1 at 4 -> 0: {0,2}  (s1p2; true {0,2}: 1)
    #   {1,2}: [4,4,3,5] -> 3, then tie 0/1 at 4 -> 0: {0,3}  (s2p0; true {0,3}: 1)
    #   -> 8/8 = 1.0 (ties to the higher id would give 0.5 for s1p2 and s2p0: 7/8)
    # popular: layer-1 counts (4,4,4,4) all tie -> {0,1}; every token's set holds exactly one -> 0.5
    # pair 1 -> 2. C[a, b]:
    #   a=0 (s1p0 s1p1 s1p2 s2p0 -> {2,3} {2,3} {1,2} {0,2}): [1, 1, 4, 2]
    #   a=1 (s0p0..s0p3 -> {0,2} {0,2} {0,2} {1,2}):         [3, 1, 4, 0]
    #   a=2 (s0p1 s1p0 s1p1 s1p2 -> {0,2} {2,3} {2,3} {1,2}): [1, 1, 4, 2]
    #   a=3 (s0p0 s0p2 s0p3 s2p0 -> {0,2} {0,2} {1,2} {0,2}): [3, 1, 4, 0]
    #   {1,3}: [6,2,8,0] -> {0,2}: s0p0 1, s0p2 1, s0p3 (true {1,2}) 1/2
    #   {1,2}: [4,2,8,2] -> {0,2}: s0p1 1
    #   {0,2}: [2,2,8,4] -> {2,3}: s1p0 1, s1p1 1, s1p2 (true {1,2}) 1/2
    #   {0,3}: [4,2,8,2] -> {0,2}: s2p0 1          -> 7/8 = 0.875
    # popular: layer-2 counts (4,2,8,2) -> {2,0}: 4 tokens hold {0,2} (1 each), s0p3 s1p2 s1p0 s1p1
    #   hold one of them (1/2 each) -> (4 + 2) / 8 = 0.75
    assert c["cooc_recall"].tolist() == pytest.approx([1.0, 0.875])
    assert c["popular_recall"].tolist() == pytest.approx([0.5, 0.75])
    # top-1 (rank-0) ids: layer 0: 0 0 0 1 2 3 3 1; layer 1: 1 1 1 3 0 0 0 0; layer 2: 2 2 0 2 2 2 2 2
    # pair 0 -> 1: joint (0,1) x3, (1,3), (2,0), (3,0) x2, (1,0); X marginal 3,2,1,2; Y marginal 4,3,0,1.
    #   H(X) = 3 - (3 log2 3 + 2 + 2) / 8; H(Y) = 3 - (8 + 3 log2 3) / 8; H(X,Y) = 3 - (3 log2 3 + 2) / 8
    #   I = H(X) + H(Y) - H(X,Y) = 3 - (3 log2 3 + 10) / 8 = 1.155639
    #   NMI = I / ((H(X) + H(Y)) / 2) = 0.698002
    #   conditional top-1: X=0 -> 1 (3 of 3), X=1 -> tie 0/3 -> 0 (1 of 2), X=2 -> 0 (1), X=3 -> 0 (2): 7/8
    hx, hy, hxy = 3 - (3 * log2(3) + 4) / 8, 3 - (8 + 3 * log2(3)) / 8, 3 - (3 * log2(3) + 2) / 8
    i01 = hx + hy - hxy
    assert i01 == pytest.approx(3 - (3 * log2(3) + 10) / 8)
    # pair 1 -> 2: joint (1,2) x2, (1,0), (3,2), (0,2) x4; X marginal 4,3,0,1; Y marginal 1,0,7,0.
    #   H(X) = 3 - (8 + 3 log2 3) / 8 = 1.405639; H(Y) = 3 - 7 log2 7 / 8 = 0.543564
    #   H(X,Y) = 3 - (2 + 8) / 8 = 1.75; I = 0.199203; NMI = 0.199203 / 0.974602 = 0.204395
    #   conditional top-1: X=0 -> 2 (4 of 4), X=1 -> 2 (2 of 3), X=3 -> 2 (1): 7/8
    hx2, hy2, hxy2 = 3 - (8 + 3 * log2(3)) / 8, 3 - 7 * log2(7) / 8, 1.75
    i12 = hx2 + hy2 - hxy2
    assert c["top1_mi_bits"].tolist() == pytest.approx([i01, i12], abs=1e-12)
    assert c["top1_nmi"].tolist() == pytest.approx([i01 / ((hx + hy) / 2), i12 / ((hx2 + hy2) / 2)], abs=1e-12)
    assert c["top1_nmi"].tolist() == pytest.approx([0.698002, 0.204395], abs=1e-6)
    assert c["top1_cond_acc"].tolist() == pytest.approx([0.875, 0.875])


# ---- lookahead ----------------------------------------------------------------------------------
def test_golden_lookahead(golden):
    la = S.lookahead_accuracy(golden)
    assert la.index.tolist() == [("next", 1), ("next", 2)]  # (predictor, target layer)
    assert la["source_layer"].tolist() == [0, 1]
    assert la["target_offset"].tolist() == [1, 1]
    # target layer 1 (logits on the layer-0 rows), top-2 of the logits vs the true layer-1 set:
    #   s0p0 [0,2,1,1.5] -> {1,3} v {1,3}: 1        s0p1 [0,2,.5,1] -> {1,3} v {1,2}: 1/2
    #   s0p2 [2,1,0,.5] -> {0,1} v {1,3}: 1/2       s0p3 [-1,3,0,2] -> {1,3} v {1,3}: 1
    #   s1p0 [1,.5,.5,0] -> 0, tie 1/2 -> 1: {0,1} v {0,2}: 1/2
    #   s1p1 [0,1,2,3] -> {2,3} v {0,2}: 1/2        s1p2 [.1,.2,.3,.4] -> {2,3} v {0,2}: 1/2
    #   s2p0 [5,0,0,4] -> {0,3} v {0,3}: 1
    #   -> 5.5 / 8 = 0.6875; prefill (s0p0 s0p1 s1p0 s2p0) 3/4 = 0.75; decode 2.5/4 = 0.625
    #   top-1: argmax 1,1,0,1,0,3,3,0 vs true rank-0 1,1,1,3,0,0,0,0 -> hits s0p0 s0p1 s1p0 s2p0: 4/8
    # target layer 2 (logits on the layer-1 rows):
    #   s0p0 [1,0,2,0] -> {0,2} v {2,0}: 1          s0p1 same logits v {2,0}: 1
    #   s0p2 same logits v {0,2}: 1                 s0p3 same logits v {2,1}: 1/2
    #   s1p0 [0,0,2,1] -> {2,3} v {2,3}: 1          s1p1 [0,1,2,0] -> {1,2} v {2,3}: 1/2
    #   s1p2 [0,0,2,0] -> 2, tie 0/1/3 -> 0: {0,2} v {2,1}: 1/2
    #   s2p0 [3,0,1,0] -> {0,2} v {2,0}: 1
    #   -> 6.5 / 8 = 0.8125; prefill (s0p0 s0p1 s1p0 s2p0) 4/4 = 1; decode 2.5/4 = 0.625
    #   top-1: argmax 2,2,2,2,2,2,2,0 vs true 2,2,0,2,2,2,2,2 -> 6/8
    assert la["rows"].tolist() == [8, 8]
    assert la["recall"].tolist() == pytest.approx([0.6875, 0.8125])
    assert la["recall_prefill"].tolist() == pytest.approx([0.75, 1.0])
    assert la["recall_decode"].tolist() == pytest.approx([0.625, 0.625])
    assert la["top1_acc"].tolist() == pytest.approx([0.5, 0.75])
    assert la["unpredicted"].tolist() == [0, 0]
    # pooled over the 16 rows: recall 12/16, prefill 7/8, decode 5/8, top-1 10/16
    d = S.summary(golden)["lookahead"]["next"]
    assert d["rows"] == 16 and d["target_offset"] == 1
    assert d["recall"] == pytest.approx(0.75)
    assert d["recall_prefill"] == pytest.approx(0.875)
    assert d["recall_decode"] == pytest.approx(0.625)
    assert d["top1_acc"] == pytest.approx(0.625)
    # per-layer lists are aligned with `layers` (the target layer); layer 0 is never a target
    assert d["per_layer"]["recall"][0] is None
    assert d["per_layer"]["recall"][1:] == pytest.approx([0.6875, 0.8125])
    assert d["per_layer"]["rows"] == [0, 8, 8]
    assert d["per_layer"]["source_layer"] == [None, 0, 1]


# ---- order independence, edge cases ---------------------------------------------------------------
def _shuffled(trace: Trace, seed: int = 7) -> Trace:
    perm = np.random.default_rng(seed).permutation(len(trace))
    return Trace(trace.table.take(pa.array(perm)), trace.meta, trace.path)


def _all_frames(trace) -> dict[str, pd.DataFrame]:
    return {
        "counts": S.expert_counts(trace), "popularity": S.popularity(trace), "reuse": S.reuse(trace),
        "crosslayer": S.crosslayer(trace), "lookahead": S.lookahead_accuracy(trace),
    }


def test_row_order_does_not_matter(golden):
    shuffled = _shuffled(golden)
    assert not np.array_equal(shuffled.seq_id, golden.seq_id)
    a, b = _all_frames(golden), _all_frames(shuffled)
    for name in a:
        pd.testing.assert_frame_equal(a[name], b[name], check_exact=False, rtol=1e-12)
    assert S.summary(golden) == S.summary(shuffled)


def _write(path, model, tokens, predictors=(), partial_after=None):
    """tokens: list of (seq, pos, phase, [experts per MoE layer], {pred: [logits or None per layer]})."""
    E = model.num_experts
    w = TraceWriter(path, model, provenance={"source": "test"}, weights=False, predictors=list(predictors))
    for i, (seq, pos, phase, per_layer, preds) in enumerate(tokens):
        for li, layer in enumerate(model.moe_layers):
            if partial_after is not None and i == partial_after[0] and li >= partial_after[1]:
                return w.abort("test: stopped mid-token")
            look = {name: np.array([vals[li] if vals[li] is not None else [np.nan] * E], np.float32)
                    for name, vals in preds.items()}
            w.write(seq_id=seq, phase=phase, pos=pos, layer=layer, experts=np.array([per_layer[li]]),
                    lookahead=look)
    return w.close()


def test_single_token_sequences_have_no_reuse_pairs(tmp_path):
    model = tiny_model(layers=(1, 3), num_layers=4)  # block indices 1 and 3 are the MoE layers
    tokens = [(s, 0, "prefill", [[s % 4, (s + 1) % 4], [0, 1]], {}) for s in range(3)]
    trace = read_trace(_write(tmp_path / "t.parquet", model, tokens))
    r = S.reuse(trace)
    assert r.index.tolist() == [1, 3]
    assert r["pairs"].tolist() == [0, 0]
    assert r[["overall", "prefill", "decode"]].isna().all().all()  # no pairs -> NaN, not 0
    s = S.summary(trace)
    assert s["layers"] == [1, 3] and s["reuse"]["overall"] == [None, None]
    assert s["reuse"]["pooled"]["overall"] is None and s["reuse"]["pooled"]["pairs"] == 0
    assert s["tokens"] == {"prefill": 3, "decode": 0, "total": 3}
    json.dumps(s, allow_nan=False)
    # counts: layer 1 sets {0,1} {1,2} {2,3}; layer 3 {0,1} x 3
    assert s["expert_counts"] == [[1, 2, 2, 1], [3, 3, 0, 0]]
    assert s["popularity"]["unused"] == [0, 2]
    # cross-layer is keyed by block index: the pair is 1 -> 3
    assert s["crosslayer"]["layer"] == [1] and s["crosslayer"]["next_layer"] == [3]
    assert "none in this trace" in S.format_text(s)


def test_trace_without_lookahead_columns(tmp_path):
    model = tiny_model()
    tokens = [(0, p, "prefill" if p == 0 else "decode", [[0, 1], [1, 2], [2, 3]], {}) for p in range(3)]
    trace = read_trace(_write(tmp_path / "t.parquet", model, tokens))
    la = S.lookahead_accuracy(trace)
    assert la.empty and list(la.columns) == S.LOOKAHEAD_COLUMNS
    assert la.index.names == ["predictor", "layer"]
    s = S.summary(trace)
    assert s["lookahead"] == {}
    # identical routing every step: reuse 1 everywhere, decode only (2 pairs per layer)
    assert s["reuse"]["decode"] == [1.0, 1.0, 1.0] and s["reuse"]["prefill"] == [None] * 3


def test_unpredicted_rows_and_missing_targets(tmp_path):
    # predictor with target_offset 2 on a 3-layer model: only layer-0 rows can have a target (layer 2)
    model = tiny_model()
    logits = [1.0, 0.0, 0.0, 2.0]  # top-2 {3, 0}
    tokens = [
        (0, 0, "prefill", [[0, 1], [1, 2], [3, 0]], {"skip2": [logits, None, None]}),  # recall 1
        (0, 1, "decode", [[0, 1], [1, 2], [3, 1]], {"skip2": [logits, None, None]}),  # recall 1/2
        (0, 2, "decode", [[0, 1], [1, 2], [3, 1]], {"skip2": [None, None, None]}),  # unpredicted
    ]
    trace = read_trace(_write(tmp_path / "t.parquet", model, tokens, [PredictorInfo("skip2", 2)]))
    la = S.lookahead_accuracy(trace)
    assert la.index.tolist() == [("skip2", 2)]
    row = la.loc[("skip2", 2)]
    assert row["source_layer"] == 0 and row["rows"] == 2 and row["unpredicted"] == 1
    assert row["recall"] == pytest.approx(0.75)
    assert row["recall_prefill"] == pytest.approx(1.0)
    assert row["recall_decode"] == pytest.approx(0.5)
    assert row["top1_acc"] == pytest.approx(1.0)  # argmax 3 = rank-0 of both targets


def test_single_moe_layer_and_predictor_without_targets(tmp_path):
    # one MoE layer: no cross-layer pairs; a +1 predictor has no target layer at all
    model = tiny_model(layers=(0,))
    tokens = [(0, p, "decode", [[p % 4, (p + 1) % 4]], {"x": [[1.0, 0.0, 0.0, 2.0]]}) for p in range(3)]
    trace = read_trace(_write(tmp_path / "t.parquet", model, tokens, [PredictorInfo("x", 1)]))
    assert S.crosslayer(trace).empty
    assert S.lookahead_accuracy(trace).empty
    s = S.summary(trace)
    assert s["crosslayer"]["layer"] == []
    assert s["lookahead"]["x"]["rows"] == 0 and s["lookahead"]["x"]["recall"] is None
    assert s["lookahead"]["x"]["per_layer"]["recall"] == [None]
    # sets {0,1} {1,2} {2,3}: each pair shares one expert -> reuse 1/2
    assert s["reuse"]["overall"] == [0.5]
    json.dumps(s, allow_nan=False)
    S.format_text(s)


def test_partial_trace_via_cli(tmp_path):
    model = tiny_model()
    tokens = [(0, p, "prefill" if p < 2 else "decode", [[0, 1], [1, 2], [2, 3]], {}) for p in range(4)]
    path = _write(tmp_path / "t.parquet", model, tokens, partial_after=(3, 1))  # last token: layer 0 only
    assert path.name.endswith(".partial")
    runner = CliRunner()
    refused = runner.invoke(stats_command, [str(path)])
    assert isinstance(refused.exception, TraceError) and "--allow-partial" in str(refused.exception)
    result = runner.invoke(stats_command, [str(path), "--json", "--allow-partial"])
    assert result.exit_code == 0, result.output
    s = json.loads(result.output)
    assert s["status"] == "partial" and s["rows"] == 10
    assert s["tokens"] == {"prefill": 2, "decode": 2, "total": 4}  # the cut token counts
    assert s["reuse"]["pairs"] == [3, 2, 2]  # pos 3 exists only at layer 0
    assert s["crosslayer"]["tokens"] == [3, 3]  # pairs need both rows of the token


def test_cli_text_and_json_on_golden():
    runner = CliRunner()
    text = runner.invoke(stats_command, [str(GOLDEN)])
    assert text.exit_code == 0, text.output
    assert "tiny-moe: 3 MoE layers, 4 experts, top-2" in text.output
    assert "next (+1): recall 0.750" in text.output
    assert "tokens 8 (prefill 4, decode 4)" in text.output
    js = runner.invoke(stats_command, [str(GOLDEN), "--json"])
    assert js.exit_code == 0
    s = json.loads(js.output)
    for key in ("num_layers", "num_experts", "top_k", "sequences", "tokens", "expert_counts", "reuse", "layers"):
        assert key in s
    assert s["expert_counts"][2] == [4, 2, 8, 2]
    assert s["reuse"]["overall"] == pytest.approx([0.7, 0.8, 0.8])


def test_cli_bad_input(tmp_path):
    runner = CliRunner()
    missing = runner.invoke(stats_command, [str(tmp_path / "nope.parquet")])
    assert isinstance(missing.exception, TraceError) and "no such file" in str(missing.exception)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet")
    bad = runner.invoke(stats_command, [str(junk)])
    assert isinstance(bad.exception, TraceError)


def test_empty_trace(tmp_path):
    w = TraceWriter(tmp_path / "e.parquet", tiny_model(), provenance={"source": "test"}, weights=False)
    trace = read_trace(w.close())
    s = S.summary(trace)
    assert s["rows"] == 0 and s["tokens"]["total"] == 0
    assert s["expert_counts"] == [[0] * 4] * 3
    assert s["popularity"]["entropy_bits"] == [None] * 3
    assert s["reuse"]["overall"] == [None] * 3
    assert s["crosslayer"]["cooc_recall"] == [None, None]
    json.dumps(s, allow_nan=False)
    S.format_text(s)


# ---- brute-force reference on random traces --------------------------------------------------------
def _random_trace(path, seed, E=6, k=3, layers=(0, 2, 3), seqs=4, with_pred=True):
    rng = np.random.default_rng(seed)
    model = tiny_model(layers=layers, experts=E, top_k=k)
    tokens = []
    for s in range(seqs):
        n_pre, n_dec = int(rng.integers(1, 4)), int(rng.integers(0, 6))
        for p in range(n_pre + n_dec):
            # skewed routing, mostly a shifted copy of the previous layer's set, so that the
            # co-occurrence predictor differs from the popularity one
            sets = []
            for _ in layers:
                if sets and rng.random() < 0.8:
                    sets.append([(e + 1) % E for e in sets[-1]])
                else:
                    sets.append(list(np.argsort(rng.random(E) - 0.3 * (np.arange(E) < k))[:k]))
            preds = {"p1": [rng.integers(0, 3, E).astype(float).tolist() for _ in layers[:-1]] + [None]}
            if rng.random() < 0.2:
                preds["p1"][0] = None
            tokens.append((s * 10 + 3, p, "prefill" if p < n_pre else "decode", sets, preds if with_pred else {}))
    # write in a scrambled token order (the writer accepts any order)
    tokens = [tokens[i] for i in rng.permutation(len(tokens))]
    return read_trace(_write(path, model, tokens, [PredictorInfo("p1", 1)] if with_pred else []))


def _topk_ref(scores, k):
    return set(sorted(range(len(scores)), key=lambda e: (-scores[e], e))[:k])


def _reference(trace: Trace):
    E, k, layers = trace.num_experts, trace.top_k, list(trace.layers)
    rows = {}
    for i in range(len(trace)):
        rows[(int(trace.seq_id[i]), int(trace.pos[i]), int(trace.layer_index[i]))] = i
    ex = trace.experts
    reuse_sum, reuse_n = {}, {}
    for (s, p, l), i in rows.items():
        j = rows.get((s, p - 1, l))
        if j is None:
            continue
        ph = int(trace.phase[i])
        reuse_sum[(l, ph)] = reuse_sum.get((l, ph), 0) + len(set(ex[i]) & set(ex[j])) / k
        reuse_n[(l, ph)] = reuse_n.get((l, ph), 0) + 1
    cooc = []
    for l in range(len(layers) - 1):
        pairs = [(i, rows[(s, p, l + 1)]) for (s, p, ll), i in rows.items() if ll == l and (s, p, l + 1) in rows]
        C = np.zeros((E, E))
        for i, j in pairs:
            for a in ex[i]:
                for b in ex[j]:
                    C[a, b] += 1
        total = 0.0
        for i, j in pairs:
            score = sum(C[a] for a in ex[i])
            total += len(_topk_ref(score, k) & set(ex[j])) / k
        cooc.append(total / len(pairs))
    look = {}
    pred = trace.lookahead("p1")
    for (s, p, l), i in rows.items():
        j = rows.get((s, p, l + 1))
        if j is None or np.isnan(pred[i]).all():
            continue
        look.setdefault(l + 1, []).append(len(_topk_ref(pred[i], k) & set(ex[j])) / k)
    return reuse_sum, reuse_n, cooc, look


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_brute_force_reference(tmp_path, seed):
    trace = _random_trace(tmp_path / "r.parquet", seed)
    reuse_sum, reuse_n, cooc, look = _reference(trace)
    r = S.reuse(trace)
    for li, layer in enumerate(trace.layers):
        for ph, col in ((0, "prefill"), (1, "decode")):
            n = reuse_n.get((li, ph), 0)
            assert r.loc[layer, "pairs_" + col] == n
            if n:
                assert r.loc[layer, col] == pytest.approx(reuse_sum[(li, ph)] / n)
            else:
                assert math.isnan(r.loc[layer, col])
    cross = S.crosslayer(trace)
    assert cross["cooc_recall"].tolist() == pytest.approx(cooc)
    assert (cross["cooc_recall"] > cross["popular_recall"]).any()  # the reference is not vacuous
    la = S.lookahead_accuracy(trace).loc["p1"]
    for li, vals in look.items():
        assert la.loc[trace.layers[li], "recall"] == pytest.approx(np.mean(vals))
        assert la.loc[trace.layers[li], "rows"] == len(vals)
    # the same statistics from a sorted copy
    a, b = _all_frames(trace), _all_frames(trace.sorted())
    for name in a:
        pd.testing.assert_frame_equal(a[name], b[name], check_exact=False, rtol=1e-12)


@pytest.mark.parametrize("lag", [2, 3])
def test_reuse_lag_matches_brute_force(tmp_path, lag):
    trace = _random_trace(tmp_path / "r.parquet", 5, seqs=6)
    rows = {(int(trace.seq_id[i]), int(trace.pos[i]), int(trace.layer_index[i])): i for i in range(len(trace))}
    ex, k = trace.experts, trace.top_k
    total, n = {}, {}
    for (s, p, l), i in rows.items():
        j = rows.get((s, p - lag, l))
        if j is not None:
            key = (l, int(trace.phase[i]))
            total[key] = total.get(key, 0.0) + len(set(ex[i]) & set(ex[j])) / k
            n[key] = n.get(key, 0) + 1
    assert sum(n.values()) > 0  # the reference is not vacuous
    r = S.reuse(trace, lag=lag)
    for li, layer in enumerate(trace.layers):
        for ph, col in ((0, "prefill"), (1, "decode")):
            assert r.loc[layer, "pairs_" + col] == n.get((li, ph), 0)
            if n.get((li, ph)):
                assert r.loc[layer, col] == pytest.approx(total[(li, ph)] / n[(li, ph)])
            else:
                assert math.isnan(r.loc[layer, col])

def test_accepts_a_path_and_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys; from dali_sim.trace import stats as S; from dali_sim.cli import trace_stats; "
            f"S.summary({str(GOLDEN)!r}); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
