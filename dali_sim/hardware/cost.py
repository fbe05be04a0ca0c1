"""The cost model: seconds for one expert on the GPU or the CPU, a host-to-device copy, and the
always-on (dense) part of a layer, from an analytic or a measured hardware profile.

One interface (:class:`CostModel`), two implementations chosen by the profile's kind:
:class:`RooflineCosts` here, :class:`dali_sim.hardware.measured.TableCosts` for measured tables.
Expert times for token counts ``0..lookup_tokens`` are precomputed, since the simulator asks for
them millions of times. Zero tokens (or bytes) always cost zero seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dali_sim.hardware.measured import TableCosts
from dali_sim.hardware.profile import DEVICES, HardwareProfile, Profile, check_device
from dali_sim.models.spec import AttentionSpec, ModelSpec

def attention_flops_per_pair(attn: AttentionSpec) -> int:
    """FLOPs of attention for one (query token, cached token) pair in one layer: scores + weighted
    sum over all heads (MLA counted in its uncompressed form)."""
    if attn.kind == "gqa":
        return 2 * 2 * attn.num_heads * attn.head_dim
    return 2 * attn.num_heads * (attn.qk_nope_head_dim + attn.qk_rope_head_dim + attn.v_head_dim)


@dataclass(frozen=True)
class _Part:
    """Shape of one roofline part: weight params and bytes, activation elements per token."""

    params: int
    weight_bytes: int
    act_elems: int


class RooflineCosts:
    """``overhead + max(flops / (peak * eff), bytes / (bandwidth * eff))`` per call, with
    ``flops = 2 * tokens * params`` (+ attention over the KV cache for the dense part) and
    ``bytes`` = the weights read once + activations (+ the KV cache read)."""

    def __init__(self, profile: HardwareProfile, model: ModelSpec):
        self.profile = profile
        h = model.hidden_size
        self._expert_part = _Part(model.expert_params, model.expert_bytes, 2 * h + 2 * model.expert_intermediate_size)
        shared_inter = model.num_shared_experts * model.shared_expert_intermediate_size
        dense = model.dense_params_per_moe_layer()
        self._dense_part = _Part(dense, model.bytes_of(dense), 4 * h + 2 * shared_inter)
        block = model.attention_params + model.ffn_matrices * h * model.dense_intermediate_size + 2 * h
        self._block_part = _Part(block, model.bytes_of(block), 4 * h + 2 * model.dense_intermediate_size)
        self._has_blocks = model.num_dense_layers > 0
        self._model_name = model.name
        self._pair_flops = attention_flops_per_pair(model.attention)
        self._kv_elems = model.attention.kv_cache_elements_per_token()
        # per device: (effective FLOP/s, effective bytes/s, expert overhead s, dense overhead s, activation bytes)
        self._rates = {}
        for d in DEVICES:
            s = profile.device(d)
            self._rates[d] = (s.effective_flops(model.precision.name), s.effective_bandwidth,
                              s.expert_overhead_us * 1e-6, s.dense_overhead_us * 1e-6, s.activation_bytes)
        link = profile.link
        self._link = (link.latency_us * 1e-6, link.effective_bandwidth)

    def expert(self, device: str, n: np.ndarray) -> np.ndarray:
        flops_s, bytes_s, overhead, _, act = self._rates[device]
        p = self._expert_part
        return overhead + np.maximum(2.0 * n * p.params / flops_s, (p.weight_bytes + n * p.act_elems * act) / bytes_s)

    def transfer(self, n_bytes: np.ndarray) -> np.ndarray:
        latency, bw = self._link
        return latency + n_bytes / bw

    def _dense_like(self, part: _Part, device: str, n: np.ndarray, ctx: np.ndarray, kv: np.ndarray) -> np.ndarray:
        flops_s, bytes_s, _, overhead, act = self._rates[device]
        flops = 2.0 * n * part.params + n * ctx * self._pair_flops
        moved = part.weight_bytes + n * part.act_elems * act + kv * self._kv_elems * act
        return overhead + np.maximum(flops / flops_s, moved / bytes_s)

    def dense(self, device: str, n: np.ndarray, ctx: np.ndarray, kv: np.ndarray) -> np.ndarray:
        return self._dense_like(self._dense_part, device, n, ctx, kv)

    def dense_block(self, device: str, n: np.ndarray, ctx: np.ndarray, kv: np.ndarray) -> np.ndarray:
        if not self._has_blocks:
            raise ValueError(f"model {self._model_name!r} has no dense (non-MoE) blocks")
        return self._dense_like(self._block_part, device, n, ctx, kv)


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


class CostModel:
    """Seconds for the pieces of an MoE step on one profile's hardware, for one model.

    ``device`` is ``"gpu"`` or ``"cpu"``. Methods take an int/float or a NumPy array (returning a
    float or an array of the same shape). Policies combine the pieces (e.g. an uncached expert on
    the GPU needs ``expert_transfer_time()`` and ``expert_time("gpu", n)``).
    """

    def __init__(self, profile: Profile, model: ModelSpec, *, lookup_tokens: int = 8192):
        if lookup_tokens < 1:
            raise ValueError(f"lookup_tokens must be >= 1, got {lookup_tokens}")
        self.profile = profile
        self.model = model
        self.kind = profile.kind
        self._costs = RooflineCosts(profile, model) if profile.kind == "analytic" else TableCosts(profile, model)
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

    def dense_time(self, device: str, n_tokens, context_len=0, kv_tokens=None):
        """Seconds for the always-on part of one MoE layer (attention projections, attention over
        the KV cache, router, shared experts, norms) for ``n_tokens`` query tokens.

        ``context_len`` is the mean number of cached tokens each query attends to; ``kv_tokens`` the
        KV-cache entries read in the step (sum over sequences), by default ``n_tokens *
        context_len``, exact for decode where every query is its own sequence. For a prefill of one
        sequence of L tokens pass ``context_len=L/2, kv_tokens=L``.
        """
        return self._dense_call(self._costs.dense, device, n_tokens, context_len, kv_tokens)

    def dense_block_time(self, device: str, n_tokens, context_len=0, kv_tokens=None):
        """Seconds for one non-MoE block (attention + dense MLP); arguments as :meth:`dense_time`."""
        return self._dense_call(self._costs.dense_block, device, n_tokens, context_len, kv_tokens)

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
