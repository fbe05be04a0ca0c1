"""The executor on CUDA (``python -m pytest -m gpu`` on a CUDA machine): the same checks as on the CPU
device, plus what only a GPU shows: pinned host weights, copies overlapping computes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from dali_exec.calibrate import CalibrationConfig, MicroSettings, calibrate  # noqa: E402
from dali_exec.executor import (  # noqa: E402
    ExecOptions,
    HostExpertStore,
    ReplayOptions,
    SlotNotReady,
    execute,
    prepare_replay,
    reference_moe,
)
from dali_exec.executor.runtime import OffloadRuntime  # noqa: E402
from dali_sim.policies import system_names  # noqa: E402
from dali_sim.trace import read_trace  # noqa: E402
from dali_sim.trace.synth import SynthConfig, synthesize  # noqa: E402

from conftest import REPO  # noqa: E402

GPU = ExecOptions(device="cuda")
OPTS = ReplayOptions(layers=4, scale=1 / 16, dtype="bf16")


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "mix.parquet"
    synthesize(SynthConfig(model="mixtral-8x7b", sequences=4, prompt_len=16, gen_len=8, seed=5,
                           lookahead=("residual=0.9", "next-gate=0.7", "gate2=0.6@2", "gate3=0.5@3")), path)
    return read_trace(path)


def _check_against_reference(records, setup):
    """Each executed layer's output = its residual + the reference MoE from the host weights (bf16 tolerance)."""
    store = HostExpertStore.random(setup.model, torch.bfloat16, 0)
    for rec in records:
        ref = rec.residual + reference_moe(store, rec.layer, rec.gate_input, rec.ids, rec.weights)
        torch.testing.assert_close(rec.output, ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("system", [s for s in system_names() if s not in ("oracle-heuristic", "lower-bound")])
def test_every_preset_equals_the_reference_on_cuda(mix, system):
    records = []
    result = execute(mix, system, OPTS, GPU, batch_size=2, on_layer=records.append)
    _check_against_reference(records, prepare_replay(mix, system, OPTS, batch_size=2))
    assert result.manifest["executor"]["host_weights_pinned"] is True
    assert result.summary["executor"]["device"].startswith("cuda")


@pytest.mark.parametrize("staging,cached", [(1, 1), (2, 1), (2, 0), (3, 0), (4, 1)])
def test_staged_experts_cycle_through_few_buffers_on_cuda(mix, staging, cached):
    """As on the CPU device (test_exec_replay.py): more staged experts than staging buffers, so turns of one
    expert (the fused loop: the turns' pairs copied to the GPU once, one gather, one scatter, each copy after the
    event of the compute that last read its buffer) or of two; outputs as the reference's, one copy and one
    timeline interval per on-demand fetch, the counts the simulator's."""
    from dali_sim.sim import simulate
    from dali_sim.sim.counters import COUNTERS

    over = {"memory": {"staging_slots": str(staging), "cache_experts": str(cached)}}
    records = []
    result = execute(mix, "gpu-lru", OPTS, GPU, batch_size=2, overrides=over, on_layer=records.append)
    setup = prepare_replay(mix, "gpu-lru", OPTS, batch_size=2, overrides=over)
    assert max(int(rec.plan.staged.sum()) for rec in records) > staging  # the buffers were cycled
    _check_against_reference(records, setup)
    sim = simulate(setup.trace, setup.sysconf, hardware=setup.hardware, batch_size=2, timing=False,
                   profiling=setup.profiled)
    assert {k: result.summary[k] for k in COUNTERS} == {k: sim.summary[k] for k in COUNTERS}
    assert sum(1 for iv in result.intervals if iv.name.startswith("fetch")) == result.summary["on_demand"]


def test_copies_overlap_computes_on_cuda(mix):
    # prefetches are what overlaps: an on-demand copy is waited for by the compute that reads it, and the
    # released mixtral-offloading code (the default reading) prefetches nothing (seen on an H200: no overlap)
    result = execute(mix, "mixtral-offloading-best", OPTS, GPU, batch_size=2)
    gpu = [iv for iv in result.intervals if iv.track == "gpu"]
    pcie = [iv for iv in result.intervals if iv.track == "pcie"]
    overlap = sum(max(0.0, min(a.end, b.end) - max(a.start, b.start)) for a in pcie for b in gpu)
    assert pcie and overlap > 0  # the copy stream ran while the compute stream worked


def test_unready_slot_is_caught_on_cuda(mix, monkeypatch):
    # as on the CPU device (test_exec_replay.py): only a prefetch in flight can be computed from too early.
    # On CUDA an on-demand copy is ordered before its compute by an event on the device, and gpu-lru (which
    # fetches only on demand) gave nothing to catch on an H200
    monkeypatch.setattr(OffloadRuntime, "_is_present", lambda self, slot: True)
    with pytest.raises(SlotNotReady, match="has not completed"):
        execute(mix, "mixtral-offloading-best", OPTS, ExecOptions(device="cuda", copy_delay_s=0.05), batch_size=2)


def test_gpt_oss_full_width_layers_on_cuda():
    opts = ReplayOptions(layers=4, scale=1.0, sequences=2, max_tokens=16, dtype="bf16")
    r = execute(REPO / "traces" / "gpt-oss-20b.parquet", "gpu-lru", opts, GPU, batch_size=2)
    assert r.summary["decode_tokens_per_s"] > 0 and r.summary["overhead"]["fraction_of_layer_time"] > 0


def test_calibrate_on_cuda_records_the_gpu():
    cfg = CalibrationConfig("mixtral-8x7b", scale=1 / 8, device="cuda", expert_tokens=(1, 16, 64),
                            dense_tokens=(1, 16), context_lens=(1, 256), settings=MicroSettings(repeats=3, warmup=1))
    p = calibrate(cfg)
    assert p.provenance["devices"]["gpu_is_cpu_device"] is False and "cuda" in p.provenance["versions"]
    assert torch.cuda.get_device_name() in p.gpu.name
    assert min(p.h2d.seconds) > 0 and min(p.gpu_expert.seconds) > 0 and min(p.cpu_expert.seconds) > 0
