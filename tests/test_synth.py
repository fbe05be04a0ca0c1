"""The synthetic trace generator: determinism, validity, and that each knob moves the statistic it names."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dali_sim.cli.trace_synth import synth
from dali_sim.trace import Trace, TraceError, read_trace
from dali_sim.trace import stats as S
from dali_sim.trace.calibrate import load_counts, popularity_from_frequencies
from dali_sim.trace.synth import LookaheadSpec, SynthConfig, synthesize

OLMOE_COUNTS = Path(__file__).resolve().parents[2] / "shared/validation-traces/OLMoE/routing_counts"
needs_olmoe = pytest.mark.skipif(not OLMOE_COUNTS.exists(), reason="validation traces not present")

# switch off the per-sequence / drifting popularity factors to look at one mechanism at a time
PLAIN = dict(topic_spread=0.0, drift_spread=0.0)


def make(tmp_path: Path, name: str = "t.parquet", **kw):
    kw.setdefault("model", "gpt-oss-20b")
    kw.setdefault("sequences", 4)
    kw.setdefault("prompt_len", 8)
    kw.setdefault("gen_len", 24)
    path = synthesize(SynthConfig(**kw), tmp_path / name, progress=False)
    return read_trace(path)


# ---- statistics: dali_sim.trace.stats (docs/statistics.md), plus what only these tests need ----------
def counts(t: Trace) -> np.ndarray:
    """(MoE-layer ordinal, expert) selection counts."""
    return S.expert_counts(t).to_numpy()


def gini_of_counts(c: np.ndarray) -> float:
    """Gini of one count vector that is not a trace's (the stats module's definition)."""
    return float(S.popularity_from_counts(np.atleast_2d(c), 1)["gini"][0])


def decode_reuse(t: Trace, lag: int = 1) -> np.ndarray:
    """Per layer: mean |E(t) ∩ E(t - lag)| / k over decode tokens t."""
    return S.reuse(t, lag=lag)["decode"].to_numpy()


def lookahead_recall(t: Trace, predictor: str) -> float:
    """Top-k recall of a lookahead column, pooled over all rows scored."""
    return S.summary(t)["lookahead"][predictor]["recall"]


def successor_hit_rate(t: Trace) -> np.ndarray:
    """Per adjacent MoE-layer pair (l-1, l): P(succ(a) in E_l | a in E_{l-1}), succ(a) = a's most frequent
    companion at layer l in this trace (every rank pair counts; in-sample, so slightly optimistic).
    Needs a complete trace (every token has every layer)."""
    ex = t.sorted().experts.astype(np.int64).reshape(-1, len(t.layers), t.top_k)
    e, k = t.num_experts, t.top_k
    out = []
    for l in range(1, ex.shape[1]):
        a = np.repeat(ex[:, l - 1, :], k, axis=1).reshape(-1)
        b = np.tile(ex[:, l, :], (1, k)).reshape(-1)
        co = np.bincount(a * e + b, minlength=e * e).reshape(e, e)
        out.append(co.max(axis=1).sum() / co.sum() * k)
    return np.array(out)


# ---- files ------------------------------------------------------------------------------------------
def test_deterministic_bytes_and_seed_matters(tmp_path):
    cfg = SynthConfig("gpt-oss-20b", sequences=3, prompt_len=5, gen_len=7, seed=11, lookahead=("p=0.7",))
    a = synthesize(cfg, tmp_path / "a.parquet", command="x", progress=False)
    b = synthesize(cfg, tmp_path / "b.parquet", command="x", progress=False)
    c = synthesize(SynthConfig("gpt-oss-20b", sequences=3, prompt_len=5, gen_len=7, seed=12, lookahead=("p=0.7",)),
                   tmp_path / "c.parquet", command="x", progress=False)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    ta, tc = read_trace(a), read_trace(c)
    assert not np.array_equal(ta.experts, tc.experts)


def test_valid_trace_shape_phases_and_provenance(tmp_path):
    t = make(tmp_path, model="deepseek-v2-lite", sequences=3, prompt_len=4, gen_len=6, lookahead=("nx=0.9",))
    spec = t.model
    assert len(t) == 3 * 10 * spec.num_moe_layers
    assert set(np.unique(t.layer)) == set(spec.moe_layers)  # block indices, first layer dense
    assert np.array_equal(t.phase, (t.pos >= 4).astype(np.int8))
    s = t.sorted()
    assert s is t  # written in (seq_id, pos, layer) order
    # weights: sorted descending, not renormalised for this model (norm_topk_prob false)
    assert not spec.norm_topk_prob
    assert np.all(np.diff(t.weights, axis=1) <= 0)
    assert np.all(t.weights.sum(axis=1) < 1.0) and t.weights.sum(axis=1).mean() == pytest.approx(0.6, abs=0.05)
    prov = t.meta.provenance
    assert prov["source"] == "synth"
    assert prov["synth"]["seed"] == 0 and prov["synth"]["lookahead"][0]["accuracy"] == 0.9
    # a config rebuilt from the provenance makes the same routing
    rebuilt = SynthConfig(**{**prov["synth"], "lookahead": tuple(LookaheadSpec(**x) for x in prov["synth"]["lookahead"])})
    t2 = read_trace(synthesize(rebuilt, tmp_path / "again.parquet", progress=False))
    assert np.array_equal(t2.experts, t.experts)
    # the last MoE layer has no target: null lookahead rows
    look = t.lookahead("nx")
    last = t.layer == spec.moe_layers[-1]
    assert np.isnan(look[last]).all() and np.isfinite(look[~last]).all()


def test_normalised_model_weights_sum_to_one(tmp_path):
    t = make(tmp_path, model="mixtral-8x7b", sequences=2)
    assert np.allclose(t.weights.sum(axis=1), 1.0, atol=1e-5)
    top1 = make(tmp_path, "s.parquet", model="switch-base-8", sequences=2)
    assert top1.experts.shape[1] == 1 and np.all(top1.weights < 1)


def test_lookahead_does_not_change_routing(tmp_path):
    a = make(tmp_path, "a.parquet", seed=5)
    b = make(tmp_path, "b.parquet", seed=5, lookahead=("x=0.5", "y=0.9@2"))
    assert np.array_equal(a.experts, b.experts) and np.array_equal(a.weights, b.weights)


def test_sequences_of_different_lengths(tmp_path):
    t = make(tmp_path, sequences=12, prompt_len=10, gen_len=20, prompt_len_jitter=0.5, gen_len_jitter=0.9)
    seqs = t.meta.sequence_map()
    lengths = set()
    for sid, info in seqs.items():
        rows = t.seq_id == sid
        pos = np.unique(t.pos[rows])
        assert np.array_equal(pos, np.arange(info.prompt_tokens + info.generated_tokens))
        assert (t.phase[rows] == 0).sum() == info.prompt_tokens * len(t.layers)
        assert 5 <= info.prompt_tokens <= 15 and 1 <= info.generated_tokens <= 38
        lengths.add(info.prompt_tokens + info.generated_tokens)
    assert len(lengths) > 3


def test_long_sequence_is_chunked_and_batches_cover_everything(tmp_path, monkeypatch):
    import dali_sim.trace.synth as S

    monkeypatch.setattr(S, "ROWS_PER_CHUNK", 24 * 7)  # force several chunks per sequence / small batches
    monkeypatch.setattr(S, "ROWS_PER_WRITE", 50)
    t = make(tmp_path, sequences=3, prompt_len=6, gen_len=17, gen_len_jitter=0.5, reuse=1.0, **PLAIN)
    assert t.sorted() is t
    # reuse = 1 keeps the same experts across chunk boundaries: every token repeats the sequence's first
    ex = np.sort(t.experts.reshape(-1, len(t.layers), t.top_k), axis=2)
    seq = t.seq_id[:: len(t.layers)]
    assert len(seq) == t.meta.sequences[0].generated_tokens + 6 + t.meta.sequences[1].generated_tokens + 6 \
        + t.meta.sequences[2].generated_tokens + 6
    for sid in np.unique(seq):
        mine = ex[seq == sid]
        assert (mine == mine[0]).all()


# ---- statistics -------------------------------------------------------------------------------------
def test_reuse_tracks_parameter(tmp_path):
    measured, chance = [], []
    for r in (0.0, 0.3, 0.6, 0.9):
        t = make(tmp_path, f"r{r}.parquet", sequences=16, prompt_len=0, gen_len=96, reuse=r, crosslayer=0.0,
                 skew=0.0, **PLAIN)
        frame = S.reuse(t)
        measured.append(float(frame["decode"].mean()))
        chance.append(float(frame["indep_baseline"].mean()))
    assert np.all(np.diff(measured) > 0.1)
    for r, m, c in zip((0.0, 0.3, 0.6, 0.9), measured, chance):
        # a kept expert plus independent draws that hit the previous set by chance
        assert m == pytest.approx(r + (1 - r) * c, abs=0.03)
    assert chance[0] == pytest.approx(4 / 32, abs=0.01)


def test_prefill_reuse_separate(tmp_path):
    t = make(tmp_path, sequences=8, prompt_len=64, gen_len=64, reuse=0.8, prefill_reuse=0.0, skew=0.0,
             crosslayer=0.0, **PLAIN)
    r = S.reuse(t)
    assert r["decode"].mean() > 0.75
    assert r["prefill"].mean() < 0.2


@pytest.mark.parametrize("shape", ["lognormal", "zipf"])
def test_skew_raises_concentration(tmp_path, shape):
    ginis, ents = [], []
    for s in (0.0, 0.8, 1.6):
        t = make(tmp_path, f"s{s}.parquet", sequences=16, prompt_len=32, gen_len=32, skew=s, reuse=0.0,
                 crosslayer=0.0, popularity_shape=shape, **PLAIN)
        pop = S.popularity(t)
        ginis.append(float(pop["gini"].mean()))
        ents.append(float(pop["entropy_norm"].mean()))
    assert ginis[0] < 0.1 and ginis[0] < ginis[1] - 0.1 < ginis[2] - 0.2
    assert ents[0] > 0.99 and ents[0] > ents[1] > ents[2]


def test_crosslayer_raises_successor_predictability(tmp_path):
    hits = []
    for c in (0.0, 0.5, 1.0):
        t = make(tmp_path, f"c{c}.parquet", sequences=8, prompt_len=32, gen_len=32, skew=0.0, reuse=0.0,
                 crosslayer=c, **PLAIN)
        hits.append(float(successor_hit_rate(t).mean()))
    assert hits[0] < 0.3 and hits[1] > hits[0] + 0.25 and hits[2] > 0.95


def test_topic_spread_makes_sequences_differ(tmp_path):
    """The per-sequence factor: overlap with a token far back in the same sequence stays above chance."""
    far = {}
    for spread in (0.0, 2.0):
        t = make(tmp_path, f"z{spread}.parquet", sequences=16, prompt_len=0, gen_len=96, skew=0.0, reuse=0.0,
                 crosslayer=0.0, topic_spread=spread, drift_spread=0.0)
        far[spread] = float(decode_reuse(t, lag=48).mean())
    assert far[0.0] == pytest.approx(4 / 32, abs=0.02)
    assert far[2.0] > 0.2


@pytest.mark.parametrize("acc", [0.0, 0.5, 0.85, 1.0])
def test_lookahead_recall_matches_accuracy(tmp_path, acc):
    t = make(tmp_path, sequences=6, prompt_len=16, gen_len=16, lookahead=(f"p={acc}",))
    assert lookahead_recall(t, "p") == pytest.approx(acc, abs=0.02)


def test_lookahead_offset_two(tmp_path):
    t = make(tmp_path, model="olmoe-1b-7b", sequences=4, lookahead=(LookaheadSpec("far", 0.6, 2),))
    assert t.meta.predictors["far"].target_offset == 2
    assert lookahead_recall(t, "far") == pytest.approx(0.6, abs=0.03)
    look = t.lookahead("far")
    no_target = t.layer_index >= len(t.layers) - 2
    assert np.isnan(look[no_target]).all() and not np.isnan(look[~no_target]).any()


# ---- calibration ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spread", [0.0, 2.0])
def test_popularity_inversion_roundtrip(spread):
    """Sampling top-4 of 32 from the inverted popularity (with the per-token log-normal noise the generator
    adds) reproduces the inclusion frequencies."""
    rng = np.random.default_rng(0)
    freq = np.sort(rng.dirichlet(np.ones(32)))[::-1] * 4
    freq = np.minimum(freq, 0.9) * 4 / np.minimum(freq, 0.9).sum()
    p = popularity_from_frequencies(freq, spread)
    assert np.all(np.diff(p) <= 0) and p.sum() == pytest.approx(1)
    keys = rng.standard_exponential((40000, 32)) / (p * np.exp(spread * rng.standard_normal((40000, 32))))
    top = np.argpartition(keys, 3, axis=1)[:, :4]
    got = np.bincount(top.ravel(), minlength=32) / 40000
    assert np.abs(got - freq).max() < 0.03
    assert popularity_from_frequencies(np.array([0.5, 0.5, 0.0, 1.0]))[2] > 0  # never-seen stays possible


@needs_olmoe
def test_calibrate_from_olmoe_counts_reproduces_layer0_order(tmp_path):
    src = OLMOE_COUNTS / "olmoe/expert_counts/arxiv.json"
    t = make(tmp_path, model="olmoe-1b-7b", sequences=48, prompt_len=64, gen_len=0, popularity_from=str(src),
             **PLAIN)
    real = np.array([json.loads(src.read_text())[0].get(str(i), 0) for i in range(64)], dtype=float)
    got = counts(t)[0].astype(float)
    rank = lambda x: np.argsort(np.argsort(-x))  # noqa: E731
    spearman = np.corrcoef(rank(real), rank(got))[0, 1]
    assert spearman > 0.9
    top_real = set(np.argsort(-real)[:5])
    assert np.argmax(got) == np.argmax(real) and len(top_real & set(np.argsort(-got)[:5])) >= 4
    assert S.popularity(t)["gini"].iloc[0] == pytest.approx(gini_of_counts(real), abs=0.05)
    calib = t.meta.provenance["calibration"]
    assert calib["measured_layers"] == [0, 7, 15] and calib["filled_layers"]["3"] == 0
    assert calib["filled_layers"]["4"] == 7 and len(calib["sources"][0]["sha256"]) == 64


@needs_olmoe
def test_calibrate_with_default_topic_spread_keeps_order(tmp_path):
    src = OLMOE_COUNTS / "olmoe/expert_counts/arxiv.json"
    t = make(tmp_path, model="olmoe-1b-7b", sequences=96, prompt_len=32, gen_len=0, popularity_from=str(src))
    real = np.array([json.loads(src.read_text())[0].get(str(i), 0) for i in range(64)], dtype=float)
    got = counts(t)[0].astype(float)
    rank = lambda x: np.argsort(np.argsort(-x))  # noqa: E731
    assert np.corrcoef(rank(real), rank(got))[0, 1] > 0.8
    assert S.popularity(t)["gini"].iloc[0] == pytest.approx(gini_of_counts(real), abs=0.1)


@needs_olmoe
def test_calibrate_from_folder_and_mixtral(tmp_path):
    t = make(tmp_path, model="mixtral-8x7b", sequences=2, popularity_from=str(OLMOE_COUNTS / "mistral/expert_counts"))
    assert len(t.meta.provenance["calibration"]["sources"]) == 5
    with pytest.raises(ValueError, match=r"arxiv\.json: counts name 8 experts .* olmoe-1b-7b has 64"):
        synthesize(SynthConfig("olmoe-1b-7b", popularity_from=str(OLMOE_COUNTS / "mistral/expert_counts/arxiv.json")),
                   tmp_path / "bad.parquet", progress=False)
    with pytest.raises(ValueError, match="crosslayer"):
        load_counts(OLMOE_COUNTS / "mistral/expert_counts_crosslayer/arxiv.json",
                    SynthConfig("mixtral-8x7b").spec())


def test_calibrate_from_trace(tmp_path):
    src = make(tmp_path, "src.parquet", sequences=24, prompt_len=32, gen_len=32, skew=1.5, reuse=0.0, crosslayer=0.0,
               **PLAIN)
    t = make(tmp_path, "copy.parquet", sequences=24, prompt_len=32, gen_len=32, seed=9, reuse=0.0, crosslayer=0.0,
             popularity_from=str(src.path), **PLAIN)
    a, b = counts(src).astype(float), counts(t).astype(float)
    for layer in (0, 11, 23):
        assert np.corrcoef(a[layer], b[layer])[0, 1] > 0.9
    assert t.meta.provenance["calibration"]["kind"] == "trace"
    assert t.meta.provenance["calibration"]["measured_layers"] == list(range(24))
    with pytest.raises(ValueError, match="does not match 'mixtral-8x7b'"):
        synthesize(SynthConfig("mixtral-8x7b", popularity_from=str(src.path)), tmp_path / "x.parquet", progress=False)


def test_counts_json_layouts_and_errors(tmp_path):
    spec = SynthConfig("mixtral-8x7b").spec()
    good = tmp_path / "named.json"
    good.write_text(json.dumps({"layer_3": {str(i): 10 + i for i in range(8)}}))
    lc = load_counts(good, spec)
    assert list(lc.counts) == [3] and lc.counts[3][7] == 17
    bad = tmp_path / "bad.json"
    for doc, msg in [
        ([{"0": 1}] * 5, "a list of 5 layer counts"),
        ({"layer_40": {str(i): 1 for i in range(8)}}, "MoE layer 40"),
        ([{"x": 1}] * 3, "'x' is not an expert id"),
        ([{str(i): -1 for i in range(8)}] * 3, "non-negative integer"),
        ("hello", "expected a JSON list or object"),
    ]:
        bad.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=msg) as info:
            load_counts(bad, spec)
        assert str(bad) in str(info.value)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_counts(bad, spec)
    with pytest.raises(FileNotFoundError):
        load_counts(tmp_path / "missing.json", spec)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no \\*.json"):
        load_counts(tmp_path / "empty", spec)


# ---- configuration errors ---------------------------------------------------------------------------
@pytest.mark.parametrize("kw, msg", [
    (dict(reuse=1.5), r"reuse must lie in \[0, 1\], got 1.5"),
    (dict(reuse=-0.1), "reuse must lie in"),
    (dict(reuse=(0.1, 0.2)), "reuse has 2 values; give one, or one per MoE layer \\(24\\)"),
    (dict(prefill_reuse=float("nan")), "prefill_reuse must lie in"),
    (dict(crosslayer=2), "crosslayer must lie in"),
    (dict(prompt_len=0, gen_len=0), "prompt_len \\+ gen_len must be at least 1"),
    (dict(gen_len=-1), "gen_len must be >= 0"),
    (dict(sequences=0), "sequences must be >= 1"),
    (dict(sequences=2.5), "sequences must be an integer"),
    (dict(seed=-3), "seed must be >= 0"),
    (dict(skew=-1), "skew must lie in"),
    (dict(gen_len_jitter=1.5), "gen_len_jitter must lie in"),
    (dict(weight_alpha=0), "weight_alpha must be > 0"),
    (dict(weight_total=1.0), "weight_total must lie in \\(0, 1\\)"),
    (dict(drift_halflife=0), "drift_halflife must be > 0"),
    (dict(lookahead=("p=1.2",)), r"lookahead 'p': accuracy must lie in \[0, 1\], got 1.2"),
    (dict(lookahead=("p",)), "expected NAME=ACCURACY"),
    (dict(lookahead=("p=0.5@0",)), "target offset must be an integer >= 1"),
    (dict(lookahead=("p=0.5@24",)), "leaves no target layer"),
    (dict(lookahead=("p=0.5", "p=0.6")), "given more than once"),
    (dict(model="nope"), "unknown model preset 'nope'"),
    (dict(popularity_shape="pareto"), "popularity_shape must be one of"),
])
def test_bad_parameters(kw, msg):
    args = {"model": "gpt-oss-20b", **kw}
    with pytest.raises(ValueError, match=msg):
        SynthConfig(**args)


def test_per_layer_probabilities(tmp_path):
    reuse = tuple([0.0] * 12 + [0.95] * 12)
    t = make(tmp_path, sequences=8, prompt_len=0, gen_len=64, reuse=reuse, skew=0.0, crosslayer=0.0, **PLAIN)
    r = decode_reuse(t)
    assert r[:12].mean() < 0.2 and r[12:].mean() > 0.9


# ---- command line -----------------------------------------------------------------------------------
def test_cli_writes_trace_and_reports(tmp_path):
    out = tmp_path / "cli.parquet"
    runner = CliRunner()
    args = ["--model", "mixtral-8x7b", "--sequences", "2", "--prompt-len", "3", "--gen-len", "4", "--seed", "7",
            "--reuse", "0.5", "--lookahead", "next=0.8", "--lookahead", "far=0.5@2", "-o", str(out)]
    res = runner.invoke(synth, args)
    assert res.exit_code == 0, res.output
    assert "448 rows" in res.output  # 2 x 7 tokens x 32 layers
    t = read_trace(out)
    assert sorted(t.meta.predictors) == ["far", "next"] and t.meta.provenance["synth"]["reuse"] == 0.5
    first = out.read_bytes()
    assert runner.invoke(synth, args + ["--quiet"]).output == ""
    assert out.read_bytes() == first


def test_cli_bad_input_is_a_clean_error(tmp_path):
    runner = CliRunner()
    res = runner.invoke(synth, ["--model", "gpt-oss-20b", "--reuse", "1.5", "-o", str(tmp_path / "x.parquet")])
    assert res.exit_code != 0 and isinstance(res.exception, ValueError)
    assert "reuse must lie in [0, 1]" in str(res.exception)
    assert not (tmp_path / "x.parquet").exists()
    res = runner.invoke(synth, ["--model", "gpt-oss-20b", "--reuse", "a,b", "-o", str(tmp_path / "x.parquet")])
    assert res.exit_code == 2 and "--reuse" in res.output


def test_cli_through_group_gives_error_line(tmp_path):
    """Registered under a UserErrorGroup (as `dali trace` is), bad input becomes one `Error:` line."""
    import click

    from dali_sim.cli.common import UserErrorGroup

    @click.group(cls=UserErrorGroup)
    def group():
        pass

    group.add_command(synth)
    res = CliRunner().invoke(group, ["synth", "--model", "gpt-oss-20b", "--lookahead", "p=2",
                                     "-o", str(tmp_path / "x.parquet")])
    assert res.exit_code != 0 and "Error: lookahead 'p': accuracy must lie in [0, 1], got 2.0" in res.output


def test_partial_file_on_failure(tmp_path, monkeypatch):
    import dali_sim.trace.synth as S

    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(S, "_weights", boom)
    with pytest.raises(RuntimeError):
        synthesize(SynthConfig("mixtral-8x7b", sequences=1, prompt_len=1, gen_len=1), tmp_path / "p.parquet",
                   progress=False)
    assert not (tmp_path / "p.parquet").exists() and (tmp_path / "p.parquet.partial").exists()
    with pytest.raises(TraceError, match="partial"):
        read_trace(tmp_path / "p.parquet.partial")


def test_defaults_resemble_gpt_oss(tmp_path):
    """Defaults vs the real GPT-OSS-20B decode statistics (12 generations, ~230 tokens each; see the doc)."""
    stats = {"lag1": [], "lag8": [], "lag64": [], "chance": [], "gini": [], "succ": []}
    for seed in range(3):
        t = make(tmp_path, f"d{seed}.parquet", sequences=12, prompt_len=0, gen_len=230, seed=seed)
        for lag in (1, 8, 64):
            stats[f"lag{lag}"].append(decode_reuse(t, lag=lag).mean())
        stats["chance"].append(S.reuse(t)["indep_baseline"].mean())
        stats["gini"].append(S.popularity(t)["gini"].mean())
        stats["succ"].append(successor_hit_rate(t).mean())
    m = {k: float(np.mean(v)) for k, v in stats.items()}
    real = {"lag1": 0.421, "lag8": 0.346, "lag64": 0.306, "chance": 0.204, "gini": 0.434}
    for key, value in real.items():
        assert m[key] == pytest.approx(value, abs=0.04), key
    assert m["succ"] == pytest.approx(0.659, abs=0.1)  # synthetic successors are a little too faithful
