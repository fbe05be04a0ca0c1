"""The cost model: seconds for one expert on the GPU or the CPU, a host-to-device copy, and the
always-on (dense) part of a layer, from an analytic or a measured hardware profile.

One interface (:class:`CostModel`), two implementations chosen by the profile's kind:
:class:`RooflineCosts` here, :class:`dali_sim.hardware.measured.TableCosts` for measured tables.
Expert times for token counts ``0..lookup_tokens`` are precomputed, since the simulator asks for
them millions of times. Zero tokens (or bytes) always cost zero seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from dali_sim.hardware.contention import Contention, SharedHostBandwidth
from dali_sim.hardware.implementation import EXECUTOR, Implementation, get_implementation
from dali_sim.hardware.measured import TableCosts
from dali_sim.hardware.profile import DEVICES, DeviceSpec, HardwareProfile, Profile, ProfileError, check_device
from dali_sim.models.spec import AttentionSpec, ModelSpec

def attention_flops_per_pair(attn: AttentionSpec) -> int:
    """FLOPs of attention for one (query token, cached token) pair in one layer: scores + weighted
    sum over all heads (MLA counted in its uncompressed form)."""
    if attn.kind == "gqa":
        return 2 * 2 * attn.num_heads * attn.head_dim
    return 2 * attn.num_heads * (attn.qk_nope_head_dim + attn.qk_rope_head_dim + attn.v_head_dim)


@dataclass(frozen=True)
class _Part:
    """Shape of one roofline part: weight params and bytes, activation elements per token, weight format."""

    params: int
    weight_bytes: int
    act_elems: int
    precision: str


class _DeviceRates:
    """Compute and memory rates of one device for one weight format.

    Matrix products over ``n`` tokens run at the precision's effective peak once a GEMM tile is full;
    with fewer tokens than the tile holds (``gemm_tile_tokens`` T) the tile's arithmetic intensity, and
    with it the rate, falls as ``2n / (n + T)`` (the tile reads T weight rows for n token columns), but
    never below the plain fp32 (SIMT) rate that matrix-vector kernels use."""

    def __init__(self, spec: DeviceSpec, precision: str):
        self.flops = spec.effective_flops(precision)
        self.tile = float(spec.gemm_tile_tokens)
        self.simt = spec.effective_flops("fp32") if self.tile and "fp32" in spec.peak_tflops else 0.0
        self.bytes = spec.effective_bandwidth
        self.act = spec.activation_bytes

    def compute(self, n: np.ndarray) -> np.ndarray:
        if not self.tile:
            return np.full_like(np.asarray(n, float), self.flops)
        fill = np.minimum(1.0, 2.0 * n / (n + self.tile))
        return np.maximum(self.flops * fill, self.simt)


class RooflineCosts:
    """``fixed + max(flops / compute rate, bytes / (bandwidth * eff))`` per call, with
    ``flops = 2 * tokens * params`` (+ attention over the KV cache for the dense part), ``bytes`` = the
    weights read once + activations (+ the KV cache read), and ``fixed`` = the implementation's kernels
    for that call times the device's ``kernel_us`` (docs/hardware.md)."""

    def __init__(self, profile: HardwareProfile, model: ModelSpec, impl: Implementation):
        self.profile = profile
        self.impl = impl
        h = model.hidden_size
        xp, dp = model.precision.name, model.dense_format.name
        self._expert_part = _Part(model.expert_params, model.expert_bytes, 2 * h + 2 * model.expert_intermediate_size, xp)
        shared_inter = model.num_shared_experts * model.shared_expert_intermediate_size
        dense = model.dense_params_per_moe_layer()
        self._dense_part = _Part(dense, model.bytes_of(dense), 4 * h + 2 * shared_inter, dp)
        shared = model.shared_expert_params
        self._attn_part = _Part(dense - shared, model.bytes_of(dense - shared), 4 * h, dp)
        self._shared_part = _Part(shared, model.bytes_of(shared), 2 * h + 2 * shared_inter, dp)
        head = model.vocab_size * h + h  # the LM head and the final norm
        self._head_part = _Part(head, model.bytes_of(head), h + model.vocab_size, dp)
        block = model.attention_params + model.ffn_matrices * h * model.dense_intermediate_size + 2 * h
        self._block_part = _Part(block, model.bytes_of(block), 4 * h + 2 * model.dense_intermediate_size, dp)
        self._has_blocks = model.num_dense_layers > 0
        self._has_shared = model.num_shared_experts > 0
        self._model_name = model.name
        self._pair_flops = attention_flops_per_pair(model.attention)
        self._kv_elems = model.attention.kv_cache_elements_per_token()
        self._rates = {(d, p): _DeviceRates(profile.device(d), p) for d in DEVICES for p in {xp, dp}}
        self._act = {d: profile.device(d).activation_bytes for d in DEVICES}
        # fixed seconds per call: the implementation's kernels (GPU) or parallel ops (CPU) x the device's cost each
        gpu_k, cpu_k = profile.gpu.kernel_us * 1e-6, profile.cpu.kernel_us * 1e-6
        c = impl.count
        dense_key = "dense_mla" if model.attention.kind == "mla" else "dense_gqa"
        shared_k = c("shared") if self._has_shared else 0
        self._fixed = {
            ("gpu", "expert"): c("expert") * gpu_k if impl.gpu_experts == "per-expert" else 0.0,
            ("cpu", "expert"): c("cpu_expert") * cpu_k + c("sync_cpu_expert") * profile.gpu.sync_us * 1e-6,
            ("gpu", "dense"): (c(dense_key) + shared_k) * gpu_k, ("cpu", "dense"): c("cpu_dense") * cpu_k,
            ("gpu", "attn"): c(dense_key) * gpu_k, ("cpu", "attn"): c("cpu_dense") * cpu_k,
            ("gpu", "shared"): shared_k * gpu_k, ("cpu", "shared"): 0.0,
            ("gpu", "block"): (c(dense_key) + c("block_ffn")) * gpu_k, ("cpu", "block"): c("cpu_dense") * cpu_k,
            ("gpu", "head"): c("head") * gpu_k, ("cpu", "head"): c("head") * cpu_k,
            ("gpu", "lane"): c("moe") * gpu_k if impl.gpu_experts == "grouped" else 0.0,
            ("cpu", "lane"): c("cpu_moe") * cpu_k,
        }
        link = profile.link
        self._link = (link.latency_us * 1e-6, link.bandwidth(impl.copy_from == "pageable"))
        self._activation_link = (link.latency_us * 1e-6, link.bandwidth(False))  # small, staged copies
        cpu = profile.cpu
        self._host_capacity = cpu.mem_bandwidth_gbs * 1e9 * (cpu.shared_bandwidth_efficiency or cpu.memory_efficiency)

    def _roofline(self, part: _Part, device: str, n: np.ndarray, flops: np.ndarray, moved: np.ndarray) -> np.ndarray:
        r = self._rates[(device, part.precision)]
        return np.maximum(flops / r.compute(n), moved / r.bytes)

    def _plain(self, part: _Part, device: str, n: np.ndarray) -> np.ndarray:
        """A weight-times-activations part (no attention)."""
        moved = part.weight_bytes + n * part.act_elems * self._act[device]
        return self._roofline(part, device, n, 2.0 * n * part.params, moved)

    def expert(self, device: str, n: np.ndarray) -> np.ndarray:
        return self._fixed[(device, "expert")] + self._plain(self._expert_part, device, n)

    def transfer(self, n_bytes: np.ndarray) -> np.ndarray:
        latency, bw = self._link
        return latency + n_bytes / bw

    def activation_copy(self, n_bytes: np.ndarray) -> np.ndarray:
        latency, bw = self._activation_link
        return latency + n_bytes / bw

    def contention(self) -> Contention | None:
        return SharedHostBandwidth(self._host_capacity)

    def host_demand(self, device: str, n: np.ndarray) -> np.ndarray:
        """Host-DRAM bytes/s one expert with ``n`` tokens draws alone: CPU experts read their weights and
        activations from host memory; a GPU computes from its own."""
        if device == "gpu":
            return np.zeros_like(np.asarray(n, float))
        p = self._expert_part
        return (p.weight_bytes + n * p.act_elems * self._act[device]) / self.expert(device, n)

    def copy_demand(self, pageable: bool) -> float:
        """Host-DRAM bytes/s of a copy: a DMA read at the link's rate; a pageable copy is also read and
        written once more by the driver's staging memcpy."""
        return self._link[1] * (3.0 if pageable else 1.0)

    def _dense_like(self, part: _Part, key: str, device: str, n: np.ndarray, ctx: np.ndarray,
                    kv: np.ndarray) -> np.ndarray:
        act = self._act[device]
        flops = 2.0 * n * part.params + n * ctx * self._pair_flops
        moved = part.weight_bytes + n * part.act_elems * act + kv * self._kv_elems * act
        return self._fixed[(device, key)] + self._roofline(part, device, n, flops, moved)

    def dense(self, device: str, n: np.ndarray, ctx: np.ndarray, kv: np.ndarray, shared: bool = True) -> np.ndarray:
        if shared:
            return self._dense_like(self._dense_part, "dense", device, n, ctx, kv)
        return self._dense_like(self._attn_part, "attn", device, n, ctx, kv)

    def dense_demand(self, device: str, n: np.ndarray, ctx: np.ndarray, kv: np.ndarray) -> np.ndarray:
        """Host-DRAM bytes/s of the dense part on ``device`` alone (0 on a GPU)."""
        if device == "gpu":
            return np.zeros_like(np.asarray(n, float))
        part, act = self._dense_part, self._act[device]
        moved = part.weight_bytes + n * part.act_elems * act + kv * self._kv_elems * act
        return moved / self.dense(device, n, ctx, kv)

    def shared(self, device: str, n: np.ndarray) -> np.ndarray:
        return self._fixed[(device, "shared")] + self._plain(self._shared_part, device, n)

    def lm_head(self, device: str, n: np.ndarray) -> np.ndarray:
        return self._fixed[(device, "head")] + self._plain(self._head_part, device, n)

    def lane(self, device: str) -> float:
        return self._fixed[(device, "lane")]

    def wake(self, key: str) -> float:
        return 0.0  # (a measured effect of the executor's sleeping worker thread; no analytic counterpart)

    def dense_block(self, device: str, n: np.ndarray, ctx: np.ndarray, kv: np.ndarray) -> np.ndarray:
        if not self._has_blocks:
            raise ValueError(f"model {self._model_name!r} has no dense (non-MoE) blocks")
        return self._dense_like(self._block_part, "block", device, n, ctx, kv)


def _activation_bytes(profile: Profile) -> float:
    """Bytes per activation element: the analytic profile's GPU setting; a measured profile's dtype."""
    if profile.kind == "analytic":
        return profile.gpu.activation_bytes
    return {"fp32": 4.0}.get(profile.model.precision, 2.0)


def _nonneg(value, name: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind not in "iuf":
        raise TypeError(f"{name} must be a number or numeric array, got {value!r}")
    if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if arr.size and arr.min() < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return arr


def _out(result: np.ndarray, scalar: bool):
    return float(result) if scalar else result


def executor_on(profile: Profile, impl: Implementation) -> Implementation:
    """``impl`` as it runs on ``profile``'s machine (a measured profile; dali's executor only).

    Where the replay's thread has the CPU lane's thread count (the profile's ``threads.main_thread``; in profiles
    from before it was recorded, ``threads.accelerator_lane``, which sets it on the CPU device) it runs a CPU-lane
    call with no accelerator expert beside it itself (runtime.py ``run_experts``, ``OffloadRuntime.on_cpu_lane``),
    so only a CPU call beside accelerator experts wakes the worker (``cpu_lane_wakes = "beside-gpu"``). That is the
    default on the CPU device (half the cores each), on CUDA only with ``--cpu-threads`` set to the main thread's.

    On the CPU device (``gpu_is_cpu_device``) it also makes a layer's on-demand copies on the accelerator lane
    itself, before its grouped call (dali_exec/executor/copies.py ``CopyEngine.issue_now``: "on the CPU device ...
    they are done now"): its computes wait for them, as ``compute_waits_copies`` says (on CUDA they run on the copy
    stream beside the computes); and its thread does the layer's work in order, so a used prefetch's buffer frees
    after the dense part or the accelerator lane (``prefetch_buffers = "in-order"``).

    Its CPU lane's worker spins for its next job as long as the profile's ``waiting.spin_s`` says (the executor's
    ``--spin-us`` it was calibrated with: ``wait_spin_s``), 0 in profiles from before the executor could spin."""
    if impl.name != EXECUTOR or profile.kind == "analytic":
        return impl
    # the CPU lane's worker spun this long for its next job in the calibrated executor (profiles from before it
    # could spin: it slept at once)
    impl = dataclasses.replace(impl, wait_spin_s=float(profile.provenance.get("waiting", {}).get("spin_s", 0.0)))
    threads = profile.provenance.get("threads", {})
    main = threads.get("main_thread", threads.get("accelerator_lane"))
    inline = threads.get("cpu_lane") is not None and threads.get("cpu_lane") == main
    wakes = "beside-gpu" if inline and impl.cpu_lane_wakes == "always" else impl.cpu_lane_wakes
    if not profile.provenance.get("devices", {}).get("gpu_is_cpu_device"):
        return dataclasses.replace(impl, cpu_lane_wakes=wakes)
    buffers = "in-order" if impl.prefetch_buffers == "at-use" else impl.prefetch_buffers
    return dataclasses.replace(impl, compute_waits_copies=True, cpu_lane_wakes=wakes, prefetch_buffers=buffers)


class CostModel:
    """Seconds for the pieces of an MoE step on one profile's hardware, for one model.

    ``device`` is ``"gpu"`` or ``"cpu"``. Methods take an int/float or a NumPy array (returning a
    float or an array of the same shape). Policies combine the pieces (e.g. an uncached expert on
    the GPU needs ``expert_transfer_time()`` and ``expert_time("gpu", n)``).
    """

    def __init__(self, profile: Profile, model: ModelSpec, *, implementation: str | Implementation = "bare",
                 system: str | None = None, lookup_tokens: int = 8192):
        if lookup_tokens < 1:
            raise ValueError(f"lookup_tokens must be >= 1, got {lookup_tokens}")
        self.profile = profile
        self.model = model
        self.kind = profile.kind
        self.impl = executor_on(profile, get_implementation(implementation))
        self.system = system
        self._costs = RooflineCosts(profile, model, self.impl) if profile.kind == "analytic" else TableCosts(profile, model)
        counts = np.arange(1, lookup_tokens + 1, dtype=float)
        self._lut: dict[str, np.ndarray] = {}
        self._lut_list: dict[str, list[float]] = {}
        for d in DEVICES:
            table = np.zeros(lookup_tokens + 1)
            table[1:] = self._costs.expert(d, counts)
            table.flags.writeable = False
            self._lut[d] = table
            self._lut_list[d] = table.tolist()
        self._expert_transfer = float(self._costs.transfer(np.float64(model.expert_bytes))) if model.expert_bytes else 0.0
        #: how lanes slow each other while busy together (None: they never do)
        self.contention: Contention | None = self._costs.contention()
        demand = np.zeros(lookup_tokens + 1)
        demand[1:] = self._costs.host_demand("cpu", counts)
        demand.flags.writeable = False
        self._cpu_demand = demand
        self._cpu_demand_list = demand.tolist()
        self.copy_demand = float(self._costs.copy_demand(self.impl.copy_from == "pageable"))
        self._host: tuple[float, float, float, float] | None = None  # resolved when first asked (decisions never ask)

    @property
    def lookup_tokens(self) -> int:
        return len(self._lut["gpu"]) - 1

    # ---- experts -----------------------------------------------------------------------------
    def expert_time(self, device: str, n_tokens):
        """Seconds to run one routed expert on ``device`` for ``n_tokens`` tokens (0 -> 0)."""
        lut = self._lut_list.get(device)
        if lut is not None and type(n_tokens) is int and 0 <= n_tokens < len(lut):
            return lut[n_tokens]  # the hot path: one list lookup
        check_device(device)
        arr = _nonneg(n_tokens, "n_tokens")
        table = self._lut[device]
        if arr.dtype.kind in "iu" and (arr.size == 0 or arr.max() < len(table)):
            return _out(table[arr], arr.ndim == 0)
        x = arr.astype(float)
        res = np.where(x > 0, self._costs.expert(device, np.maximum(x, 1e-300)), 0.0)
        return _out(res, arr.ndim == 0)

    def expert_time_table(self, device: str) -> np.ndarray:
        """Read-only array ``t[n]`` = :meth:`expert_time` for ``n`` in ``0..lookup_tokens``."""
        check_device(device)
        return self._lut[device]

    # ---- transfers ---------------------------------------------------------------------------
    def transfer_time(self, n_bytes):
        """Seconds to copy ``n_bytes`` from pinned host memory to the GPU (0 -> 0)."""
        arr = _nonneg(n_bytes, "n_bytes").astype(float)
        res = np.where(arr > 0, self._costs.transfer(np.maximum(arr, 1e-300)), 0.0)
        return _out(res, arr.ndim == 0)

    def expert_transfer_time(self) -> float:
        """Seconds to copy one routed expert's weights to the GPU."""
        return self._expert_transfer

    # ---- dense parts -------------------------------------------------------------------------
    def _dense_call(self, fn, device: str, n_tokens, context_len, kv_tokens):
        check_device(device)
        n = _nonneg(n_tokens, "n_tokens").astype(float)
        ctx = _nonneg(context_len, "context_len").astype(float)
        kv = n * ctx if kv_tokens is None else _nonneg(kv_tokens, "kv_tokens").astype(float)
        n, ctx, kv = np.broadcast_arrays(n, ctx, kv)
        res = np.where(n > 0, fn(device, np.maximum(n, 1e-300), ctx, kv), 0.0)
        return _out(res, res.ndim == 0)

    def dense_time(self, device: str, n_tokens, context_len=0, kv_tokens=None, *, shared: bool = True):
        """Seconds for the always-on part of one MoE layer (attention projections, attention over
        the KV cache, router, shared experts, norms) for ``n_tokens`` query tokens; with
        ``shared=False`` without the shared experts (an implementation that overlaps them with the CPU
        lane runs them on the GPU lane, :meth:`shared_expert_time`).

        ``context_len`` is the mean number of cached tokens each query attends to; ``kv_tokens`` the
        KV-cache entries read in the step (sum over sequences), by default ``n_tokens *
        context_len``, exact for decode where every query is its own sequence. For a prefill of one
        sequence of L tokens pass ``context_len=L/2, kv_tokens=L``.
        """
        if shared:
            return self._dense_call(self._costs.dense, device, n_tokens, context_len, kv_tokens)
        self._need(self.kind == "analytic", "dense time without the shared experts (shared_overlap)")
        fn = lambda d, n, c, k: self._costs.dense(d, n, c, k, shared=False)  # noqa: E731
        return self._dense_call(fn, device, n_tokens, context_len, kv_tokens)

    def dense_host_demand(self, device: str, n_tokens, context_len=0, kv_tokens=None):
        """Host-DRAM bytes/s the dense part draws alone on ``device`` (for :attr:`contention`; 0 on a GPU)."""
        if self.kind != "analytic":
            return np.zeros_like(np.asarray(n_tokens, float))
        return self._dense_call(self._costs.dense_demand, device, n_tokens, context_len, kv_tokens)

    def shared_expert_time(self, device: str, n_tokens):
        """Seconds of one MoE layer's shared experts for ``n_tokens`` tokens (no per-call overhead)."""
        self._need(self.kind == "analytic", "shared-expert time (shared_overlap)")
        check_device(device)
        n = _nonneg(n_tokens, "n_tokens").astype(float)
        return _out(np.where(n > 0, self._costs.shared(device, np.maximum(n, 1e-300)), 0.0), n.ndim == 0)

    def lm_head_time(self, device: str, n_tokens):
        """Seconds of the final norm and LM head for ``n_tokens`` tokens that need logits."""
        self._need(self.kind == "analytic", "the LM head (lm_head)")
        check_device(device)
        n = _nonneg(n_tokens, "n_tokens").astype(float)
        return _out(np.where(n > 0, self._costs.lm_head(device, np.maximum(n, 1e-300)), 0.0), n.ndim == 0)

    def lane_overhead(self, device: str) -> float:
        """Fixed seconds a lane pays once per layer in which it runs experts: the grouped launch of a
        layer's GPU experts, or the CPU's parallel ops over its experts (measured profiles: the fixed part
        of the executor's grouped call, ``MeasuredProfile.lanes``)."""
        check_device(device)
        return float(self._costs.lane(device))

    def lane_wake(self, device: str, asleep: bool = True) -> float:
        """Seconds a lane's call costs more when its thread slept before it (measured profiles:
        ``MeasuredProfile.lane_wake``; 0 on analytic ones); ``asleep=False``: when the CPU lane's worker still
        spun for it (``lane_wake["<device>_spinning"]``, 0 where not measured). Charged by the engine on the
        CPU-lane calls the implementation's ``cpu_lane_wakes`` names."""
        check_device(device)
        return float(self._costs.wake(device if asleep else f"{device}_spinning"))

    def handoff_time(self, asleep: bool = True) -> float:
        """Host seconds the calling thread spends handing work to a thread that sleeps on its queue (measured
        profiles: ``MeasuredProfile.lane_wake["host"]``; 0 on analytic ones). The executor hands the CPU lane to
        its worker and background copies to its copy thread so; the engine charges it on the host track where
        the implementation's ``cpu_lane_wakes`` says the CPU lane is handed over, and where a request of
        background copies (a visit's prefetches, those that waited for a buffer, its swaps) finds no background
        copy in flight. ``asleep=False``: handing a job to the CPU lane's worker while it still spins for one
        (``lane_wake["host_spinning"]``, 0 where not measured)."""
        return float(self._costs.wake("host" if asleep else "host_spinning"))

    def _need(self, ok: bool, what: str) -> None:
        if not ok:
            raise ProfileError(f"{self._where()}: implementation {self.impl.name!r} needs {what}, which a measured "
                               "profile does not have; use an analytic profile or another system.implementation")

    def dense_block_time(self, device: str, n_tokens, context_len=0, kv_tokens=None):
        """Seconds for one non-MoE block (attention + dense MLP); arguments as :meth:`dense_time`."""
        return self._dense_call(self._costs.dense_block, device, n_tokens, context_len, kv_tokens)

    # ---- implementation costs (docs/hardware.md, "Implementations") ----------------------------
    def _where(self) -> str:
        return getattr(self.profile, "path", "") or self.profile.name

    def _host_costs(self) -> tuple[float, float, float, float]:
        """(per layer, per GPU expert, per CPU expert, per copy) host seconds of the implementation."""
        impl = self.impl
        if impl.host == "none":
            return (0.0, 0.0, 0.0, 0.0)
        if impl.host == "measured":
            host = getattr(self.profile, "host", None)
            if host is None:
                raise ProfileError(f"{self._where()}: implementation {impl.name!r} needs the executor's measured host "
                                   "costs, which this profile lacks (an analytic profile, or a measured one of format "
                                   "1): calibrate with `dali exec calibrate`, or choose another system.implementation")
            decision = 0.0
            if self.system is not None:
                if self.system not in host.decision_s:
                    known = ", ".join(sorted(host.decision_s)) or "(none)"
                    raise ProfileError(f"{self._where()}: host.decision_s has no measurement for system "
                                       f"{self.system!r} (measured: {known}); calibrate with it "
                                       "(`dali exec calibrate --systems` naming it, or without --systems)")
                decision = host.decision_s[self.system]
            return (host.layer_s + decision, host.gpu_expert_s, host.cpu_expert_s, host.copy_s)
        # launches: every GPU kernel (and copy) costs the host the profile's launch time plus the framework's own
        if self.kind != "analytic":
            raise ProfileError(f"{self._where()}: implementation {impl.name!r} counts kernel launches, which needs an "
                               "analytic profile (gpu.launch_us)")
        c = impl.count
        self._launch_s = (self.profile.gpu.launch_us + impl.host_op_us) * 1e-6
        dense = c("dense_mla" if self.model.attention.kind == "mla" else "dense_gqa")
        self._launches_dense = dense + (c("shared") if self.model.num_shared_experts else 0)
        self._launches_moe = c("moe") if impl.gpu_experts == "grouped" else 0
        self._launches_expert = c("expert") if impl.gpu_experts == "per-expert" else 0
        sync = self.profile.gpu.sync_us * 1e-6
        self._sync_layer = (c("sync_layer") + c("sync_all_experts") * self.model.num_experts) * sync
        self._sync_expert = c("sync_expert") * sync
        return (0.0, 0.0, 0.0, 0.0)

    def host_layer_time(self, n_gpu: int, n_cpu: int, n_copies: int, *, device_s: float = 0.0,
                        graph: bool = False, dense_on_gpu: bool = True) -> float:
        """Host seconds of one MoE layer visit (decisions, dispatch, launches, bookkeeping) that the
        layer's device work does not hide. For an implementation that counts launches: the launches of
        the layer's GPU kernels and copies beyond ``device_s``, the seconds of GPU work they start (a
        launch-bound layer takes its host time, a compute-bound one its device time), and 0 for a step
        replayed from a CUDA graph (``graph``). Each host-GPU synchronisation the implementation makes
        adds its round trip (the GPU then waits for the next launch), beyond what device work hides."""
        if self._host is None:
            self._host = self._host_costs()
        if self.impl.host == "launches":
            if graph:
                return 0.0
            n = (self._launches_dense if dense_on_gpu else 0) + n_copies + (self._launches_moe if n_gpu else 0) + \
                n_gpu * self._launches_expert
            syncs = (self._sync_layer + n_gpu * self._sync_expert) if n_gpu else 0.0
            return max(0.0, n * self._launch_s - device_s) + syncs
        layer, per_gpu, per_cpu, per_copy = self._host
        return layer + per_gpu * n_gpu + per_cpu * n_cpu + per_copy * n_copies

    def activation_copy_time(self, n_tokens: int) -> float:
        """One copy of ``n_tokens`` activations between the dense device and a lane on the other device
        (0 unless the implementation copies them)."""
        if not self.impl.activation_copies or n_tokens <= 0:
            return 0.0
        nbytes = float(n_tokens * self.model.hidden_size * _activation_bytes(self.profile))
        return float(self._costs.activation_copy(np.float64(nbytes)))

    def host_demand(self, device: str, n_tokens: int) -> float:
        """Host-DRAM bytes/s a ``device`` expert with ``n_tokens`` draws alone (for :attr:`contention`)."""
        if device == "gpu":
            return 0.0
        lut = self._cpu_demand_list
        if 0 <= n_tokens < len(lut):
            return lut[n_tokens]
        return float(self._costs.host_demand("cpu", np.float64(n_tokens)))

    # ---- derived -----------------------------------------------------------------------------
    def uncached_gpu_time(self, n_tokens, *, overlap: bool = False):
        """GPU time of an expert that must first be copied: transfer + compute, or with ``overlap``
        their max (DALI's ``t_gpu``, which assumes copies pipeline with other experts' compute)."""
        gpu = self.expert_time("gpu", n_tokens)
        t = self._expert_transfer
        res = np.maximum(t, gpu) if overlap else t + np.asarray(gpu)
        res = np.where(np.asarray(n_tokens) > 0, res, 0.0)
        return _out(res, np.ndim(n_tokens) == 0)

    def crossover_tokens(self, *, overlap: bool = False, max_tokens: int | None = None) -> int | None:
        """Smallest token count at which an uncached expert is faster on the GPU than on the CPU
        (see :meth:`uncached_gpu_time`), or ``None`` if none up to ``max_tokens``."""
        n = np.arange(1, (max_tokens or self.lookup_tokens) + 1)
        faster = np.flatnonzero(self.uncached_gpu_time(n, overlap=overlap) < self.expert_time("cpu", n))
        return int(n[faster[0]]) if faster.size else None
