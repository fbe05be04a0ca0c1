"""The controller's compiled path (``dali_sim.runtime.plan_kernel``) and the policies' compiled kernels give
exactly the plans of the NumPy reference (``Controller.plan_reference``, the policies' NumPy code).

Every system preset runs on synthetic workloads (several seeds, cache sizes, batch sizes, with and without
prefill) twice: as shipped, and with every compiled path off (``plan_kernel.compiled`` and
``kernels.fused`` and the placements' and dali-window's kernel getters answering None, so that each plan
takes the NumPy reference path). Every field of every plan and every counter must agree.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from dali_sim.policies import cache_dali, kernels, placement_competitors, placement_dali, resolve_system, system_names
from dali_sim.policies.base import CachePolicy
from dali_sim.policies.cache import LRU
from dali_sim.policies.hybrimoe import HybriMoEPlacement, HybriMoEPrefetch, MRSCache, mrs_update
from dali_sim.policies.prefetch_lookahead import top_predicted
from dali_sim.runtime import controller as ctl
from dali_sim.runtime import plan_kernel
from dali_sim.runtime.future import FutureDemand
from dali_sim.sim.simulate import simulate
from dali_sim.trace import read_trace
from dali_sim.trace.synth import SynthConfig, synthesize
from dali_sim.workload.builder import Workload, WorkloadConfig
from dali_sim.workload.profiling import ProfileSpec

from conftest import feed_online

pytestmark = pytest.mark.skipif(kernels.fused("impact_prefix") is None, reason="numba is off: no compiled path")

LOOKAHEAD = ("residual=0.9", "next-gate=0.7", "gate2=0.6@2", "gate3=0.5@3")
#: presets run by the simulator (a time bound has no plans)
PRESETS = [n for n in system_names() if n != "lower-bound"]
#: (model, trace seed, prompt length, batch size, memory.cache_ratio or None = the preset's budget)
CASES = [("qwen3-30b-a3b", 1, 0, 4, "0.25"), ("qwen3-30b-a3b", 2, 3, 1, "0.6"), ("mixtral-8x7b", 3, 3, 2, "0.25"),
         ("mixtral-8x7b", 4, 0, 1, None)]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    out = {}
    for model, seed, prompt, _, _ in CASES:
        path = tmp_path_factory.mktemp("fast") / f"{model}-{seed}.parquet"
        synthesize(SynthConfig(model=model, sequences=4, prompt_len=prompt, gen_len=6, seed=seed, lookahead=LOOKAHEAD),
                   path)
        out[(model, seed)] = read_trace(path)
    return out


def _fields(p: ctl.LayerPlan) -> tuple:
    return (p.step, p.layer, p.phase, p.tokens, p.experts.tolist(), p.counts.tolist(), p.on_gpu.tolist(),
            p.source.tolist(), p.source.dtype, p.hit.tolist(), p.admitted.tolist(), p.staged.tolist(), p.evicted,
            p.prefetches, p.prefetch_used, p.prefetch_wasted, p.swaps)


def _compiled_off(m) -> None:
    """Every compiled path off (on the monkeypatch context ``m``): each plan takes the NumPy reference path."""
    m.setattr(plan_kernel, "compiled", lambda: None)
    m.setattr(kernels, "fused", lambda name: None)
    for module, getter in ((placement_dali, "_compiled_place"), (placement_competitors, "_compiled_fiddler"),
                           (cache_dali, "_compiled_swaps"), (cache_dali, "_compiled_observe")):
        m.setattr(module, getter, lambda: None)


def _run(monkeypatch, trace, system: str, batch: int, ratio, seed: int, *, compiled: bool, over=None):
    plans: list[ctl.LayerPlan] = []
    tallied: list[bool] = []
    with monkeypatch.context() as m:
        if not compiled:
            _compiled_off(m)
        plan = ctl.Controller.plan

        def recorded(self, step, layer):
            p = plan(self, step, layer)
            plans.append(p)
            tallied.append(p.tally is not None)
            # the compiled path's answer holds the victims where the executor's route call reads them
            assert p.answer is None if p.tally is None else \
                p.answer[plan_kernel.TALLY_LEN + 1:][:len(p.evicted)].tolist() == p.evicted, (step, layer)
            return p

        m.setattr(ctl.Controller, "plan", recorded)
        if over is None:
            over = {"memory": {"cache_ratio": ratio}} if ratio else {}
        future = FutureDemand.from_workload(Workload(trace, WorkloadConfig(batch))) \
            if resolve_system(system).needs_future else None
        res = simulate(trace, system, batch_size=batch, overrides=over, timing=False, seed=seed,
                       profiling=ProfileSpec(share=0.0), future=future)
    return [_fields(p) for p in plans], res, any(tallied)


@pytest.mark.parametrize("system", PRESETS)
def test_compiled_plans_are_the_reference_plans(monkeypatch, traces, system):
    used_kernel = False
    for model, seed, _, batch, ratio in CASES:
        trace = traces[(model, seed)]
        fast, res_fast, tallied = _run(monkeypatch, trace, system, batch, ratio, seed, compiled=True)
        ref, res_ref, ref_tallied = _run(monkeypatch, trace, system, batch, ratio, seed, compiled=False)
        assert not ref_tallied  # the reference really ran the NumPy path
        assert len(fast) == len(ref) > 0
        for a, b in zip(fast, ref):
            assert a == b, (model, seed, ratio, a[:2])
        assert res_fast.per_layer.equals(res_ref.per_layer)
        used_kernel |= tallied
    keyed = resolve_cache(system).keyed
    assert used_kernel == keyed  # the compiled path ran for every keyed cache, never for another


def resolve_cache(system: str) -> CachePolicy:
    return resolve_system(system).cache.build()


def test_shipped_keyed_caches():
    """The presets' common caches have the keyed form; a subclass that changes a hook loses it."""
    from dali_sim.policies.base import CACHES

    assert {n for n in CACHES.names() if CACHES.get(n)().keyed} >= {"lru", "lfu", "static", "dali-window",
                                                                     "hybrimoe-mrs"}

    class OtherVictim(LRU):
        def victim(self, layer, expert, view, evictable):
            return int(evictable[-1])

    class OwnOrder(LRU):
        def victim_order(self, layer, view, evictable):
            return evictable[::-1]

    assert not OtherVictim().keyed and not OwnOrder().keyed and LRU().keyed


def test_top_predicted_kernel_matches_numpy(monkeypatch):
    rng = np.random.default_rng(0)
    for trial in range(200):
        E = int(rng.integers(1, 40))
        counts = rng.integers(0, 4, E).astype(np.float64)  # many ties
        rank = rng.integers(0, 3, E)
        k = int(rng.integers(0, 6))
        fast = [top_predicted(counts, k, r).tolist() for r in (rank, None)]
        with monkeypatch.context() as m:
            m.setattr(kernels, "fused", lambda name: None)
            ref = [top_predicted(counts, k, r).tolist() for r in (rank, None)]
        assert fast == ref, trial


def test_mrs_update_kernel_matches_numpy():
    rng = np.random.default_rng(1)
    update = kernels.fused("mrs_update")
    for trial in range(100):
        E = int(rng.integers(2, 64))
        score = rng.random(E)
        experts = rng.choice(E, size=int(rng.integers(0, E)), replace=False).astype(np.int16)
        counts = rng.integers(1, 9, len(experts)).astype(np.int32)
        tokens, a = int(rng.integers(0, 20)), float(rng.choice([0.5, 0.3, 1.0]))
        ref = mrs_update(score, experts, counts, tokens, a)
        update(score, experts, counts, tokens, a)  # in place
        assert score.tobytes() == ref.tobytes(), trial


def test_window_swaps_kernel_matches_numpy(monkeypatch):
    rng = np.random.default_rng(2)
    for trial in range(300):
        E = int(rng.integers(1, 30))
        score = rng.integers(0, 5, E).astype(np.int64)  # many ties
        resident = rng.random(E) < rng.random()
        u = int(rng.integers(0, 6))
        fast = cache_dali.window_swaps(score, resident, u)
        with monkeypatch.context() as m:
            m.setattr(cache_dali, "_compiled_swaps", lambda: None)
            ref = cache_dali.window_swaps(score, resident, u)
        assert fast == ref, trial


def _issuer(rng, L: int, E: int, slots: int, asked, compiled: bool) -> ctl.Controller:
    """A controller with only what ``_issue_prefetches`` reads: random contents, a prefetcher answering ``asked``."""
    c = object.__new__(ctl.Controller)
    c.w = SimpleNamespace(num_layers=L, num_experts=E)
    c.prefetcher = SimpleNamespace(name="fixed", reads_future=False, prefetch=lambda view: asked)
    c.resident = rng.random((L, E)) < 0.3
    c.pending = (rng.random((L, E)) < 0.1) & ~c.resident
    c.n_pending = c.pending.sum(axis=1)
    c._pending_total = int(c.n_pending.sum())
    c.prefetch_slots = c._pending_total + slots
    c._issue_kernel = plan_kernel.compiled_issue() if compiled else None
    return c


def test_compiled_prefetch_issue_matches_the_reference():
    """Requests as an (m, 2) array, with repeats, resident and pending ones and invalid targets: the same
    issued pairs, contents and error (or none) as the reference's."""
    for trial in range(400):
        L, E = 4, 6
        layer = int(np.random.default_rng(trial).integers(0, L - 1))
        asked = np.random.default_rng(trial + 1).integers([layer, 0], [L + 1, E + 1], size=(int(trial % 12), 2))
        slots = trial % 5
        out = []
        for compiled in (True, False):
            rng = np.random.default_rng(trial)
            c = _issuer(rng, L, E, slots, asked, compiled)
            try:
                got = c._issue_prefetches(SimpleNamespace(layer=layer))
            except ValueError as e:
                got = str(e)
            out.append((got, c.pending.tolist(), c.n_pending.tolist(), c._pending_total))
        assert out[0] == out[1], trial
        assert out[0][3] == sum(out[0][2])


def test_victims_by_selection_and_by_sorting_are_the_lexsort_order():
    plan_kernel.compiled()
    victims = plan_kernel._victims_fn
    rng = np.random.default_rng(3)
    for trial in range(300):
        E = int(rng.integers(1, 40))
        resident, activated = rng.random(E) < 0.7, rng.random(E) < 0.3
        primary = rng.integers(0, 3, E).astype(np.float64 if trial % 2 else np.int64)  # ties
        stamp = rng.integers(-1, 4, E)
        want = int(rng.integers(1, 12))
        ev = np.flatnonzero(resident & ~activated)
        ref = ev[np.lexsort((ev, stamp[ev], primary[ev]))][:want].tolist()
        out = np.empty(want, np.int64)
        n = victims(resident, activated, primary, stamp, want, out)
        assert out[:n].tolist() == ref, trial


#: presets whose plans take the view-free compiled call (a placement with a rule form, a keyed cache asked once
#: per layer with nothing to observe, no prefetches or swaps)
RULED = {"cpu-only", "gpu-lru", "gpu-static", "llamacpp", "llamacpp-best", "fiddler", "fiddler-best", "ktransformers",
         "ktransformers-best", "mixtral-offloading"}


def _views_per_plan(monkeypatch, trace, system: str, ratio=None) -> tuple[list, float]:
    """The plans of ``system`` on ``trace`` and the LayerViews built per plan."""
    built = []
    view = ctl.Controller.view

    def counted(self, step, layer):
        built.append((step, layer))
        return view(self, step, layer)

    with monkeypatch.context() as m:
        m.setattr(ctl.Controller, "view", counted)
        plans, _, _ = _run(monkeypatch, trace, system, 2, ratio, 0, compiled=True)
    return plans, len(built) / len(plans)


#: presets planned view-free by DALI's greedy form (plan_kernel._greedy_plan)
GREEDY = {"dali", "hybrimoe", "hybrimoe-best"}


@pytest.mark.parametrize("system", PRESETS)
def test_view_free_plans_for_the_simple_presets(monkeypatch, traces, system):
    _, per_plan = _views_per_plan(monkeypatch, traces[("qwen3-30b-a3b", 2)], system)
    assert per_plan == (0.0 if system in RULED | GREEDY else 1.0)


@pytest.mark.parametrize("system,over", [
    ("dali", {"cache": {"policy": "lru"}}), ("dali", {"cache": {"policy": "lru"}, "prefetch": {"policy": "none"}}),
    ("dali", {"cache": {"policy": "static"}, "prefetch": {"policy": "lookahead", "predictor": "next-gate", "k": 0}}),
    ("dali", {"memory": {"cache_init": "empty"}, "cache": {"u": 2}}),
    ("dali", {"placement": {"overlap": False, "pending_resident": False}}),
    ("dali", {"memory": {"prefetch_slots": 1}, "cache": {"w": 1}}),
    ("hybrimoe", {"placement": {"hss_steps": "all", "pending_resident": False}, "prefetch": {"k": 2}}),
    ("hybrimoe", {"cache": {"prefill_evicts": False, "a": 0.25}, "prefetch": {"predictor2": "", "min_gain": -1}}),
    ("hybrimoe", {"memory": {"cache_init": "empty", "prefetch_slots": 8}, "prefetch": {"predictor1": ""}}),
    ("hybrimoe", {"prefetch": {"policy": "none"}})])
def test_fused_view_free_plans_are_the_reference_plans(monkeypatch, traces, system, over):
    """dali's and HybriMoE's forms with other caches, prefetchers and settings: no view, the reference's plans."""
    for model, seed, _, batch, ratio in CASES[:3]:
        trace = traces[(model, seed)]
        merged = {**over, "memory": {**over.get("memory", {}), **({"cache_ratio": ratio} if ratio else {})}}
        views = []
        view = ctl.Controller.view
        with monkeypatch.context() as m:
            m.setattr(ctl.Controller, "view", lambda self, s, la: views.append(1) or view(self, s, la))
            fast = _run_over(monkeypatch, trace, system, batch, merged, seed, compiled=True)
        ref = _run_over(monkeypatch, trace, system, batch, merged, seed, compiled=False)
        assert not views and fast[0] == ref[0] and len(ref[0]) > 0, (model, over)
        assert fast[1].per_layer.equals(ref[1].per_layer)


def _run_over(monkeypatch, trace, system, batch, over, seed, *, compiled):
    plans, res, _ = _run(monkeypatch, trace, system, batch, None, seed, compiled=compiled, over=over)
    return plans, res


@pytest.mark.parametrize("system,cls,getter", [("dali", placement_dali.DaliGreedy, "greedy_form"),
                                                ("hybrimoe-best", HybriMoEPlacement, "hss_form")])
def test_workloads_beyond_the_forms_tables_leave_the_plan_to_the_policies(monkeypatch, traces, system, cls, getter):
    """A workload (or HybriMoE's prediction) beyond the form's tables: that plan is made with a view and the
    policies' own code; the plans stay the reference's."""
    form_of = getattr(cls, getter)

    def short(self, ctx):  # the tables of workloads 0..2 only
        form = form_of(self, ctx)
        return dataclasses.replace(form, gpu=form.gpu[:3], cpu=form.cpu[:3])

    trace = traces[("qwen3-30b-a3b", 2)]
    with monkeypatch.context() as m:
        m.setattr(cls, getter, short)
        plans, per_plan = _views_per_plan(monkeypatch, trace, system, "0.25")
    ref, _, _ = _run(monkeypatch, trace, system, 2, "0.25", 0, compiled=False)
    assert 0 < per_plan < 1
    assert plans == ref


def test_forms_are_not_inherited_by_subclasses():
    """A subclass may place, observe, swap or prefetch otherwise: it loses the forms."""
    from dali_sim.policies.prefetch_lookahead import DaliResidualPrefetch, LookaheadPrefetch, NextGatePrefetch

    class Greedier(placement_dali.DaliGreedy):
        pass

    class Window(cache_dali.DaliWindow):
        pass

    class Keep(LookaheadPrefetch):
        def keep(self, view, predicted_tokens):
            return predicted_tokens > 1

    ctx = SimpleNamespace(costs=SimpleNamespace(expert_time_table=lambda d: np.zeros(4),
                                                expert_transfer_time=lambda: 1.0))
    assert placement_dali.DaliGreedy().greedy_form(ctx) is not None and Greedier().greedy_form(ctx) is None
    assert Window().window_form() is None
    assert DaliResidualPrefetch().top_k_form() == ("residual", 1)
    assert Keep().top_k_form() is None and NextGatePrefetch().top_k_form() is None

    class Schedule(HybriMoEPlacement):
        pass

    class Score(MRSCache):
        pass

    class Impact(HybriMoEPrefetch):
        pass

    assert HybriMoEPlacement().hss_form(ctx) is not None and Schedule().hss_form(ctx) is None
    assert Score().mrs_form() is None and Impact().impact_form(ctx) is None


def test_an_undecided_rule_leaves_the_plan_to_place(monkeypatch, traces):
    """A workload beyond the rule's table (-1): that plan is made with a view and the placement's place(); the
    plans stay the reference's."""
    rule_form = placement_competitors.Fiddler.rule_form

    def short(self, ctx):  # the table of workloads 0 and 1 only, the rest undecided
        rule = rule_form(self, ctx)
        return dataclasses.replace(rule, by_count=np.append(rule.by_count[:2], np.int8(-1)))

    trace = traces[("qwen3-30b-a3b", 2)]
    with monkeypatch.context() as m:
        m.setattr(placement_competitors.Fiddler, "rule_form", short)
        plans, per_plan = _views_per_plan(monkeypatch, trace, "fiddler", "0.25")
    ref, _, _ = _run(monkeypatch, trace, "fiddler", 2, "0.25", 0, compiled=False)
    assert 0 < per_plan < 1  # some plans fell back, others did not
    assert plans == ref


def test_keyed_per_layer_is_not_inherited_by_an_own_keyed_form():
    class Phased(LRU):
        def keyed_form(self, layer, view):
            return True, view.phase != 0, self._no_key, self.stamp[layer], self._clock

    assert LRU.keyed_per_layer and Phased().keyed and not Phased.keyed_per_layer


def test_entry_is_the_compiled_function_for_the_examples_types():
    fn = kernels.jit(lambda a, k: a[:k].sum())
    one = [(np.arange(5), 2), (np.arange(7), 3)]
    direct = kernels.entry(fn, one)
    assert direct is not fn and direct(np.arange(6), 4) == 6
    assert kernels.entry(fn, one + [(np.arange(3.0), 1)]) is fn  # the examples' types differ: the dispatcher


def test_top_pairs_from_the_sparse_prediction_match_the_dense_ones():
    """The predicted experts alone, in any order, give the requests of the dense (E,) counts and ranks."""
    sparse, dense = kernels.fused("top_pairs_sparse"), kernels.fused("top_pairs")
    rng = np.random.default_rng(4)
    for trial in range(300):
        E = int(rng.integers(1, 40))
        experts = rng.permutation(E)[:int(rng.integers(0, E + 1))]
        counts = rng.integers(0, 4, len(experts)).astype(np.int32)  # many ties, some zeros
        ranks = rng.integers(0, 3, len(experts)).astype(np.int8)
        k, target = int(rng.integers(0, 6)), int(rng.integers(1, 5))
        c, r = np.zeros(E), np.full(E, 3, np.int64)
        c[experts], r[experts] = counts, ranks
        got = sparse(experts.astype(np.int16), counts, ranks, k, target)
        assert got.tolist() == dense(c, r, k, target).tolist(), trial


def _by_rule(rule, layer: int, tokens: int, experts, counts, resident, pending):
    """``PlacementRule`` read as its docstring says (None: an expert undecided)."""
    if rule.gpu_layer[layer] or tokens >= rule.min_tokens[layer]:
        return [True] * len(experts)
    out = []
    for e, c in zip(experts, counts):
        if (rule.resident and resident[e]) or (rule.pending and pending[e]):
            out.append(True)
            continue
        v = int(rule.by_count[min(c, len(rule.by_count) - 1)])
        if v < 0:
            return None
        out.append(v == 1)
    return out


@pytest.mark.parametrize("name, config", [
    ("gpu-only", {}), ("cpu-only", {}), ("resident-gpu", {}), ("fiddler", {}), ("fiddler", {"pending_resident": False}),
    ("static-layers", {"cpu_layers": 2}), ("static-layers", {"cpu_layers": 2, "offload_min_tokens": 6}),
    ("static-layers", {"cpu_layers": 2, "offload_min_tokens": 3, "offload_basis": "expert"})])
def test_rule_forms_agree_with_place(name, config):
    """Random layer visits (workloads up to beyond the cost tables for fiddler): the rule decides as place()."""
    from dali_sim.hardware.cost import CostModel
    from dali_sim.hardware.profile import load_profile
    from dali_sim.models.presets import get_model
    from dali_sim.policies.base import PLACEMENTS, LayerView, SetupContext

    model = get_model("mixtral-8x7b")
    L, E = 3, model.num_experts
    costs = CostModel(load_profile("rtx3090-epyc7532"), model, lookup_tokens=64)
    policy = PLACEMENTS.get(name)(PLACEMENTS.get(name).Config(**config))
    caps = np.array([0, 0, E]) if name == "static-layers" else np.full(L, 3)
    ctx = SetupContext(num_layers=L, num_experts=E, top_k=2, capacities=caps, frequencies=np.zeros((L, E), np.int64),
                       costs=costs, seed=0, block_of_layer=tuple(range(L)))
    policy.setup(ctx)
    rule = policy.rule_form(ctx)
    rng = np.random.default_rng(5)
    undecided = 0
    for trial in range(300):
        layer = int(rng.integers(0, L))
        experts = rng.permutation(E)[:int(rng.integers(0, E + 1))]
        counts = rng.integers(1, 80 if trial % 3 == 0 else 9, len(experts))
        resident, pending = rng.random(E) < 0.3, rng.random(E) < 0.2
        v = LayerView(step=0, layer=layer, phase=1, tokens=int(counts.sum()), experts=experts, counts=counts,
                      ranks=np.zeros(len(experts), np.int64), resident=resident, pending=pending, num_layers=L,
                      num_experts=E, costs=costs, lookahead=lambda n, t: None)
        got = _by_rule(rule, layer, v.tokens, experts.tolist(), counts.tolist(), resident, pending)
        undecided += got is None
        if got is not None:
            assert got == np.asarray(policy.place(v), bool).tolist(), (name, config, trial)
    assert (undecided > 0) == (name == "fiddler")  # only fiddler's table ends (at 64 tokens here)


#: presets a running model can run (not a bound, no policy reading the future)
ONLINE = [n for n in PRESETS if n != "oracle-heuristic"]


def _run_online(monkeypatch, trace, system: str, batch: int, ratio, *, compiled: bool) -> tuple[list, list, int]:
    """``system``'s plans on an online workload fed ``trace`` (``conftest.feed_online``), with the compiled
    paths off as :func:`_run`. Returns the plans, whether each was tallied and the LayerViews built."""
    views = []
    with monkeypatch.context() as m:
        if not compiled:
            _compiled_off(m)
        view = ctl.Controller.view
        m.setattr(ctl.Controller, "view", lambda self, s, la: views.append(1) or view(self, s, la))
        _, _, plans = feed_online(trace, system, {"memory": {"cache_ratio": ratio}} if ratio else {}, batch=batch)
    return [_fields(p) for p in plans], [p.tally is not None for p in plans], len(views)


@pytest.mark.parametrize("system", ONLINE)
def test_online_plans_are_the_reference_plans(monkeypatch, traces, system):
    """On an online workload (the current step's routing and predictions only) the compiled paths give the
    reference's plans, and the presets planned view-free on a trace's workload are planned view-free here too
    (the prediction columns read from the step's segments)."""
    for model, seed, _, batch, ratio in CASES[:3]:
        trace = traces[(model, seed)]
        fast, tallied, views = _run_online(monkeypatch, trace, system, batch, ratio, compiled=True)
        ref, ref_tallied, _ = _run_online(monkeypatch, trace, system, batch, ratio, compiled=False)
        assert not any(ref_tallied) and len(fast) == len(ref) > 0
        for a, b in zip(fast, ref):
            assert a == b, (model, seed, ratio, a[:2])
        assert any(tallied) == resolve_cache(system).keyed
        if system in RULED | GREEDY:
            assert views == 0, (model, system)
        if system in ("dali", "hybrimoe"):  # the prefetches read from the step's segments were issued
            assert any(p[13] for p in fast), (model, system)
