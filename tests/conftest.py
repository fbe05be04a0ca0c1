"""Shared fixtures: tiny model specs, paths to the shared validation traces."""

from __future__ import annotations

from pathlib import Path

import json
import math

import numpy as np
import pandas as pd
import pytest

from dali_sim.hardware.contention import lane_combinations
from dali_sim.hardware.measured import ModelShape
from dali_sim.policies.systems import system_names
from dali_sim.sim import simulate
from dali_sim.sim.counters import COUNTERS
from dali_sim.models.spec import AttentionSpec, ModelSpec
from dali_sim.workload.profiling import ProfileSpec

#: the whole trace evaluated, frequency choices seeing it (hindsight, declared in every result's manifest): for
#: tests that pin numbers on a hand-written trace or compare two runtimes on identical inputs; runs that must
#: not see their test data use the default split (dali_sim.workload.profiling, tests/test_profiling.py)
WHOLE = ProfileSpec(share=0.0)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "validation-traces"


def tiny_model(num_layers: int = 3, moe_layers=(0, 1, 2), num_experts: int = 4, top_k: int = 2) -> ModelSpec:
    return ModelSpec(
        name="tiny-moe", family="test", num_layers=num_layers, moe_layers=tuple(moe_layers),
        num_experts=num_experts, top_k=top_k, hidden_size=8, expert_intermediate_size=16,
        dense_intermediate_size=16, vocab_size=16,
        attention=AttentionSpec(kind="gqa", num_heads=1, num_kv_heads=1, head_dim=8),
    )


#: the hand-worked engine examples (test_sim_overlap.py, test_sim_prefetch.py): one sequence,
#: 2 MoE layers, 3 experts, top-2; rows are (pos, phase, layer-0 experts, layer-1 experts)
OVERLAP_MODEL = tiny_model(num_layers=2, moe_layers=(0, 1), num_experts=3, top_k=2)
OVERLAP_ROWS = [(0, "prefill", [0, 1], [2, 0]), (1, "prefill", [0, 2], [2, 1]), (2, "decode", [1, 0], [1, 2])]


@pytest.fixture(scope="session")
def overlap_trace(tmp_path_factory):
    from dali_sim.trace import TraceWriter, read_trace

    path = tmp_path_factory.mktemp("overlap") / "overlap.parquet"
    with TraceWriter(path, OVERLAP_MODEL, provenance={"source": "hand-written", "command": "tests/conftest.py"}) as w:
        for pos, phase, l0, l1 in OVERLAP_ROWS:
            for layer, experts in ((0, l0), (1, l1)):
                w.write(seq_id=0, phase=phase, pos=pos, layer=layer, experts=np.array([experts]),
                        weights=np.array([[0.5, 0.5]], np.float32))
    return read_trace(path)


@pytest.fixture(scope="session")
def round_profile(tmp_path_factory):
    """GPU 1 s per token, CPU 3 s per token, 2 s per expert copy, dense part 0.5 s (the overlap model)."""
    return round_number_profile(tmp_path_factory.mktemp("hw") / "round.json", OVERLAP_MODEL)


@pytest.fixture
def tiny() -> ModelSpec:
    return tiny_model()


@pytest.fixture
def shared() -> Path:
    if not SHARED.exists():
        pytest.skip(f"{SHARED} is not present (CI puts ../shared beside the clone)")
    return SHARED


def random_rows(model: ModelSpec, seqs: int, tokens: int, seed: int = 0):
    """Complete rows for ``seqs`` sequences of ``tokens`` tokens (half prefill), all MoE layers."""
    rng = np.random.default_rng(seed)
    layers = np.asarray(model.moe_layers)
    n = seqs * tokens * len(layers)
    seq = np.repeat(np.arange(seqs), tokens * len(layers))
    pos = np.tile(np.repeat(np.arange(tokens), len(layers)), seqs)
    layer = np.tile(layers, seqs * tokens)
    phase = np.where(pos < tokens // 2, 0, 1)
    experts = np.argsort(rng.random((n, model.num_experts)), axis=1)[:, : model.top_k]
    weights = rng.dirichlet(np.ones(model.top_k), size=n).astype(np.float32)
    weights = -np.sort(-weights, axis=1)
    return dict(seq_id=seq, phase=phase, pos=pos, layer=layer, experts=experts, weights=weights)


def round_number_profile(path: Path, model, *, gpu=(1.0, 2.0), cpu=(3.0, 6.0), xfer=2.0, dense=0.5, d2h=0.0,
                         contention: dict | None = None, host: dict | None = None,
                         lanes: dict | None = None, lane_wake: dict | None = None) -> Path:
    """A measured profile of round numbers for ``model``'s shape (all exact in binary floating point):
    GPU expert = 1 s per token (table 1 s at 1 token, 2 s at 2, extended linearly), CPU expert = 3 s
    per token, one expert's copy = ``xfer`` s, dense part of a layer = ``dense`` s at any size, an
    activation hand-over ``d2h`` s; ``contention`` (slowdowns, default none) and ``host`` (the executor's
    host costs, default none) replace the neutral tables; ``lanes``: a grouped call's fixed part per lane;
    ``lane_wake``: what a lane's call costs more after its thread slept."""
    shape = ModelShape.of(model)
    data = {
        "kind": "measured", "format_version": 2, "name": "simple-numbers",
        "description": "round numbers for hand-computed tests (not a measurement)",
        "gpu": {"name": "test GPU", "memory_gib": 24}, "cpu": {"name": "test CPU", "memory_gib": 64},
        "link": {"name": "test link"},
        "model": {f: getattr(shape, f) for f in ModelShape.__dataclass_fields__},
        "tables": {
            "gpu_expert": {"tokens": [1, 2], "seconds": list(gpu)},
            "cpu_expert": {"tokens": [1, 2], "seconds": list(cpu)},
            "h2d": {"bytes": [1, model.expert_bytes], "seconds": [xfer, xfer]},
            "d2h": {"bytes": [1, model.expert_bytes], "seconds": [d2h, d2h]},
            "gpu_dense": {"tokens": [1, 2], "context_lens": [0], "seconds": [[dense, dense]]},
            "cpu_dense": {"tokens": [1, 2], "context_lens": [0], "seconds": [[dense, dense]]},
        },
        "contention": {key: {lane: (contention or {}).get(key, {}).get(lane, 1.0) for lane in key.split("+")}
                       for key in lane_combinations()},
        "host": {"layer_s": 0.0, "gpu_expert_s": 0.0, "cpu_expert_s": 0.0, "copy_s": 0.0,
                 "decision_s": dict.fromkeys([*system_names(), "split"], 0.0), **(host or {})},
        "provenance": {"command": "tests (hand-computed timelines)", "date": "2025-01-01", "versions": {}},
    }
    if lanes is not None:
        data["lanes"] = {"gpu": 0.0, "cpu": 0.0, **lanes}
    if lane_wake is not None:
        data["lane_wake"] = dict(lane_wake)
    path.write_text(json.dumps(data))
    return path


TIMING_KEYS = {"makespan_s", "prefill_s", "decode_s", "prefill_tokens_per_s", "decode_tokens_per_s",
               "prefill_throughput", "decode_throughput", "ttft_s", "tpot_s", "busy", "events", "handoffs",
               "prefetches_waited"}


def feed_online(trace, system: str, overrides=None, *, batch: int, frequencies: bool = True):
    """Feed ``trace``'s routing and lookahead columns into an ``OnlineWorkload`` step by step and layer by layer,
    as ``dali exec generate`` feeds it, and plan every layer with ``system``'s controller (frequencies: the
    trace's, or uniform). Returns (the online workload, the
    trace's workload, the plans in order)."""
    from dali_sim.hardware.cost import CostModel
    from dali_sim.hardware.profile import load_profile
    from dali_sim.policies import resolve_system
    from dali_sim.runtime.controller import Controller
    from dali_sim.runtime.memory import plan_memory
    from dali_sim.workload import Workload, WorkloadConfig
    from dali_sim.workload.online import OnlineWorkload, check_online

    ref = Workload(trace, WorkloadConfig(batch))
    sysconf = resolve_system(system, overrides, trace.model)
    check_online(sysconf)
    placement, cache, prefetch = (c.build() for c in (sysconf.placement, sysconf.cache, sysconf.prefetch))
    profile = load_profile("rtx3090-epyc7532")
    L, E = ref.num_layers, ref.num_experts
    mem = plan_memory(trace.model, sysconf.memory, profile.gpu_memory_bytes, ref.max_batch_context,
                      required=placement.required_capacities(L, E))
    names = prefetch.required_predictors()
    online = OnlineWorkload(trace.model, names, frequencies=ref.frequencies() if frequencies else None,
                            config=WorkloadConfig(batch))
    # the system's implementation, as simulate() prices it (policies such as hybrimoe's prefetch read the costs)
    costs = CostModel(profile, trace.model, implementation=sysconf.implementation, system=sysconf.name)
    ctl = Controller(online, costs, placement, cache, prefetch, mem.capacities, cache_init=sysconf.memory.cache_init,
                     prefetch_slots=mem.prefetch_slots, staging_slots=sysconf.memory.staging_slots)
    logits = {n: ref._sorted.lookahead(n) for n in names}
    plans = []
    for step in range(ref.num_steps):
        seq, pos = ref.step_positions(step)
        s = online.begin_step("prefill" if ref.step_phase[step] == 0 else "decode", len(seq),
                              batch=int(ref.step_batch[step]), seq_ids=seq, positions=pos)
        assert s == step
        tokens = ref.step_token_ids(step)
        for layer in range(L):
            ids, _ = ref.routing(step, layer)
            pred = {n: logits[n][tokens * L + layer] for n in names if layer + online.predictor_offsets[n] < L}
            online.set_layer(layer, ids, pred)
            plans.append(ctl.plan(step, layer))
    return online, ref, plans


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def simulate_both(trace, system, overrides=None, **kw):
    """The SimPy path and the no-timing path on the same inputs; asserts that every count agrees
    (summary and per layer) and returns (timed, counted). On hand-written traces: the whole trace is
    evaluated unless ``profiling`` says otherwise (:data:`WHOLE`)."""
    kw.setdefault("profiling", WHOLE)
    timed = simulate(trace, system, overrides=overrides, **kw)
    fast = simulate(trace, system, overrides=overrides, timing=False, **kw)
    assert set(fast.summary) == set(timed.summary) - TIMING_KEYS
    for k, v in fast.summary.items():
        assert _same(v, timed.summary[k]), (k, v, timed.summary[k])
    assert list(fast.per_layer.columns) == list(COUNTERS) + ["hit_rate"]
    pd.testing.assert_frame_equal(fast.per_layer, timed.per_layer[fast.per_layer.columns])
    assert "makespan_s" in timed.summary and "makespan_s" not in fast.summary
    assert fast.config["timing"] is False and fast.manifest["timing"] is False
    assert fast.config["system"] == timed.config["system"]
    return timed, fast


def write_hand_trace(path: Path, model: ModelSpec, rows, lookahead=None, predictors=()) -> Path:
    """A hand-listed trace. ``rows``: (seq_id, pos, phase, [experts of MoE layer 0, of layer 1, ...]),
    equal gate weights; ``predictors``: lookahead column names (target offset 1); ``lookahead``:
    {name: {(seq_id, pos, layer ordinal): logits}} (missing rows are null)."""
    from dali_sim.trace import PredictorInfo, TraceWriter

    infos = [PredictorInfo(name, 1, "hand-written") for name in predictors]
    with TraceWriter(path, model, provenance={"source": "hand-written", "command": "tests"}, predictors=infos) as w:
        for seq, pos, phase, per_layer in rows:
            for ordinal, experts in enumerate(per_layer):
                k = len(experts)
                look = None
                if infos:
                    look = {}
                    for info in infos:
                        logits = (lookahead or {}).get(info.name, {}).get((seq, pos, ordinal))
                        row = np.full(model.num_experts, np.nan, np.float32) if logits is None else \
                            np.asarray(logits, np.float32)
                        look[info.name] = row[None, :]
                w.write(seq_id=seq, phase=phase, pos=pos, layer=model.moe_layers[ordinal],
                        experts=np.array([experts]), weights=np.full((1, k), 1.0 / k, np.float32), lookahead=look)
    return path


def demand_rows(demand):
    """One sequence, one token per step (pos 0 prefill, then decode), one MoE layer, top-1."""
    return [(0, pos, "prefill" if pos == 0 else "decode", [[e]]) for pos, e in enumerate(demand)]


@pytest.fixture
def one_torch_thread():
    """Tiny matrices: one torch thread is fastest on a busy machine (the count is restored after the test)."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
