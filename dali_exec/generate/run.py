"""``generate()``: greedy generation by a transformers MoE model whose routed experts are offloaded.

The same pieces as a trace replay (:mod:`dali_exec.executor.replay`), driven by a real model instead of
a trace: the system's policies behind the simulator's :class:`Controller`, fed by an
:class:`~dali_sim.workload.online.OnlineWorkload` as the model routes; the memory plan of
:func:`~dali_sim.runtime.memory.plan_memory` for the model's spec; the :class:`OffloadRuntime` with the
model's real expert weights (:mod:`.experts`). Generation is the recorder's greedy loop
(:func:`dali_exec.recorder.greedy_generate`: left padding, EOS, the same tokens as
``model.generate(do_sample=False)``), so every forward pass is one step of the workload, exactly as in a
trace recorded from the same prompts (``dali trace record``). See docs/executor.md, "Real models".
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from dali_exec.executor.devices import Devices, lane_threads
from dali_exec.executor.doorbell import DEFAULT_SPIN_US, check_spin_us
from dali_exec.executor.problem import DTYPE_PRECISION
from dali_exec.executor.result import executor_summary, overhead_summary
from dali_exec.executor.runtime import OffloadRuntime
from dali_exec.executor.timing import Timer, paused_gc, stamps_ahead
from dali_exec.generate.experts import pack_experts
from dali_exec.generate.session import PADDING, OffloadSession
from dali_exec.models import get_adapter
from dali_exec.recorder.generation import greedy_generate
from dali_exec.recorder.prompts import Prompt, check_fits, read_prompts, tokenize
from dali_exec.recorder.record import check_spec, special_ids
from dali_exec.recorder.residual import ResidualVectors, config_sha256
from dali_sim import __version__
from dali_sim.hardware.cost import CostModel
from dali_sim.hardware.profile import load_profile
from dali_sim.models.hf_config import spec_from_hf_config
from dali_sim.hardware.implementation import EXECUTOR
from dali_sim.policies.systems import resolve_system
from dali_sim.runtime.controller import Controller
from dali_sim.runtime.memory import plan_memory
from dali_sim.sim.engine import EngineOutput
from dali_sim.sim.simulate import DEFAULT_HARDWARE, SimResult, result_tables
from dali_sim.trace.provenance import file_sha256
from dali_sim.workload.builder import WorkloadConfig
from dali_sim.workload.online import ONLINE_PREDICTORS, OnlineWorkload, check_online, frequencies_from_trace, \
    predictor_offset


#: torch dtype of the model -> the executor's dtype name (slots and host store)
MODEL_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class GenerateOptions:
    """How to generate and run (CLI: ``dali exec generate``)."""

    batch_size: int = 1
    max_new_tokens: int = 32
    prefill_chunk: int = 0
    residual: str | Path | ResidualVectors | None = None  # residual vectors (``dali trace calibrate-residual``)
    frequencies_from: str | Path | None = None  # a prior trace of the model: per-expert frequencies
    device: str | None = None  # the accelerator: cuda | cpu | cuda:N; None = CUDA if present
    cpu_threads: int | None = None  # CPU lane; default: all cores but two (CUDA), the process's count (CPU device)
    accel_threads: int | None = None  # main thread on the CPU device; default: unchanged
    copy_delay_s: float = 0.0  # tests: hold every copy back this long
    padding: str = "exact"  # rows outside the workload (padding, stopped sequences): exact | skip (session.PADDING)
    progress: bool = False
    spin_us: float = DEFAULT_SPIN_US  # the CPU lane's worker spins this long for its next job before it sleeps

    def __post_init__(self) -> None:
        check_spin_us(self.spin_us)
        if self.padding not in PADDING:
            raise ValueError(f"padding must be one of {', '.join(PADDING)}, got {self.padding!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        for name in ("max_new_tokens", "prefill_chunk"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def threads(self, devices: Devices) -> tuple[int, int | None]:
        """(CPU lane threads, main-thread threads or None = leave as is). On the CPU device both lanes
        default to the process's thread count: matrix products then run with the thread count plain
        transformers uses, which keeps their results bit for bit the model's."""
        if devices.is_cuda:
            return lane_threads(True, self.cpu_threads, None)[0], None
        lane_threads(False, self.cpu_threads, self.accel_threads)  # validates
        return self.cpu_threads or torch.get_num_threads(), self.accel_threads


@dataclass
class GeneratedSequence:
    seq_id: int
    name: str
    prompt_tokens: int
    token_ids: list[int]
    text: str | None
    stop: str  # eos | length


@dataclass
class GenerateResult(SimResult):
    """A :class:`SimResult` (summary, per_layer, per_sequence, per_step, config, manifest, intervals) plus
    what was generated."""

    generated: list[GeneratedSequence] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "generated": [dataclasses.asdict(g) for g in self.generated]}

    @property
    def token_ids(self) -> dict[int, list[int]]:
        return {g.seq_id: g.token_ids for g in self.generated}


def _as_prompts(prompts: Sequence[Prompt | str | Sequence[int]]) -> list[Prompt]:
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, Prompt):
            out.append(p)
        elif isinstance(p, str):
            out.append(Prompt(i, f"prompt-{i}", text=p))
        else:
            out.append(Prompt(i, f"prompt-{i}", input_ids=tuple(int(t) for t in p)))
    if len({p.index for p in out}) != len(out):
        raise ValueError("prompt indices must be unique")
    return out


def _residuals(source, model, spec) -> ResidualVectors:
    vectors = source if isinstance(source, ResidualVectors) else ResidualVectors.load(source)
    vectors.check_matches(model, spec.moe_layers, vectors.source or str(source))
    return vectors


def _max_kv_tokens(lengths: list[int], batch_size: int, max_new_tokens: int) -> int:
    """KV-cache entries of the largest step the run can have: per batch its prompts plus ``max_new_tokens``
    - 1 fed-back tokens each (an upper bound: sequences may stop at EOS)."""
    extra = max(max_new_tokens - 1, 0)
    return max(sum(n + extra for n in lengths[i:i + batch_size]) for i in range(0, len(lengths), batch_size))


class _Observer:
    """Brackets each forward pass of the greedy loop as one step of the session."""

    def __init__(self, session: OffloadSession):
        self.session = session
        self.seq_ids = np.zeros(0, np.int64)
        self.batch = 0

    def before_forward(self, rows) -> None:
        self.session.begin_forward(rows, self.seq_ids[rows.row], self.batch)

    def after_forward(self, rows) -> None:
        self.session.end_forward()


def generate(model, prompts: Sequence[Prompt | str | Sequence[int]], system: str,
             options: GenerateOptions = GenerateOptions(), *, tokenizer=None, hardware: str | Path = DEFAULT_HARDWARE,
             seed: int = 0, overrides: Mapping[str, Mapping[str, str]] | None = None, model_path: str | None = None,
             prompts_source: str = "", free_experts: bool = False) -> GenerateResult:
    """Generate greedily for ``prompts`` with ``model``'s routed experts offloaded under ``system``.

    The model is changed only while this runs (its MoE blocks' ``experts`` are swapped for the runtime's,
    and it is moved to the system's dense device); afterwards it is as before, unless ``free_experts``
    (the CLI: the expert tensors are released once copied to the host store, and not put back)."""
    prompts = _as_prompts(prompts)
    adapter = get_adapter(model)
    blocks = adapter.blocks(model)
    if model.dtype not in MODEL_DTYPES:
        raise ValueError(f"model dtype {model.dtype} is not supported; use float32, bfloat16 or float16")
    dtype_name = MODEL_DTYPES[model.dtype]
    name = Path(model_path).name if model_path else (getattr(model.config, "_name_or_path", "") or
                                                     model.config.model_type)
    spec = spec_from_hf_config(model.config.to_dict(), name=name or None, precision=DTYPE_PRECISION[dtype_name])
    check_spec(spec, blocks, model_path or name)
    # the run is dali's executor: its decisions use that implementation's costs (as a replay's do)
    over = {k: dict(v) for k, v in (overrides or {}).items()}
    over.setdefault("system", {})["implementation"] = EXECUTOR
    sysconf = resolve_system(system, over, spec)
    check_online(sysconf)
    placement, cache, prefetch = (c.build() for c in (sysconf.placement, sysconf.cache, sysconf.prefetch))
    needed = prefetch.required_predictors()
    offsets = {}
    for p in needed:
        try:
            offsets[p] = predictor_offset(p)
        except ValueError as exc:
            raise ValueError(f"system {sysconf.name!r}: prefetch policy {prefetch.name!r} reads {exc}") from None
    residuals = None
    if "residual" in offsets and options.residual is None:
        raise ValueError(f"system {sysconf.name!r}: prefetch policy {prefetch.name!r} reads the `residual` lookahead "
                         "(DALI's residual-based prediction), which needs residual vectors: pass --residual FILE "
                         "(made by `dali trace calibrate-residual`)")
    if options.residual is not None:
        residuals = _residuals(options.residual, model, spec)

    source = prompts_source or "prompts"
    if options.batch_size > len(prompts):
        raise ValueError(f"batch size {options.batch_size} exceeds the {len(prompts)} prompt(s) of {source}: use "
                         f"--batch-size {len(prompts)} or less, or more prompts")
    token_ids = tokenize(prompts, tokenizer, source)
    check_fits(prompts, token_ids, model.config, options.max_new_tokens, source)
    eos, pad = special_ids(model, tokenizer)

    freq, freq_source = None, "uniform (every expert 1; no --profile-trace)"
    if options.frequencies_from is not None:
        freq = frequencies_from_trace(options.frequencies_from, spec)
        freq_source = f"trace {options.frequencies_from} (sha256 {file_sha256(options.frequencies_from)[:16]})"
    workload = OnlineWorkload(spec, offsets, frequencies=freq, frequencies_source=freq_source,
                              config=WorkloadConfig(options.batch_size, options.prefill_chunk))
    profile = load_profile(hardware)
    costs = CostModel(profile, spec, implementation=sysconf.implementation, system=sysconf.name)
    L, E = spec.num_moe_layers, spec.num_experts
    max_kv = _max_kv_tokens([len(t) for t in token_ids], options.batch_size, options.max_new_tokens)
    mem = plan_memory(spec, sysconf.memory, profile.gpu_memory_bytes, max_kv,
                      required=placement.required_capacities(L, E))
    controller = Controller(workload, costs, placement, cache, prefetch, mem.capacities,
                            cache_init=sysconf.memory.cache_init, prefetch_slots=mem.prefetch_slots,
                            staging_slots=mem.staging_slots, seed=seed)

    devices = Devices.create(options.device, dtype_name)
    cpu_threads, accel_threads = options.threads(devices)
    dense_device = devices.of(sysconf.dense_device)
    t_setup = time.perf_counter()
    store = pack_experts([b.experts for b in blocks], devices.dtype, pin=devices.is_cuda)
    if free_experts:
        _release(blocks)
    slot_bytes = (int(mem.capacities.sum()) + mem.prefetch_slots + mem.staging_slots) * \
        store.expert_nbytes
    if devices.is_cuda and slot_bytes > devices.accel_free_bytes():
        raise ValueError(f"the expert slots need {slot_bytes / 2**30:.2f} GiB on {devices.accel_name()} but "
                         f"{devices.accel_free_bytes() / 2**30:.2f} GiB are free: lower --gpu-memory")
    timer = Timer(devices.accel if devices.is_cuda else None)
    # on the CPU device both lanes use the process's threads by default: the CPU lane then runs in this
    # thread (while the accelerator lane waits for copies), not concurrently on the same cores
    shared = not devices.is_cuda and cpu_threads == (accel_threads or torch.get_num_threads())
    runtime = OffloadRuntime(store, devices, mem.capacities, mem.prefetch_slots, mem.staging_slots,
                             cpu_threads=cpu_threads, timer=timer, copy_delay_s=options.copy_delay_s, cpu_inline=shared,
                             pairs=options.batch_size * spec.top_k, spin_s=1e-6 * options.spin_us)
    session = None
    prev_threads = torch.get_num_threads()
    outputs: dict[int, list[int]] = {}
    try:
        runtime.load(controller.initial_resident)
        res_dev = None
        if residuals is not None:
            res_dev = {k: v.to(dense_device, torch.float32) for k, v in residuals.vectors.items()}
        session = OffloadSession(model, adapter, blocks, workload, controller, runtime, devices, timer,
                                 dense_device=dense_device, dense_track=sysconf.dense_device, residuals=res_dev,
                                 padding=options.padding)
        session.install()
        setup_s = time.perf_counter() - t_setup
        if accel_threads is not None:
            torch.set_num_threads(accel_threads)
        observer = _Observer(session)
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts), unit="seq", desc=f"generate {sysconf.name}", disable=not options.progress)
        batches = -(-len(prompts) // options.batch_size)  # (the prompt is one step, as each new token)
        timer.start(ahead=stamps_ahead(batches * (options.max_new_tokens + 1) * L,
                                       min(E, options.batch_size * spec.top_k)))
        t_gen = time.perf_counter()
        with paused_gc():
            for b, start in enumerate(range(0, len(prompts), options.batch_size)):
                batch = prompts[start:start + options.batch_size]
                observer.seq_ids = np.array([p.index for p in batch], np.int64)
                observer.batch = b
                out = greedy_generate(model, token_ids[start:start + len(batch)],
                                      max_new_tokens=options.max_new_tokens, eos_ids=eos, pad_id=pad,
                                      prefill_chunk=options.prefill_chunk, observer=observer)
                for p, gen in zip(batch, out.generated):
                    outputs[p.index] = gen
                bar.update(len(batch))
        runtime.finish()
        wall_s = time.perf_counter() - t_gen
        bar.close()
    finally:
        torch.set_num_threads(prev_threads)
        runtime.close()
        if session is not None:
            session.uninstall(restore=not free_experts)

    generated = []
    for p, ids in zip(prompts, token_ids):
        gen = outputs.get(p.index, [])
        text = tokenizer.decode(gen, skip_special_tokens=True) if tokenizer is not None else None
        generated.append(GeneratedSequence(p.index, p.name, len(ids), gen, text,
                                           "eos" if gen and gen[-1] in eos else "length"))
    executor = {
        "devices": devices.describe(),
        "options": {k: (str(v) if isinstance(v, (Path, ResidualVectors)) else v)
                    for k, v in dataclasses.asdict(options).items() if k not in ("progress", "residual")},
        "cpu_threads": cpu_threads, "accel_threads": accel_threads if accel_threads is not None else prev_threads,
        "cpu_lane_spin_s": runtime.cpu.spin_s, "cpu_lane_wakes": runtime.cpu.wakes,
        "dense_device": str(dense_device),
        "expert_layout": {"source": store.layout.source, "activation": store.layout.activation,
                          "transposed": store.layout.transposed, "bias": store.layout.bias,
                          "params_per_expert": store.layout.numel},
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "host_weights_pinned": store.pinned,
        "slot_bytes": runtime.slot_bytes,
        "grouped_calls": runtime.grouped_calls(),
        "setup_s": setup_s,
    }
    result = _result(session, spec, sysconf, profile, mem, hardware, options, seed, executor, generated, wall_s,
                     model, model_path, prompts_source, residuals, controller)
    session.timer.clear()  # (its records hold the copies' tickets, hence the slot table: the result has its own)
    return result


def _release(blocks) -> None:
    """Free the model's routed-expert tensors (they are in the host store now)."""
    from torch import nn

    for b in blocks:
        for name, p in list(b.experts.named_parameters(recurse=False)):
            setattr(b.experts, name, nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=False))


def _result(session: OffloadSession, spec, sysconf, profile, mem, hardware, options: GenerateOptions, seed: int,
            executor: dict, generated: list[GeneratedSequence], wall_s: float, model, model_path, prompts_source,
            residuals, controller) -> GenerateResult:
    w, t, rt = session.w, session.times, session.runtime
    busy, count, intervals = session.timer.summary()  # intervals resolved when read (a timeline)
    out = EngineOutput(np.array(session.step_start), np.array(session.step_end), session.layer_times(),
                       rt.layer_wait.copy(), busy, count, intervals, handoffs=rt.handoffs(),
                       prefetches_waited=rt.prefetches_waited)
    summary, per_layer, per_seq, per_step = result_tables(
        w, session.counters, out, spec, system=sysconf.name, hardware=profile.name, batch_size=options.batch_size,
        bounds=controller.bounds, oracles=controller.oracles)
    per_layer["decision_s"], per_layer["decision_cpu_s"] = t.decision.array()
    book = t.bookkeeping.array() + np.stack([rt.layer_bookkeeping, rt.layer_bookkeeping_cpu])
    per_layer["bookkeeping_s"], per_layer["bookkeeping_cpu_s"] = book
    per_layer["lookahead_s"], per_layer["lookahead_cpu_s"] = t.lookahead.array()
    summary["overhead"] = overhead_summary(per_layer, w.num_steps * w.num_layers)
    summary["executor"] = executor_summary(executor)
    new_tokens = sum(len(g.token_ids) for g in generated)
    summary["generation"] = {"prompts": len(generated), "new_tokens": new_tokens, "wall_s": wall_s,
                             "new_tokens_per_s": new_tokens / wall_s if wall_s > 0 else float("nan"),
                             "setup_s": executor["setup_s"]}
    predictors = {name: {"target_offset": off, "definition": _definition(name)}
                  for name, off in w.predictor_offsets.items()}
    online = {"frequencies": w.frequencies_source, "predictors": predictors,
              "prediction_rule": "top-k of the predicted router logits by the family's routing rule "
                                 "(MoEAdapter.select)",
              "residual": (residuals.source or "(in memory)") if residuals is not None else None}
    prompts_file = str(prompts_source) if prompts_source else None
    manifest = {
        "dali_version": __version__,
        "model_path": model_path,
        "model_type": model.config.model_type,
        "config_sha256": config_sha256(model.config),
        "prompts": prompts_file,
        "prompts_sha256": file_sha256(prompts_file) if prompts_file and Path(prompts_file).is_file() else None,
        "residual_sha256": (file_sha256(residuals.source) if residuals is not None and residuals.source else None),
        "seed": seed,
        "hardware": {"name": profile.name, "path": str(getattr(profile, "path", "") or "")},
        "model": spec.to_dict(),
        "memory": mem.describe(),
        "timing": True,
        "online": online,
        "executor": executor,
    }
    config = {"system": sysconf.to_dict(), "hardware": str(hardware), "batch_size": options.batch_size,
              "prefill_chunk": options.prefill_chunk, "seed": seed, "precision": spec.precision.name, "timing": True,
              "model": model_path or spec.name, "max_new_tokens": options.max_new_tokens, "online": online,
              "executor": {k: executor[k] for k in ("options", "cpu_threads", "accel_threads")}}
    return GenerateResult(summary, per_layer, per_seq, per_step, config, manifest, intervals, generated)


def _definition(name: str) -> str:
    if name in ONLINE_PREDICTORS:
        return ONLINE_PREDICTORS[name]
    return ONLINE_PREDICTORS["gate<d>"].replace("d >= 2", f"d = {predictor_offset(name)}")


def generate_from_path(model_path: str, prompts_file: str | Path, system: str,
                       options: GenerateOptions = GenerateOptions(), *, dtype: str = "fp32",
                       **kw) -> GenerateResult:
    """Load a local checkpoint (``local_files_only``; on the CPU, moved to the dense device once its experts
    are in the host store) and :func:`generate` for the prompts of a file (.txt, .jsonl, .json)."""
    from dali_exec.recorder.loading import load_model

    model, tokenizer = load_model(model_path, device="cpu", dtype=dtype, progress=options.progress)
    prompts = read_prompts(prompts_file)
    return generate(model, prompts, system, options, tokenizer=tokenizer, model_path=str(model_path),
                    prompts_source=str(prompts_file), free_experts=True, **kw)


__all__ = ["GenerateOptions", "GenerateResult", "GeneratedSequence", "generate", "generate_from_path"]
