"""Property tests of the cache semantics (docs/policies.md) for every registered cache policy, and of
the placement contract for every registered placement, driven through the real Controller over random
small traces (written with TraceWriter), random capacities, cache inits and batch sizes.

Cache invariants checked after every (step, layer) plan, against our own copy of the contents taken
before the plan:
* the layer holds at most its capacity (and the controller's count agrees with its contents);
* an activated expert is a hit iff it was resident at the layer start;
* victims were resident and are never experts activated in the same step;
* with gpu-only placement every miss is offered: it is admitted or staged, never both;
* contents after = contents before + admitted - evicted, then the swaps (in, out) applied in order.

Placement invariants: the mask has one entry per activated expert (the activated experts are unique
and their workloads add up to the step's tokens x top-k, and over the run to the trace's counts),
``on_gpu`` agrees with the source, and a placement with ``may_fetch = False`` never copies on demand.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import round_number_profile, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dali_sim.hardware.cost import CostModel
from dali_sim.hardware.profile import load_profile
from dali_sim.policies import CACHES, PLACEMENTS, PREFETCHERS
from dali_sim.runtime.future import FutureDemand
from dali_sim.runtime.controller import CPU, FETCH, HIT, PREFETCHED, Controller
from dali_sim.trace import TraceWriter, read_trace
from dali_sim.workload.builder import Workload, WorkloadConfig

E, TOP_K, LAYERS = 5, 2, 3
MODEL = tiny_model(num_layers=LAYERS, moe_layers=tuple(range(LAYERS)), num_experts=E, top_k=TOP_K)
INITS = ("empty", "random", "frequency")
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_TMP = tempfile.TemporaryDirectory(prefix="dali-cache-props-")
TMP = Path(_TMP.name)
# a few cost models: copies cheap, as expensive as 2 GPU tokens, and dear
COSTS = [CostModel(load_profile(round_number_profile(TMP / f"p{x}.json", MODEL, xfer=x)), MODEL)
         for x in (0.5, 2.0, 8.0)]


# ---- random traces -------------------------------------------------------------------------------
@st.composite
def traces(draw):
    """1..3 sequences of 1..5 tokens (a random prefill/decode split), random top-k per (token, layer)."""
    seqs = []
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 5))
        prefill = draw(st.integers(0, n))
        toks = [draw(st.lists(st.permutations(range(E)).map(lambda p: p[:TOP_K]), min_size=LAYERS,
                              max_size=LAYERS)) for _ in range(n)]
        seqs.append((prefill, toks))
    return seqs


_counter = iter(range(10**9))


def write(seqs) -> Path:
    path = TMP / f"t{next(_counter)}.parquet"
    with TraceWriter(path, MODEL, provenance={"source": "hypothesis", "command": "tests/test_cache_properties.py"}) as w:
        for seq_id, (prefill, toks) in enumerate(seqs):
            for pos, per_layer in enumerate(toks):
                for layer, experts in enumerate(per_layer):
                    w.write(seq_id=seq_id, phase="prefill" if pos < prefill else "decode", pos=pos, layer=layer,
                            experts=np.array([experts]), weights=np.full((1, TOP_K), 1.0 / TOP_K, np.float32))
    return path


# ---- per-policy configurations -------------------------------------------------------------------
def cache_setups(name: str):
    """(config overrides, allowed cache inits) strategy for a cache policy."""
    if name == "dali-window":
        return st.tuples(st.fixed_dictionaries({"w": st.integers(1, 3), "u": st.integers(0, 3)}), st.sampled_from(INITS))
    if name == "lfu":
        return st.tuples(st.fixed_dictionaries({"count": st.sampled_from(["tokens", "activations"])}),
                         st.sampled_from(INITS))
    if name == "hybrimoe-mrs":
        return st.tuples(st.fixed_dictionaries({"a": st.sampled_from([0.25, 0.5, 1.0])}), st.sampled_from(INITS))
    if name == "static":
        return st.tuples(st.just({}), st.sampled_from(["frequency", "random"]))
    return st.tuples(st.just({}), st.sampled_from(INITS))  # a policy registered later: defaults


def build(registry, name: str, overrides: dict):
    cls = registry.get(name)
    return cls(cls.Config().with_overrides(overrides, "x") if overrides else None)


def controller(path, batch, placement, cache, capacities, init, *, prefetch=None, prefetch_slots=0,
               staging_slots=2, costs=0, seed=0) -> Controller:
    w = Workload(read_trace(path), WorkloadConfig(batch, 0))
    return Controller(w, COSTS[costs], placement, cache, prefetch or PREFETCHERS.get("none")(),
                      np.asarray(capacities), cache_init=init, prefetch_slots=prefetch_slots,
                      staging_slots=staging_slots, seed=seed,
                      future=FutureDemand.from_workload(w) if cache.needs_future else None)


# ---- cache properties ----------------------------------------------------------------------------
def check_cache_plan(ctl: Controller, before: np.ndarray, plan) -> None:
    layer = plan.layer
    after = ctl.resident[layer]
    experts = plan.experts.tolist()
    cap = int(ctl.capacities[layer])
    assert int(after.sum()) <= cap
    assert int(ctl.n_resident[layer]) == int(after.sum())
    # hits: iff resident at the layer start
    assert plan.hit.tolist() == [bool(before[e]) for e in experts]
    assert ((plan.source == HIT) == plan.hit).all()  # gpu-only: every hit runs from the cache
    # victims: resident before, never activated in the step, each once
    assert len(set(plan.evicted)) == len(plan.evicted)
    for v in plan.evicted:
        assert before[v] and v not in experts
    # gpu-only: every miss is offered; admitted or staged, exactly one of them
    miss = ~plan.hit
    assert (plan.source[miss] == FETCH).all()
    assert not (plan.admitted & plan.hit).any() and not (plan.staged & plan.hit).any()
    assert ((plan.admitted ^ plan.staged) == miss).all()
    # contents: before + admitted - evicted, then swaps in order
    want = before.copy()
    want[plan.experts[plan.admitted]] = True
    want[plan.evicted] = False
    n_mid = int(want.sum())
    assert n_mid == int(before.sum()) + int(plan.admitted.sum()) - len(plan.evicted)
    assert n_mid <= cap
    for e_in, e_out in plan.swaps:
        assert not want[e_in] and want[e_out]
        want[e_in], want[e_out] = True, False
    assert np.array_equal(after, want)
    assert int(after.sum()) == int(before.sum()) + int(plan.admitted.sum()) - len(plan.evicted)


@pytest.mark.parametrize("name", CACHES.names())
@SETTINGS
@given(data=st.data(), seqs=traces(), batch=st.integers(1, 3), costs=st.integers(0, len(COSTS) - 1),
       seed=st.integers(0, 3))
def test_cache_semantics(name, data, seqs, batch, costs, seed):
    overrides, init = data.draw(cache_setups(name), label="cache setup")
    capacities = data.draw(st.lists(st.integers(0, E), min_size=LAYERS, max_size=LAYERS), label="capacities")
    cache = build(CACHES, name, overrides)
    ctl = controller(write(seqs), batch, PLACEMENTS.get("gpu-only")(), cache, capacities, init, costs=costs,
                     seed=seed)
    for layer in range(LAYERS):
        assert int(ctl.resident[layer].sum()) <= capacities[layer]
    if name == "static":  # frequency / random init fills every slot
        assert ctl.resident.sum(axis=1).tolist() == list(capacities)
    for step in range(ctl.w.num_steps):
        for layer in range(LAYERS):
            before = ctl.resident[layer].copy()
            plan = ctl.plan(step, layer)
            assert (plan.step, plan.layer) == (step, layer)
            check_cache_plan(ctl, before, plan)


def per_expert_twin(cls):
    """A subclass that overrides a per-expert hook (with the same behaviour): it loses the batch form, so
    the controller drives it expert by expert."""
    return type(f"PerExpert{cls.__name__}", (cls,), {"on_hit": lambda self, *a: cls.on_hit(self, *a)})


BATCHED = [n for n in CACHES.names() if CACHES.get(n)().batched]


def test_batch_forms_are_known_and_lost_by_subclasses_that_change_a_hook():
    assert {"lru", "lfu", "static", "dali-window", "hybrimoe-mrs"} <= set(BATCHED)
    assert "belady" not in BATCHED  # its victim depends on the incoming expert
    for name in BATCHED:
        assert not per_expert_twin(CACHES.get(name))().batched


@pytest.mark.parametrize("name", BATCHED)
@SETTINGS
@given(data=st.data(), seqs=traces(), batch=st.integers(1, 3), costs=st.integers(0, len(COSTS) - 1),
       seed=st.integers(0, 3), placement=st.sampled_from(["gpu-only", "dali-greedy", "fiddler", "hybrimoe"]),
       oracle=st.booleans())
def test_batch_form_plans_exactly_as_the_per_expert_protocol(name, data, seqs, batch, costs, seed, placement, oracle):
    """Every plan field is the same whether the controller uses the policy's batch form or asks it expert
    by expert (placements that put resident experts on the CPU and prefetches included)."""
    overrides, init = data.draw(cache_setups(name), label="cache setup")
    capacities = data.draw(st.lists(st.integers(0, E), min_size=LAYERS, max_size=LAYERS), label="capacities")
    path = write(seqs)
    cls = CACHES.get(name)
    config = cls.Config().with_overrides(overrides, "x") if overrides else None
    ctls = [controller(path, batch, PLACEMENTS.get(placement)(), c(config), capacities, init, costs=costs, seed=seed,
                       prefetch=PREFETCHERS.get("oracle")() if oracle else None, prefetch_slots=2 if oracle else 0)
            for c in (cls, per_expert_twin(cls))]
    assert ctls[0].cache.batched and not ctls[1].cache.batched
    for a, b in zip(ctls[0].plans(), ctls[1].plans()):
        for f in ("experts", "counts", "on_gpu", "source", "hit", "admitted", "staged"):
            assert np.array_equal(getattr(a, f), getattr(b, f)), f
        for f in ("evicted", "prefetches", "prefetch_used", "prefetch_wasted", "swaps"):
            assert list(getattr(a, f)) == list(getattr(b, f)), f
    assert np.array_equal(ctls[0].resident, ctls[1].resident)


# ---- placement properties ------------------------------------------------------------------------
def placement_setups(name: str):
    """(config overrides, capacities strategy or None = random) for a placement policy."""
    if name == "static-layers":
        @st.composite
        def setup(draw):
            n = draw(st.integers(0, LAYERS))
            over = {"cpu_layers": str(n), "offload_min_tokens": str(draw(st.sampled_from([0, 1, 3]))),
                    "offload_basis": draw(st.sampled_from(["step", "expert"]))}
            return over, [0 if layer < n else E for layer in range(LAYERS)]
        return setup()
    caps = st.lists(st.integers(0, E), min_size=LAYERS, max_size=LAYERS)
    if name in ("dali-greedy-mem", "optimal-mem"):
        return st.tuples(st.fixed_dictionaries({"slots": st.sampled_from(["evictable", "free", "staging"]),
                                                "staging_slots": st.sampled_from(["-1", "0", "1", "2"]),
                                                "overlap": st.sampled_from(["true", "false"])}), caps)
    if name in ("dali-greedy", "optimal"):
        return st.tuples(st.fixed_dictionaries({"overlap": st.sampled_from(["true", "false"]),
                                                "pending_resident": st.sampled_from(["true", "false"])}), caps)
    if name == "hybrimoe":
        return st.tuples(st.fixed_dictionaries({"mode": st.sampled_from(["hss", "best", "greedy"]),
                                                "pending_resident": st.sampled_from(["true", "false"])}), caps)
    if name == "fiddler":
        return st.tuples(st.fixed_dictionaries({"pending_resident": st.sampled_from(["true", "false"])}), caps)
    return st.tuples(st.just({}), caps)


@pytest.mark.parametrize("name", PLACEMENTS.names())
@SETTINGS
@given(data=st.data(), seqs=traces(), batch=st.integers(1, 3), costs=st.integers(0, len(COSTS) - 1),
       cache_name=st.sampled_from(["lru", "static", "lfu"]), init=st.sampled_from(INITS),
       oracle=st.booleans(), slots=st.integers(1, 4))
def test_placement_contract(name, data, seqs, batch, costs, cache_name, init, oracle, slots):
    overrides, capacities = data.draw(placement_setups(name), label="placement setup")
    placement = build(PLACEMENTS, name, overrides)
    prefetch = PREFETCHERS.get("oracle")() if oracle else None
    path = write(seqs)
    ctl = controller(path, batch, placement, CACHES.get(cache_name)(), capacities,
                     "frequency" if name == "static-layers" else init,
                     prefetch=prefetch, prefetch_slots=slots if oracle else 0, costs=costs)
    trace = read_trace(path)
    totals = np.zeros((LAYERS, E), np.int64)
    for plan in ctl.plans():
        n = len(plan.experts)
        assert len(set(plan.experts.tolist())) == n  # each activated expert once
        for arr in (plan.on_gpu, plan.source, plan.hit, plan.admitted, plan.staged, plan.counts):
            assert arr.shape == (n,)
        assert (plan.counts > 0).all() and int(plan.counts.sum()) == plan.tokens * TOP_K
        assert ((plan.source != CPU) == plan.on_gpu).all()
        assert not (plan.staged & ~(plan.source == FETCH)).any()
        assert not plan.admitted[~plan.on_gpu].any()  # a CPU expert never enters the cache
        if not placement.may_fetch:
            assert not (plan.source == FETCH).any() and not plan.staged.any()
        totals[plan.layer, plan.experts] += plan.counts
        assert set(plan.prefetch_used) == set(plan.experts[plan.source == PREFETCHED].tolist())
    want = np.zeros((LAYERS, E), np.int64)
    for layer, experts in zip(trace.layer.tolist(), trace.experts.tolist()):
        np.add.at(want[layer], experts, 1)
    assert np.array_equal(totals, want)
