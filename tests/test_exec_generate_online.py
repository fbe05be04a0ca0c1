"""The online workload (torch-free): fed step by step and layer by layer, it drives the same controller
to exactly the counts of a trace-driven replay; it refuses what is not known yet, and bounds."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dali_sim.policies import resolve_system, system_names
from dali_sim.sim import simulate
from dali_sim.sim.counters import COUNTERS, PlanCounters
from dali_sim.trace import read_trace
from dali_sim.trace.synth import SynthConfig, synthesize
from dali_sim.workload import Workload, WorkloadConfig
from dali_sim.workload.online import OnlineWorkload, check_online, frequencies_from_trace, predictor_offset

from conftest import WHOLE, feed_online, tiny_model

BATCH = 2
BOUNDS = {"oracle-heuristic", "lower-bound"}
ONLINE = [s for s in system_names() if s not in BOUNDS]
OVER = {"memory": {"cache_experts": "1"}}


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    """Mixtral-shaped routing (prefill + decode) with every lookahead column a preset reads."""
    path = tmp_path_factory.mktemp("online") / "mix.parquet"
    synthesize(SynthConfig(model="mixtral-8x7b", sequences=3, prompt_len=5, gen_len=5, seed=11,
                           prompt_len_jitter=0.4, gen_len_jitter=0.4,
                           lookahead=("residual=0.9", "next-gate=0.7", "gate2=0.6@2", "gate3=0.5@3")), path)
    return read_trace(path)


def _over(system):
    return None if system in ("llamacpp", "moe-lightning") else OVER


def run_online(trace, system, overrides=None, *, frequencies=True):
    """Feed ``trace``'s routing into an OnlineWorkload as a running model would, and plan every layer."""
    online, ref, plans = feed_online(trace, system, overrides, batch=BATCH, frequencies=frequencies)
    counters = PlanCounters(ref.num_layers)
    for plan in plans:
        counters.add(plan)
    return online, ref, counters


@pytest.mark.parametrize("system", ONLINE)
def test_online_feeding_gives_the_counts_of_the_trace_replay(mix, system):
    online, ref, counters = run_online(mix, system, _over(system))
    sim = simulate(mix, system, batch_size=BATCH, timing=False, overrides=_over(system), profiling=WHOLE)
    totals = counters.totals()
    assert totals["activated"] > 0
    for key in COUNTERS:
        assert totals[key] == sim.summary[key], key
    pd.testing.assert_frame_equal(counters.frame(mix.model.moe_layers), sim.per_layer[list(COUNTERS)])
    # the step and sequence tables are the trace workload's
    for attr in ("step_phase", "step_tokens", "step_batch", "step_kv"):
        np.testing.assert_array_equal(getattr(online, attr), getattr(ref, attr), err_msg=attr)
    np.testing.assert_allclose(online.step_context, ref.step_context)
    pd.testing.assert_frame_equal(online.sequences, ref.sequences, check_dtype=False)
    assert online.describe() == ref.describe()
    np.testing.assert_array_equal(online.observed_frequencies(), ref.frequencies())


def test_prefetching_presets_really_prefetch_from_online_predictions(mix):
    for system in ("dali", "mixtral-offloading-best", "moe-lightning-best"):
        _, _, counters = run_online(mix, system, _over(system))
        assert counters.totals()["prefetch_issued"] > 0, system
    _, _, c = run_online(mix, "hybrimoe", {"memory": {"cache_experts": "1"}, "prefetch": {"min_gain": "0"}})
    assert c.totals()["prefetch_issued"] > 0


def test_uniform_frequencies_by_default(mix):
    online, _, _ = run_online(mix, "gpu-static", OVER, frequencies=False)
    assert (online.frequencies() == 1).all() and online.frequencies_source.startswith("uniform")
    assert online.frequencies().shape == (mix.model.num_moe_layers, mix.model.num_experts)


def test_what_is_not_known_yet_is_an_error():
    model = tiny_model(num_layers=3, moe_layers=(0, 1, 2), num_experts=4, top_k=2)
    w = OnlineWorkload(model, ("next-gate", "gate2"))
    assert w.predictor_offsets == {"next-gate": 1, "gate2": 2} and tuple(w.predicted) == ("next-gate", "gate2")
    with pytest.raises(ValueError, match="no step is open"):
        w.set_layer(0, np.array([[0, 1]]))
    assert w.begin_step("prefill", 2, seq_ids=np.array([7, 7]), positions=np.array([0, 1])) == 0
    with pytest.raises(ValueError, match="not known"):
        w.activated(0, 0)
    ids = np.array([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="lacks the 'gate2'"):
        w.set_layer(0, ids, {"next-gate": np.array([[3, 2], [3, 0]])})
    with pytest.raises(ValueError, match="expects MoE layer 0"):
        w.set_layer(1, ids)
    with pytest.raises(ValueError, match=r"expected \(2, 2\) expert ids"):
        w.set_layer(0, np.array([[0, 1]]))
    with pytest.raises(ValueError, match="0..3"):
        w.set_layer(0, np.array([[0, 4], [1, 2]]))
    with pytest.raises(ValueError, match="not declared"):
        w.set_layer(0, ids, {"residual": ids})
    logits = np.array([[0.0, 1.0, 3.0, 2.0], [np.nan] * 4])  # the second token predicts nothing
    w.set_layer(0, ids, {"next-gate": np.array([[3, 2], [3, 0]]), "gate2": logits})
    e, c, r = w.activated(0, 0)
    assert e.tolist() == [1, 0, 2] and c.tolist() == [2, 1, 1] and r.tolist() == [0, 0, 1]  # touch order
    assert w.predicted_counts("next-gate", 0, 1).tolist() == [1, 0, 1, 2]
    assert w.predicted_ranks("next-gate", 0, 1).tolist() == [1, 2, 1, 0]
    assert w.predicted_counts("gate2", 0, 2).tolist() == [0, 0, 1, 1]  # top-2 of the logits: 2 then 3
    assert w.predicted_ranks("gate2", 0, 2).tolist() == [2, 2, 0, 1]
    assert w.predicted_counts("next-gate", 0, 0).tolist() == [0, 0, 0, 0]  # nothing predicts layer 0
    with pytest.raises(ValueError, match="made at layer 1"):
        w.predicted_counts("next-gate", 0, 2)  # layer 1 has not run yet
    with pytest.raises(KeyError):
        w.predicted_counts("residual", 0, 1)
    with pytest.raises(ValueError, match="ended after 1 of 3"):
        w.begin_step("decode", 1)
    w.set_layer(1, ids, {"next-gate": ids})
    with pytest.raises(ValueError, match="would predict MoE layer 3"):
        w.set_layer(2, ids, {"next-gate": ids})
    w.set_layer(2, ids)
    assert w.routed_layers == 3
    with pytest.raises(ValueError, match="not known"):
        w.activated(1, 0)
    w.begin_step("decode", 1, batch=0, seq_ids=np.array([7]), positions=np.array([2]))
    with pytest.raises(ValueError, match="not known"):
        w.activated(0, 0)  # only the current step is readable
    seqs = w.sequences
    assert seqs.to_dict("records") == [{"seq_id": 7, "batch": 0, "prompt_tokens_traced": 2, "decode_tokens": 1,
                                        "first_prefill_step": 0, "last_prefill_step": 0, "first_decode_step": 1,
                                        "last_decode_step": 1}]
    assert w.step_kv.tolist() == [2, 3] and w.step_tokens.tolist() == [2, 1] and w.step_phase.tolist() == [0, 1]


def test_bad_inputs():
    model = tiny_model()
    with pytest.raises(ValueError, match="cannot be computed while the model runs"):
        OnlineWorkload(model, ("oracle-gate",))
    assert predictor_offset("gate3") == 3 and predictor_offset("residual") == 1
    with pytest.raises(ValueError):
        predictor_offset("gate1")
    with pytest.raises(ValueError, match=r"frequencies must be \(3, 4\)"):
        OnlineWorkload(model, frequencies=np.ones((2, 4)))
    w = OnlineWorkload(model)
    with pytest.raises(ValueError, match="phase"):
        w.begin_step("generate", 1)
    with pytest.raises(ValueError, match="at least one token"):
        w.begin_step("decode", 0)


@pytest.mark.parametrize("family,policy,kind", [("placement", "optimal", "a bound"), ("cache", "optimal", "a bound"),
                                                 ("cache", "belady", "an oracle heuristic"),
                                                 ("prefetch", "oracle", "an oracle heuristic")])
def test_bounds_are_refused_naming_the_policy(family, policy, kind):
    sysconf = resolve_system("gpu-lru", {family: {"policy": policy}, "memory": {"prefetch_slots": "2"}})
    with pytest.raises(ValueError, match=f"{family} policy '{policy}' is {kind}"):
        check_online(sysconf)
    with pytest.raises(ValueError, match="policy 'optimal' is a bound"):
        check_online(resolve_system("oracle-heuristic"))
    with pytest.raises(ValueError, match="'lower-bound' is a time bound computed by the simulator"):
        check_online(resolve_system("lower-bound"))
    for name in ONLINE:
        check_online(resolve_system(name))


def test_frequencies_from_a_trace(mix, tmp_path):
    freq = frequencies_from_trace(mix.path, mix.model)
    np.testing.assert_array_equal(freq, Workload(mix, WorkloadConfig()).frequencies())
    with pytest.raises(ValueError, match="--profile-trace"):
        frequencies_from_trace(mix.path, tiny_model())


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 6), k=st.integers(1, 3), E=st.integers(3, 7))
def test_online_segment_is_the_trace_workloads_rule(data, n, k, E):
    """The online workload orders one (step, layer) as the trace workload's builder does: same experts in
    touch order, workloads, best ranks and dtypes."""
    from dali_sim.workload.builder import _sparse_counts

    ids = np.array([data.draw(st.permutations(range(E)))[:k] for _ in range(n)], dtype=np.int64)
    w = OnlineWorkload(tiny_model(num_experts=E, top_k=k))
    got = w._segment(ids)
    zeros = np.zeros(n * k, np.int64)
    sc = _sparse_counts(zeros, zeros, ids.reshape(-1), np.tile(np.arange(k, dtype=np.int8), n), 1, 1, E)
    for a, b in zip(got, (sc.expert, sc.count, sc.rank)):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(-3, 40)), min_size=1, max_size=30))
def test_begin_step_context_kv_and_sequences_follow_the_array_rule(tokens):
    """begin_step's one pass over the tokens: the mean context, the KV tokens (per sequence its last position,
    at least -1, plus one) and the per-sequence counts of the array operations it replaces."""
    model = tiny_model(num_layers=1, moe_layers=(0,), num_experts=4, top_k=2)
    w = OnlineWorkload(model)
    seq = np.array([s for s, _ in tokens], np.int64)
    pos = np.array([p for _, p in tokens], np.int64)
    w.begin_step("prefill", len(tokens), batch=2, seq_ids=seq, positions=pos)
    sids, inverse, per_seq = np.unique(seq, return_inverse=True, return_counts=True)
    last = np.full(len(sids), -1, np.int64)
    np.maximum.at(last, inverse, pos)
    assert w.step_context[0] == float((pos + 1).mean())
    assert w.step_kv[0] == int(last.sum()) + len(sids)
    seqs = w.sequences
    assert seqs["seq_id"].tolist() == sids.tolist()
    assert seqs["prompt_tokens_traced"].tolist() == per_seq.tolist() and (seqs["batch"] == 2).all()
