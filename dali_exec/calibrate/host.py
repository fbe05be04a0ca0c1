"""The executor's own host time, measured: what a layer visit costs beyond the device work it times.

A replay's layer is more than its timed activities (dense part, experts, copies): the policies decide
(``Controller.plan``), the runtime groups the routing, issues copies, hands the CPU lane its work, waits
for threads to wake, combines the outputs. The simulator adds this host time per layer visit
(``HostCosts``, the ``dali-executor`` implementation) so that it predicts the executor, not only the
devices. Two measurements, both on a random workload of the calibrated shape (never the trace that is
later validated):

* **bookkeeping**: short replays of three systems whose activities never overlap: ``cpu-only`` (dense
  part, then the CPU lane), ``gpu-static`` with every expert resident (dense part, then the GPU lane)
  and ``gpu-lru`` with no cache and one staging buffer (every GPU expert copied on demand, its copy,
  then its compute, then the next copy), at two batch sizes. Per step, the time no timed activity
  covers (step time minus dense parts, expert computes, copies and the policies' own decision time) is
  fitted by non-negative least squares as ``layers x layer_s + GPU experts x gpu_expert_s + CPU experts
  x cpu_expert_s + copies x copy_s``: ``copy_s`` is what one on-demand copy costs the host besides the
  copy itself (issuing it from the calling thread, waking up when it lands, a staging turn). The
  hand-over of the CPU lane to its sleeping worker (cpu-only's, on CUDA) is taken out first: the simulator
  charges it apart (``lane_wake.host``, measured by ``Microbench.handoff_seconds``).
* **decisions**: ``Controller.plan`` (and counting) per layer visit in a replay of every system preset
  (or of ``HostSettings.systems``), the median of the replay's ``host`` intervals, on the same workload
  with the memory plan of the default budget. Measured inside replays, not in a loop of plans: after a
  layer's computes and copies the host's caches are cold, and a plan costs several times its warm cost
  (on the 2-core CPU-device VM, DeepSeek-V2-Lite shape at scale 1/4: ``cpu-only`` 70 us in a replay
  against 4.5 us in a loop, ``dali`` 188 against 24 us).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from dali_exec.executor.dense import DenseWeights
from dali_exec.executor.devices import Devices
from dali_exec.executor.problem import ReplayOptions, prepare_replay
from dali_exec.executor.replay import ExecOptions, Replay
from dali_exec.executor.store import HostExpertStore
from dali_sim.hardware.measured import HostCosts
from dali_sim.models.spec import ModelSpec
from dali_sim.policies.systems import system_names
from dali_sim.trace.reader import Trace, read_trace
from dali_sim.trace.schema import DECODE, PREFILL, PredictorInfo
from dali_sim.trace.writer import TraceWriter

#: lookahead columns of the workload (every predictor a preset reads), with their target offsets
PREDICTORS = (("residual", 1), ("next-gate", 1), ("gate2", 2), ("gate3", 3))


@dataclass(frozen=True)
class HostSettings:
    layers: int = 4  # MoE layers of the replays (host time is per layer visit)
    sequences: int = 8
    prompt_tokens: int = 12
    decode_tokens: int = 10
    batch_sizes: tuple[int, ...] = (1, 4)
    seed: int = 0
    systems: tuple[str, ...] | None = None  # presets whose decisions are measured; None = every one that can run


def workload_trace(model: ModelSpec, s: HostSettings, directory: Path) -> Trace:
    """A random-routing trace of ``model`` (the full-size shape, every MoE layer; replays cut it to their
    first layers), with every lookahead column a preset reads."""
    rng = np.random.default_rng(s.seed)
    layers = np.asarray(model.moe_layers)
    L, E, k = len(layers), model.num_experts, model.top_k
    tokens = s.prompt_tokens + s.decode_tokens
    seq = np.repeat(np.arange(s.sequences), tokens * L)
    pos = np.tile(np.repeat(np.arange(tokens), L), s.sequences)
    layer = np.tile(layers, s.sequences * tokens)
    n = len(seq)
    experts = np.argsort(rng.random((n, E)), axis=1)[:, :k]
    weights = np.full((n, k), 1.0 / k, np.float32)
    phase = np.where(pos < s.prompt_tokens, PREFILL, DECODE)
    predictors = [PredictorInfo(name, offset, "random logits (calibration workload)") for name, offset in PREDICTORS]
    look = {}
    for name, offset in PREDICTORS:
        logits = rng.standard_normal((n, E)).astype(np.float32)
        ordinal = np.searchsorted(layers, layer)
        logits[ordinal + offset >= L] = np.nan  # no target layer
        look[name] = logits
    path = directory / "host-calibration.parquet"
    with TraceWriter(path, model, predictors=predictors,
                     provenance={"source": "random routing", "command": "dali_exec.calibrate.host"}) as w:
        w.write(seq_id=seq, phase=phase, pos=pos, layer=layer, experts=experts, weights=weights, lookahead=look)
    return read_trace(path)


def _critical_busy(result, steps: int) -> np.ndarray:
    """Per step: seconds of the dense parts, expert computes, copies and decisions (the activities a layer
    of a system without overlapping activities runs one after the other)."""
    busy = np.zeros(steps)
    for iv in result.intervals:
        if iv.track in ("gpu", "cpu", "host", "pcie"):
            busy[int(iv.args["step"])] += iv.end - iv.start
    return busy


def _bookkeeping_rows(trace: Trace, opts: ReplayOptions, devices: Devices, run: ExecOptions,
                      store: HostExpertStore, s: HostSettings, *, dense: DenseWeights | None = None,
                      handoff_s: float = 0.0):
    """(rows of [layer visits, GPU experts, CPU experts, copies], unexplained seconds) per step of the
    replays. ``handoff_s``: what handing the CPU lane to its sleeping worker costs the host (``lane_wake.host``,
    which the simulator charges apart), taken out of each step where cpu-only's replay hands its lane over
    (on CUDA, where the lane's threads differ from the calling thread's; on the CPU device it runs inline)."""
    X, y = [], []
    big = repr(float(1 << 20))
    full = {"memory": {"gpu_memory_gib": big, "cache_experts": str(trace.num_experts)}}
    serial_copies = {"memory": {"gpu_memory_gib": big, "cache_experts": "0", "staging_slots": "1"}}
    for system, over in (("cpu-only", None), ("gpu-static", full), ("gpu-lru", serial_copies)):
        for batch in s.batch_sizes:
            setup = prepare_replay(trace, system, opts, batch_size=batch, overrides=over)
            replay = Replay(setup, devices, run, seed=s.seed, store=store, dense=dense)
            try:
                replay.run()  # warm-up (lazy initialisation)
                before = replay.runtime.cpu_handoffs
                result = replay.run()
                handed = replay.runtime.cpu_handoffs - before
            finally:
                replay.close()
            w = setup.workload
            visits = w.num_steps * w.num_layers
            if handed not in (0, visits if system == "cpu-only" else 0):  # (all or nothing: one lane, one rule)
                raise AssertionError(f"host fit: {system} handed {handed} of {visits} layer visits to the CPU worker")
            per_step = result.per_step
            covered = _critical_busy(result, w.num_steps)
            counts = np.zeros((w.num_steps, 3))  # GPU experts, CPU experts, copies
            for step in range(w.num_steps):
                for layer in range(w.num_layers):
                    _, c, _ = w.activated(step, layer)
                    counts[step, 1 if system == "cpu-only" else 0] += len(c)
                    counts[step, 2] += len(c) if system == "gpu-lru" else 0
            handoffs = handoff_s * w.num_layers if handed else 0.0  # (per step: every layer visit)
            for step in range(w.num_steps):
                X.append([w.num_layers, *counts[step]])
                y.append(float(per_step["time_s"].iloc[step]) - covered[step] - handoffs)
    return np.array(X, float), np.array(y, float)


def decision_seconds(trace: Trace, opts: ReplayOptions, devices: Devices, run: ExecOptions,
                     store: HostExpertStore, s: HostSettings, *, dense: DenseWeights | None = None) -> dict[str, float]:
    """Median wall seconds per layer visit of the policies' decisions (``Controller.plan`` and counting: the
    replay's ``host`` intervals) in one replay of each preset of ``s.systems``, by default of every preset
    that can run on the workload with the default budget scaled to the replay (as a validation runs it); a
    default preset that cannot, e.g. for lack of memory, is left out, a named one is an error."""
    out = {}
    for system in s.systems or system_names():
        try:
            setup = prepare_replay(trace, system, opts, batch_size=max(s.batch_sizes))
        except (ValueError, KeyError) as exc:
            if s.systems:
                raise ValueError(f"host decisions of system {system!r}: {exc}") from None
            continue
        replay = Replay(setup, devices, run, seed=s.seed, store=store, dense=dense)
        try:
            result = replay.run()
        finally:
            replay.close()
        visits = [iv.end - iv.start for iv in result.intervals if iv.track == "host"]
        out[system] = float(statistics.median(visits))
    return out


def measure_host_costs(model: ModelSpec, scale: float, dtype: str, devices: Devices, run: ExecOptions,
                       s: HostSettings = HostSettings(), handoff_s: float = 0.0) -> HostCosts:
    """The executor's :class:`HostCosts` for ``model`` (full size) replayed at ``scale`` in ``dtype``;
    ``handoff_s``: the host's hand-over to a sleeping thread, charged apart (:func:`_bookkeeping_rows`)."""
    with tempfile.TemporaryDirectory(prefix="dali-host-") as tmp:
        trace = workload_trace(model, s, Path(tmp))
        opts = ReplayOptions(scale=scale, layers=min(s.layers, model.num_moe_layers), dtype=dtype)
        setup = prepare_replay(trace, "cpu-only", opts)
        store = HostExpertStore.random(setup.model, devices.dtype, s.seed, pin=devices.is_cuda)
        dense = DenseWeights(setup.model, devices.dtype, s.seed)
        run = dataclasses.replace(run, progress=False)
        X, y = _bookkeeping_rows(trace, opts, devices, run, store, s, dense=dense, handoff_s=handoff_s)
        coef, _ = nnls(X, np.maximum(y, 0.0))
        decisions = decision_seconds(trace, opts, devices, run, store, s, dense=dense)
    return HostCosts(layer_s=float(coef[0]), gpu_expert_s=float(coef[1]), cpu_expert_s=float(coef[2]),
                     copy_s=float(coef[3]), decision_s=decisions)


__all__ = ["HostSettings", "PREDICTORS", "decision_seconds", "measure_host_costs", "workload_trace"]
