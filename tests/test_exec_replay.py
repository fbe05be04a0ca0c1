"""Trace replay on the executor: outputs equal a reference computation for every system preset, the
counts are the simulator's, slots stay within the budget and always match the controller's cache,
and nothing is computed from a slot whose copy has not landed."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
from torch.overrides import TorchFunctionMode  # noqa: E402

from dali_exec.executor import (  # noqa: E402
    ExecOptions,
    HostExpertStore,
    Replay,
    ReplayOptions,
    SlotNotReady,
    execute,
    prepare_replay,
    reference_moe,
)
from dali_exec.executor.devices import Devices  # noqa: E402
from dali_exec.executor.runtime import OffloadRuntime  # noqa: E402
from dali_sim.policies import system_names  # noqa: E402
from dali_sim.runtime.controller import PREFETCHED  # noqa: E402
from dali_sim.sim import simulate  # noqa: E402
from dali_sim.sim.counters import COUNTERS  # noqa: E402
from dali_sim.trace import read_trace  # noqa: E402
from dali_sim.trace.synth import SynthConfig, synthesize  # noqa: E402
from dali_sim.workload import WorkloadConfig  # noqa: E402

from conftest import REPO  # noqa: E402

BATCH = 2
TINY = ReplayOptions(layers=4, scale=1 / 64, dtype="fp32")  # Mixtral shape: hidden 64, 8 experts, top-2
CPU_RUN = ExecOptions(device="cpu", cpu_threads=1, accel_threads=1)
GPT_OSS = REPO / "traces" / "gpt-oss-20b.parquet"


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    """Mixtral-shaped routing (prefill + decode) with every lookahead column a preset reads."""
    path = tmp_path_factory.mktemp("exec") / "mix.parquet"
    synthesize(SynthConfig(model="mixtral-8x7b", sequences=3, prompt_len=6, gen_len=6, seed=5,
                           lookahead=("residual=0.9", "next-gate=0.7", "gate2=0.6@2", "gate3=0.5@3")), path)
    return read_trace(path)


def _check_against_reference(records, setup, rtol=1e-5, atol=1e-5):
    """Each executed layer's output = its residual + sum_r w * expert(gate input), from the host weights."""
    store = HostExpertStore.random(setup.model, records[0].output.dtype, 0)
    assert len(records) == setup.workload.num_steps * setup.workload.num_layers
    for rec in records:
        ref = rec.residual + reference_moe(store, rec.layer, rec.gate_input, rec.ids, rec.weights)
        torch.testing.assert_close(rec.output, ref, rtol=rtol, atol=atol)
        assert rec.output.abs().max() > 0


def _simulated_counts(setup, tmp_path):
    future = None
    if setup.sysconf.needs_future:  # belady, optimal: next-use times from a file beside the trace
        from dali_sim.runtime.future import write_future

        future = write_future(setup.trace, WorkloadConfig(BATCH), out=tmp_path / "reduced.future.parquet", share=0.0)
    kw = {"future": future} if future is not None else {}
    # the replay's evaluated sequences with its profiling input (the default split made by prepare_replay)
    return simulate(setup.trace, setup.sysconf, hardware=setup.hardware, batch_size=BATCH, timing=False,
                    profiling=setup.profiled, **kw)


def test_a_time_bound_is_not_replayed(mix):
    with pytest.raises(ValueError, match="'lower-bound' is a time bound computed by the simulator"):
        execute(mix, "lower-bound", TINY, CPU_RUN, batch_size=BATCH)


@pytest.mark.parametrize("system", [s for s in system_names() if s != "lower-bound"])
def test_every_preset_equals_the_reference_and_counts_like_the_simulator(mix, system, tmp_path):
    records = []
    result = execute(mix, system, TINY, CPU_RUN, batch_size=BATCH, on_layer=records.append)
    setup = prepare_replay(mix, system, TINY, batch_size=BATCH)
    _check_against_reference(records, setup)
    sim = _simulated_counts(setup, tmp_path)
    for key in COUNTERS:
        assert result.summary[key] == sim.summary[key], key
    pd.testing.assert_frame_equal(result.per_layer[sim.per_layer.columns], sim.per_layer)
    assert result.summary["bounds"] == sim.summary["bounds"]
    # the simulator's result layout, with measured times
    assert result.summary["makespan_s"] > 0 and result.summary["decode_tokens_per_s"] > 0
    assert list(result.per_step.columns) == ["phase", "batch", "tokens", "start_s", "time_s"]
    assert (result.per_step["time_s"] > 0).all()
    assert set(result.per_sequence.columns) >= {"ttft_s", "tpot_s", "decode_tokens_per_s"}
    assert result.manifest["memory"] == sim.manifest["memory"]
    assert result.config["system"] == sim.config["system"]


@pytest.mark.parametrize("system", ["hybrimoe", "mixtral-offloading-best"])
def test_prefetches_wait_for_a_buffer_where_the_simulators_at_use_rule_says(mix, system):
    """The executor frees a prefetch buffer once done with it (the simulator's ``prefetch_buffers = "at-use"``):
    the prefetches that found none free as their visit started (``summary["prefetches_waited"]``) are those
    :func:`buffers_at_use` finds in the replay's own plans."""
    from dali_sim.sim.engine import buffers_at_use

    records = []
    small = {"memory": {"prefetch_slots": "2"}}
    result = execute(mix, system, TINY, CPU_RUN, batch_size=BATCH, on_layer=records.append, overrides=small)
    setup = prepare_replay(mix, system, TINY, batch_size=BATCH, overrides=small)
    held, waited = 0, 0
    for rec in records:
        start, _, _, held = buffers_at_use(rec.plan, held, setup.memory.prefetch_slots)
        waited += len(rec.plan.prefetches) - start
    assert result.summary["prefetch_issued"] > waited > 0  # (with 2 buffers, some wait: 1 of 10, 4 of 14)
    assert result.summary["prefetches_waited"] == waited


def test_a_closed_replay_frees_its_slot_table_without_the_cyclic_collector(mix):
    """Replays run with the collector paused; a finished replay's slot table (its largest buffer) must go as the
    replay goes, not wait for a collection (a validation of 5 systems x 3 replays once kept them all, 24 GB)."""
    import gc
    import weakref

    from dali_exec.executor.devices import Devices

    setup = prepare_replay(mix, "dali", TINY, batch_size=BATCH)
    replay = Replay(setup, Devices.create("cpu", "fp32"), CPU_RUN)
    result = replay.run()
    len(result.intervals)
    assert result.summary["prefetch_issued"] > 0 and result.summary["swaps"] > 0  # (background copies' tickets)
    replay.close()
    pool = weakref.ref(replay.runtime.pool)
    buffer = pool().buffer.untyped_storage().data_ptr()
    assert all(slot.pool is pool() for slot in pool().slots)
    was = gc.isenabled()
    gc.disable()
    try:
        del replay
        assert pool() is None
        on_buffer = [o for o in gc.get_objects()  # (type(): isinstance would call a dead weak proxy's __class__)
                     if issubclass(type(o), torch.Tensor) and o.untyped_storage().data_ptr() == buffer]
        assert on_buffer == []  # (no view of it left either: the copies' tickets held some)
    finally:
        if was:
            gc.enable()


def test_result_has_every_simulator_key(mix):
    result = execute(mix, "dali", TINY, CPU_RUN, batch_size=BATCH)
    setup = prepare_replay(mix, "dali", TINY, batch_size=BATCH)
    # the executor's implementation needs a measured profile's host costs; the keys are the same with bare
    timed = simulate(setup.trace, dataclasses.replace(setup.sysconf, implementation="bare"), batch_size=BATCH,
                     profiling=setup.profiled)
    assert set(timed.summary) <= set(result.summary)
    assert set(timed.per_layer.columns) <= set(result.per_layer.columns)
    assert set(timed.manifest) <= set(result.manifest) and set(timed.config) <= set(result.config)
    ov = result.summary["overhead"]
    assert ov["layer_visits"] == result.summary["steps"] * 4
    assert 0 < ov["fraction_of_layer_time"] < 1 and ov["decision_us_per_layer"] > 0
    names = {iv.name.split(" ")[0] for iv in result.intervals}
    assert {"dense", "prefetch", "swap", "host"} <= names  # every kind of activity was timed
    lru = execute(mix, "gpu-lru", TINY, CPU_RUN, batch_size=BATCH)  # (dali's greedy fetches nothing here)
    assert "fetch" in {iv.name.split(" ")[0] for iv in lru.intervals}
    tracks = {iv.track for iv in result.intervals}
    assert tracks == {"gpu", "cpu", "pcie", "host"}  # host: the policies' decisions
    assert all(iv.end >= iv.start >= 0 for iv in result.intervals)
    assert result.summary["busy"]["gpu"] > 0 and result.summary["busy"]["pcie"] > 0


def test_each_visits_host_work_is_recorded(mix):
    """Each layer visit's decision + bookkeeping, recorded as the sums grow: they add up to the per-layer sums,
    and the summary's median and 90th percentile are theirs; so are the medians of the visits whose plans issue
    prefetches and of the others (recorded from the plans, in visit order)."""
    from unittest import mock

    from dali_exec.executor import replay as replay_module

    records = []
    with mock.patch.object(replay_module, "assemble_result", wraps=replay_module.assemble_result) as spy:
        result = execute(mix, "dali", TINY, CPU_RUN, batch_size=BATCH, on_layer=records.append)
    per_visit, prefetching = spy.call_args.kwargs["per_visit_s"], spy.call_args.kwargs["prefetching"]
    ov, per_layer = result.summary["overhead"], result.per_layer
    assert prefetching.tolist() == [bool(rec.plan.prefetches) for rec in records]
    assert 0 < prefetching.sum() < len(prefetching)  # (both kinds: the split below means something)
    assert ov["prefetching_visits"] == pytest.approx(prefetching.mean())
    for kind, which in (("prefetching", prefetching), ("other", ~prefetching)):
        assert ov[f"overhead_cpu_us_median_{kind}"] == pytest.approx(1e6 * np.median(per_visit[1][which]))
    assert per_visit.shape == (2, ov["layer_visits"]) and (per_visit > 0).all()
    for i, suffix in enumerate(("", "_cpu")):
        total = per_layer[f"decision{suffix}_s"].sum() + per_layer[f"bookkeeping{suffix}_s"].sum()
        assert per_visit[i].sum() == pytest.approx(total, rel=1e-9)
        assert ov[f"overhead{suffix}_us_median"] == pytest.approx(1e6 * np.median(per_visit[i]))
        assert ov[f"overhead{suffix}_us_p90"] == pytest.approx(1e6 * np.percentile(per_visit[i], 90))
        assert ov[f"overhead{suffix}_us_median"] <= ov[f"overhead{suffix}_us_p90"]


def test_the_split_by_prefetching_visits_is_given_only_where_some_visits_prefetch():
    from dali_exec.executor.result import overhead_summary

    per_layer = pd.DataFrame({k: [1e-3] for k in ("time_s", "decision_s", "bookkeeping_s", "decision_cpu_s",
                                                   "bookkeeping_cpu_s")})
    per_visit = np.array([[1e-5, 2e-5, 3e-5, 4e-5]] * 2)
    none = overhead_summary(per_layer, 4, per_visit, np.zeros(4, bool))
    assert "prefetching_visits" not in none and none["overhead_cpu_us_median"] == pytest.approx(25.0)
    some = overhead_summary(per_layer, 4, per_visit, np.array([False, True, False, True]))
    assert some["prefetching_visits"] == 0.5
    assert (some["overhead_cpu_us_median_prefetching"], some["overhead_cpu_us_median_other"]) == \
        (pytest.approx(30.0), pytest.approx(20.0))
    every = overhead_summary(per_layer, 4, per_visit, np.ones(4, bool))
    assert every["prefetching_visits"] == 1.0 and math.isnan(every["overhead_us_median_other"])


def test_slot_table_follows_the_controller_and_stays_within_the_budget(mix):
    store = None
    for system in ("gpu-lru", "dali", "mixtral-offloading", "moe-lightning", "llamacpp"):
        setup = prepare_replay(mix, system, TINY, batch_size=BATCH)
        replay = Replay(setup, Devices.create("cpu", TINY.dtype), CPU_RUN, store=store)
        store = replay.store  # the same weights serve every system of this model
        try:
            mem = setup.memory
            breakdown = mem.breakdown
            assert replay.runtime.slot_bytes == (breakdown["expert_cache"] + breakdown["staging_buffers"]
                                                 + breakdown["prefetch_buffers"])
            assert replay.runtime.slot_bytes <= mem.budget_bytes - breakdown["dense_weights"] - breakdown["kv_cache"]
            pool = replay.runtime.pool

            def same_cache(rec):
                cached = np.zeros_like(replay.controller.resident)
                for layer, table in enumerate(pool.cache):
                    cached[layer, list(table)] = True
                    assert len(table) <= mem.capacities[layer]
                assert (cached == replay.controller.resident).all(), (system, rec.step, rec.layer)

            replay.run(same_cache)
        finally:
            replay.close()


def test_intervals_read_after_a_later_run_keep_their_own_start(mix):
    """A result's intervals are resolved when first read, from its own run's start, even after the same
    replay has run again."""
    setup = prepare_replay(mix, "mixtral-offloading", TINY, batch_size=BATCH)
    replay = Replay(setup, Devices.create("cpu", TINY.dtype), CPU_RUN)
    try:
        first = replay.run()
        second = replay.run()
    finally:
        replay.close()
    for result in (second, first):
        ends = [iv.end for iv in result.intervals]
        assert len(ends) == result.summary["events"] > 0
        assert 0 <= min(iv.start for iv in result.intervals) and max(ends) <= result.summary["makespan_s"] + 1e-3


def test_a_store_of_another_shape_is_refused(mix):
    setup = prepare_replay(mix, "gpu-lru", TINY, batch_size=BATCH)
    other = HostExpertStore.random(setup.model, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="does not fit"):
        Replay(setup, Devices.create("cpu", TINY.dtype), CPU_RUN, store=other)
    devices = Devices.create("cpu", TINY.dtype)
    drawn = HostExpertStore.random(setup.model, devices.dtype, 3)  # (another seed: other weights)
    with pytest.raises(ValueError, match=r"\(seed 3\) does not fit .* with seed 0"):
        Replay(setup, devices, CPU_RUN, store=drawn)
    Replay(setup, devices, CPU_RUN, seed=3, store=drawn).close()


def test_dense_blocks_are_drawn_once_and_shared_by_replays_of_the_same_model(mix):
    """Given the same DenseWeights, replays of two systems compute with the very same block objects, drawn by the
    first; their layer outputs equal those of replays that drew their own blocks; blocks of another seed or dtype
    are refused."""
    from dali_exec.executor.dense import DenseWeights

    devices = Devices.create("cpu", TINY.dtype)
    setups = [prepare_replay(mix, system, TINY, batch_size=BATCH) for system in ("gpu-lru", "cpu-only")]
    dense = DenseWeights(setups[0].model, devices.dtype, 0)

    def outputs(setup, **kw):
        replay = Replay(setup, devices, CPU_RUN, **kw)
        records = []
        try:
            replay.run(records.append)
        finally:
            replay.close()
        return replay.blocks, [r.output for r in records]

    shared = [outputs(setup, dense=dense) for setup in setups]
    assert shared[0][0] is shared[1][0] is dense.on(torch.device("cpu"))
    for setup, (_, outs) in zip(setups, shared):
        blocks, own = outputs(setup)
        assert blocks is not shared[0][0]
        assert len(own) == len(outs) > 0 and all(torch.equal(a, b) for a, b in zip(own, outs))
    for other in (DenseWeights(setups[0].model, devices.dtype, 1), DenseWeights(setups[0].model, torch.bfloat16, 0)):
        with pytest.raises(ValueError, match="dense blocks .* do not fit"):
            Replay(setups[0], devices, CPU_RUN, dense=other)


def test_delayed_copies_are_waited_for(mix):
    records = []
    slow = ExecOptions(device="cpu", cpu_threads=1, accel_threads=1, copy_delay_s=0.003)
    result = execute(mix, "mixtral-offloading-best", TINY, slow, batch_size=BATCH, on_layer=records.append)
    _check_against_reference(records, prepare_replay(mix, "mixtral-offloading-best", TINY, batch_size=BATCH))
    assert result.summary["on_demand"] > 0 and result.summary["prefetch_used"] > 0
    copies: dict[tuple, list[float]] = {}
    computes = []
    for iv in result.intervals:
        if iv.name.startswith(("fetch", "prefetch")):
            _, layer, expert = iv.name.split(" ")
            copies.setdefault((iv.args["step"], layer, expert), []).append(iv.end)
        elif iv.track == "gpu" and iv.name.startswith("L"):
            layer, expert = iv.name.split(" ")
            computes.append(((iv.args["step"], layer, expert), iv.start))
    waited = 0
    for key, start in computes:
        # the copy of this step that brought the expert (prefetches are issued in the same step)
        landed = [end for end in copies.get(key, []) if end <= start + 1e-9]
        if key in copies:
            assert landed, f"{key} computed at {start} before its copy landed at {copies[key]}"
            waited += 1
    assert waited > 10
    assert result.per_layer["gpu_wait_s"].sum() > 0


@pytest.mark.parametrize("staging,cached", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 0), (3, 0)])
def test_staged_experts_cycle_through_few_buffers(mix, staging, cached, tmp_path):
    """More staged experts than staging buffers: turns of one expert (1, 2, 3 buffers: one buffer, or halves
    that alternate) or of two (4 buffers), with copies held back so a turn that did not wait would be caught;
    the outputs are the reference's, the counts the simulator's. Without a cache every accelerator expert is
    staged: no first group, the first turns' copies and the loop in one pause."""
    over = {"memory": {"staging_slots": str(staging), "cache_experts": str(cached)}}
    records = []
    slow = dataclasses.replace(CPU_RUN, copy_delay_s=0.001)
    result = execute(mix, "gpu-lru", TINY, slow, batch_size=BATCH, overrides=over, on_layer=records.append)
    setup = prepare_replay(mix, "gpu-lru", TINY, batch_size=BATCH, overrides=over)
    assert setup.memory.staging_slots == staging
    assert max(int(rec.plan.staged.sum()) for rec in records) > staging  # the buffers were cycled
    if not cached:
        assert all(rec.plan.staged.sum() == rec.plan.on_gpu.sum() for rec in records)
    _check_against_reference(records, setup)
    sim = simulate(setup.trace, setup.sysconf, hardware=setup.hardware, batch_size=BATCH, timing=False,
                   profiling=setup.profiled)
    assert {k: result.summary[k] for k in COUNTERS} == {k: sim.summary[k] for k in COUNTERS}
    fetched = sum(1 for iv in result.intervals if iv.name.startswith("fetch"))
    assert fetched == result.summary["on_demand"]  # one copy (and one timeline interval) per on-demand fetch


def test_one_expert_turns_gather_and_scatter_once_per_layer(mix, monkeypatch):
    """The loop of one-expert turns is fused: one gather of every turn's tokens and one scatter of their weighted
    outputs per layer visit, whatever the number of turns (before, a gather and a scatter per turn); each turn's
    computes use its buffer's views made once (no slicing of the buffer per turn). Outputs as the reference's."""
    over = {"memory": {"staging_slots": "2", "cache_experts": "0"}}
    loops = []

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            loops[-1][getattr(func, "__name__", str(func))] += 1
            return func(*args, **(kwargs or {}))

    single_loop = OffloadRuntime._single_loop

    def counted(self, turns, x, out_buf):
        loops.append(Counter(turns=len(turns.experts)))
        with Count():
            return single_loop(self, turns, x, out_buf)

    monkeypatch.setattr(OffloadRuntime, "_single_loop", counted)
    records = []
    execute(mix, "gpu-lru", TINY, CPU_RUN, batch_size=BATCH, overrides=over, on_layer=records.append)
    _check_against_reference(records, prepare_replay(mix, "gpu-lru", TINY, batch_size=BATCH, overrides=over))
    # (a visit of at most two staged experts gives each a buffer: one group, no turns)
    assert max(c["turns"] for c in loops) > 3 and len(loops) == sum(rec.plan.staged.sum() > 2 for rec in records)
    for c in loops:
        assert c["index_select"] == 1 and c["index_copy_"] == 1 and c["split"] == 1 and c["cat"] == 1, c
        assert c["linear"] == 2 * c["turns"] and c["copy_"] == c["turns"] - 2, c
        # per turn only the gate and up halves are sliced: the buffers' views were made once, not per turn
        assert c["__getitem__"] == 2 * c["turns"] and c["view"] == 0, c


def test_staged_experts_with_a_buffer_each_are_one_group_after_their_copies(mix, monkeypatch):
    """No cache and a staging buffer for every expert of a layer: on the CPU device the layer's copies and one group
    of all of them run in one pause of the stopwatch (no staging turn); copies held back, so a compute that did not
    wait for them would read stale buffers; outputs, counts and copy intervals as the reference and the simulator."""
    over = {"memory": {"staging_slots": "8", "cache_experts": "0"}}
    turns = []
    monkeypatch.setattr(OffloadRuntime, "_staging_turns", lambda self, *a: turns.append(1))
    records = []
    slow = dataclasses.replace(CPU_RUN, copy_delay_s=0.001)
    result = execute(mix, "gpu-lru", TINY, slow, batch_size=BATCH, overrides=over, on_layer=records.append)
    setup = prepare_replay(mix, "gpu-lru", TINY, batch_size=BATCH, overrides=over)
    assert all(rec.plan.staged.sum() == rec.plan.on_gpu.sum() > 0 for rec in records) and not turns
    _check_against_reference(records, setup)
    sim = simulate(setup.trace, setup.sysconf, hardware=setup.hardware, batch_size=BATCH, timing=False,
                   profiling=setup.profiled)
    assert {k: result.summary[k] for k in COUNTERS} == {k: sim.summary[k] for k in COUNTERS}
    assert sum(1 for iv in result.intervals if iv.name.startswith("fetch")) == result.summary["on_demand"]
    gpu = result.summary["executor"]["grouped_calls"]["gpu"]  # one group per layer visit, of all its experts
    assert gpu == {"calls": len(records), "experts": sum(int(rec.plan.on_gpu.sum()) for rec in records)}


@pytest.mark.parametrize("system,over,drained,kind", [
    ("gpu-lru", {"staging_slots": "2", "cache_experts": "3"}, False, "first group, one-expert turns"),
    ("gpu-lru", {"staging_slots": "8", "cache_experts": "0"}, False,
     "the staged experts' group, written by the route call"),
    ("gpu-static", {"cache_experts": "7"}, False, "every expert a hit"),
    ("mixtral-offloading-best", {}, True, "landed prefetches"),
    ("dali", {}, True, "landed prefetches, some declined by the cache: their buffers freed ahead"),
    ("moe-lightning-best", {"prefetch_slots": "1"}, True,
     "declined prefetches whose buffers waiting prefetches take: freed after the device work"),
])
def test_a_lane_settled_ahead_of_its_device_work_records_that_work(mix, monkeypatch, system, over, drained, kind):
    """On the CPU device a lane whose device work runs in one pause (its copies, then its groups or one-expert turns)
    is settled before that work: its records made, its staging buffers returned, the layer's end checked; the work
    writes its stamps into the records as it runs. Copies held back: a compute that did not wait would read stale
    buffers. Outputs as the reference's, counts as the simulator's, an interval per expert computed. With prefetches,
    a visit's background copies land before it (``drained``): a lane with prefetched experts is settled once they
    have landed; the buffers of those the cache declines are freed with it, or, where a prefetch waits for one,
    after the device work (a copy into a buffer before its compute had read it would change the outputs)."""
    settle, group, run_experts = OffloadRuntime._settle_ahead, OffloadRuntime._group, OffloadRuntime.run_experts
    issue, forward = OffloadRuntime._issue_deferred, OffloadRuntime._forward_group
    settled, built, events = [], [], []

    def spy(self, plan, lanes, stage_rows, late=False):
        waiting = bool(self.deferred)
        events.append("late" if late else "settled")
        settle(self, plan, lanes, stage_rows, late)
        settled.append((self.pool.staging_taken, lanes.staging_used, lanes.settled, lanes.all_cached,
                        bool((plan.source == PREFETCHED).any()), len(lanes.freed), waiting, late))

    def issued(self):
        events.append("issue" if self.deferred and self.pool.prefetch_free else "nothing to issue")
        return issue(self)

    def computed(self, *a):
        events.append("compute")
        return forward(self, *a)

    def landed_first(self, *a, **k):
        self.copies.drain()
        return run_experts(self, *a, **k)

    monkeypatch.setattr(OffloadRuntime, "_settle_ahead", spy)
    monkeypatch.setattr(OffloadRuntime, "_group", lambda self, *a: built.append(1) or group(self, *a))
    monkeypatch.setattr(OffloadRuntime, "_issue_deferred", issued)
    monkeypatch.setattr(OffloadRuntime, "_forward_group", computed)
    if drained:
        monkeypatch.setattr(OffloadRuntime, "run_experts", landed_first)
    records = []
    slow = dataclasses.replace(CPU_RUN, copy_delay_s=0.001)
    result = execute(mix, system, TINY, slow, batch_size=BATCH, overrides={"memory": over}, on_layer=records.append)
    setup = prepare_replay(mix, system, TINY, batch_size=BATCH, overrides={"memory": over})
    _check_against_reference(records, setup)
    sim = simulate(setup.trace, setup.sysconf, hardware=setup.hardware, batch_size=BATCH, timing=False,
                   profiling=setup.profiled)
    assert {k: result.summary[k] for k in COUNTERS} == {k: sim.summary[k] for k in COUNTERS}
    assert len(settled) > len(records) // 2, kind
    assert all(s[:3] == (0, 0, True) for s in settled)
    assert all(s[7] == (s[5] > 0 and s[6]) for s in settled)  # (late: declined ones' buffers, a prefetch waiting)
    if over.get("cache_experts") == "0":  # (every group written by the route call: none built by the lane)
        assert not built
    if system == "gpu-static":
        assert any(s[3] for s in settled)  # (every expert a hit: one group, nothing copied)
    if system == "dali":  # (declined: prefetched, on the GPU, not admitted)
        assert sum(s[5] for s in settled) > 0
    elif system == "moe-lightning-best":
        assert sum(s[7] for s in settled) > 0
        for i in (i for i, e in enumerate(events) if e == "late"):  # the waiting prefetches start after the computes
            first_issue = events.index("issue", i)
            assert "compute" in events[i:first_issue] and "settled" not in events[i:first_issue]
    elif drained:
        assert sum(s[4] for s in settled) == sum(bool((rec.plan.source == PREFETCHED).any()) for rec in records) > 0
    computed = [iv for iv in result.intervals if iv.track == "gpu" and iv.name.startswith("L")]
    assert len(computed) == result.summary["executor"]["grouped_calls"]["gpu"]["experts"]
    assert all(math.isfinite(iv.start) and iv.end >= iv.start >= 0 for iv in computed)


def test_a_compute_from_a_slot_still_being_copied_is_caught(mix, monkeypatch):
    # prefetches are background copies (the copy thread); on the CPU device on-demand copies are made by the
    # lane itself before it computes, so a lane that forgets to wait can only compute from a prefetch in flight
    monkeypatch.setattr(OffloadRuntime, "_is_present", lambda self, slot: True)  # a lane that forgets to wait
    slow = ExecOptions(device="cpu", cpu_threads=1, accel_threads=1, copy_delay_s=0.05)
    with pytest.raises(SlotNotReady, match="has not completed"):
        execute(mix, "mixtral-offloading-best", TINY, slow, batch_size=BATCH)  # the reading that prefetches


def test_replays_are_deterministic(mix):
    def outputs(seed):
        recs = []
        r = execute(mix, "dali", TINY, CPU_RUN, batch_size=BATCH, seed=seed, on_layer=recs.append)
        return r, [rec.output.clone() for rec in recs]

    (r1, a), (r2, b) = outputs(0), outputs(0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert {k: r1.summary[k] for k in COUNTERS} == {k: r2.summary[k] for k in COUNTERS}
    _, c = outputs(1)
    assert not torch.equal(a[-1], c[-1])


def test_gpt_oss_trace_scaled_in_bf16():
    records = []
    opts = ReplayOptions(layers=2, scale=1 / 32, sequences=2, max_tokens=6)
    result = execute(GPT_OSS, "gpu-lru", opts, CPU_RUN, batch_size=BATCH, on_layer=records.append)
    setup = prepare_replay(read_trace(GPT_OSS), "gpu-lru", opts, batch_size=BATCH)
    assert setup.model.hidden_size == 90 and setup.model.num_moe_layers == 2 and records[0].output.dtype == torch.bfloat16
    assert result.summary["steps"] == 6 and result.summary["tokens"] == 12
    assert result.manifest["executor"]["expert_activation"] == "gpt-oss clamped GLU"
    _check_against_reference(records, setup, rtol=2e-2, atol=2e-2)
    # the same slots per layer as the full model's plan on the profile's 24 GiB
    assert setup.memory.capacities.tolist() == setup.full_memory.capacities[:2].tolist()
    assert math.isclose(result.summary["bytes_h2d"], result.summary["transfers"] * setup.model.expert_bytes)


def test_default_lane_threads_leave_the_main_and_copy_threads_a_core_each_on_cuda(monkeypatch):
    from dali_exec.executor import devices

    monkeypatch.setattr(devices.os, "cpu_count", lambda: 16)
    assert devices.lane_threads(True, None, None) == (14, None)
    assert devices.lane_threads(True, 3, None) == (3, None)
    assert devices.lane_threads(False, None, None) == (8, 8)
    monkeypatch.setattr(devices.os, "cpu_count", lambda: 2)
    assert devices.lane_threads(True, None, None) == (1, None)
    with pytest.raises(ValueError, match="cpu_threads must be >= 1"):
        devices.lane_threads(True, 0, None)


def test_random_weights_drawn_on_threads_are_those_of_one_thread(monkeypatch):
    """Experts and dense blocks each have their own generator, so the store and the dense blocks drawn by a pool of
    threads equal those drawn by one thread, and an expert regenerated alone equals its row."""
    from dali_exec.executor import store as store_mod
    from dali_exec.executor.dense import DenseWeights
    from dali_exec.executor.ffn import ExpertLayout, init_expert_
    from dali_exec.executor.store import EXPERT, derive_seed

    from dali_sim.models.presets import get_model
    from dali_sim.models.scaled import scale_model

    model = scale_model(get_model("deepseek-v2-lite"), 1 / 64, 3, "fp32")  # (a dense block, then MoE blocks)
    cpu = torch.device("cpu")
    many = HostExpertStore.random(model, torch.float32, 7)
    blocks = DenseWeights(model, torch.float32, 7).on(cpu)
    monkeypatch.setattr(store_mod.os, "cpu_count", lambda: 1)  # (store.drawing_pool: one thread)
    one = HostExpertStore.random(model, torch.float32, 7)
    alone = DenseWeights(model, torch.float32, 7).on(cpu)
    assert torch.equal(many.weights, one.weights)
    assert len(blocks) == len(alone) == model.num_layers
    for a, b in zip(blocks, alone):
        assert a.moe == b.moe and torch.equal(a.wqkv, b.wqkv) and torch.equal(a.wo, b.wo)
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.ffns, b.ffns))
    layout = ExpertLayout.of(model)
    again = init_expert_(torch.empty(layout.numel), layout, torch.Generator().manual_seed(derive_seed(7, EXPERT, 1, 5)))
    assert torch.equal(again, many.weights[1, 5])
