"""The always-on part of each block, with random weights sized by the model shape, so its time is real.

A block computes, on the system's dense device (``gpu`` = the accelerator, ``cpu`` = the host):

* RMSNorm, then attention: a fused QKV projection, the step's new keys and values written into a KV
  cache, scaled-dot-product attention of every query over its own sequence's cached positions
  ``0..pos`` (GQA with the spec's head counts; MLA is approximated by plain multi-head attention with
  ``qk_nope + qk_rope`` query/key and ``v_head_dim`` value dimensions, its uncompressed form), the output
  projection and the residual;
* in an MoE block: RMSNorm giving the gate input, the router's logits (computed and discarded: the
  routing comes from the trace), and the shared experts added to the residual. The layer's output is
  ``residual + routed experts(gate input)``;
* in a non-MoE block (e.g. DeepSeek's first layer): RMSNorm and the dense FFN instead.

Not modelled: embeddings, rotary embeddings, the final norm and LM head. One KV cache of
(batch slots x longest context) is shared by all blocks (its contents do not matter, its reads do).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from dali_exec.executor.devices import to_device_async
from dali_exec.executor.ffn import ExpertLayout, init_expert
from dali_exec.executor.store import DENSE, KV_CACHE, derive_seed, drawing_pool
from dali_sim.models.spec import ModelSpec

EPS = 1e-5  # RMSNorm epsilon (numerical guard, not a cost)


def attention_dims(model: ModelSpec) -> tuple[int, int, int, int]:
    """(query heads, key/value heads, query/key head dim, value head dim)."""
    a = model.attention
    if a.kind == "gqa":
        return a.num_heads, a.num_kv_heads, a.head_dim, a.head_dim
    return a.num_heads, a.num_heads, a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim


class StepAttention:
    """Which cached positions each query of a step attends to, as padded batch indices and a mask.

    ``slots``: each token's KV-cache row (its sequence's slot); ``positions``: its position. Queries
    of one slot form one batch row; each attends to keys ``0..pos``."""

    def __init__(self, slots: np.ndarray, positions: np.ndarray, device: torch.device):
        slots = np.asarray(slots, np.int64)
        positions = np.asarray(positions, np.int64)
        rows, row_of = np.unique(slots, return_inverse=True)
        order = np.lexsort((positions, row_of))
        within = np.empty(len(slots), np.int64)
        starts = np.searchsorted(row_of[order], np.arange(len(rows)))
        within[order] = np.arange(len(slots)) - starts[row_of[order]]
        self.num_rows, self.q_max = len(rows), int(within.max()) + 1
        self.context = int(positions.max()) + 1
        mask = np.zeros((len(rows), self.q_max, self.context), bool)
        mask[:, :, 0] = True  # padding queries see position 0 (their output is discarded)
        mask[row_of, within] = np.arange(self.context)[None, :] <= positions[:, None]
        self.mask = to_device_async(torch.from_numpy(mask).unsqueeze(1), device)
        self.rows = to_device_async(torch.from_numpy(rows), device)
        self.flat = to_device_async(torch.from_numpy(row_of * self.q_max + within), device)  # token -> padded query
        self.slots = to_device_async(torch.from_numpy(slots), device)
        self.positions = to_device_async(torch.from_numpy(positions), device)
        self.num_tokens = len(slots)


class KVCache:
    """Random keys and values of ``slots`` sequences x ``context`` positions, shared by all blocks."""

    def __init__(self, model: ModelSpec, slots: int, context: int, dtype: torch.dtype, device: torch.device,
                 seed: int = 0):
        _, kvh, dqk, dv = attention_dims(model)
        g = torch.Generator().manual_seed(derive_seed(seed, KV_CACHE))
        self.k = torch.randn((slots, context, kvh, dqk), generator=g).to(device=device, dtype=dtype)
        self.v = torch.randn((slots, context, kvh, dv), generator=g).to(device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return (self.k.numel() + self.v.numel()) * self.k.element_size()


class DenseBlock:
    """The always-on part of one block (see the module docstring)."""

    def __init__(self, model: ModelSpec, block: int, moe: bool, dtype: torch.dtype, device: torch.device,
                 seed: int = 0):
        self.model, self.block, self.moe = model, block, moe
        H = model.hidden_size
        self.nh, self.kvh, self.dqk, self.dv = attention_dims(model)
        g = torch.Generator().manual_seed(derive_seed(seed, DENSE, block))

        def mat(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn((rows, cols), generator=g) / cols ** 0.5).to(device=device, dtype=dtype)

        self.norm1 = torch.ones(H, dtype=dtype, device=device)
        self.norm2 = torch.ones(H, dtype=dtype, device=device)
        self.wqkv = mat(self.nh * self.dqk + self.kvh * (self.dqk + self.dv), H)
        self.wo = mat(H, self.nh * self.dv)
        self.ffns: list[tuple[ExpertLayout, torch.Tensor]] = []
        if moe:
            self.router = mat(model.num_experts, H)
            if model.num_shared_experts:
                layout = ExpertLayout.ffn(model, model.shared_expert_intermediate_size)
                self.ffns = [(layout, init_expert(layout, g, dtype).to(device)) for _ in range(model.num_shared_experts)]
        else:
            layout = ExpertLayout.ffn(model, model.dense_intermediate_size)
            self.ffns = [(layout, init_expert(layout, g, dtype).to(device))]

    def _attention(self, x: torch.Tensor, a: StepAttention, kv: KVCache) -> torch.Tensor:
        T = x.shape[0]
        nh, kvh, dqk, dv = self.nh, self.kvh, self.dqk, self.dv
        xn = F.rms_norm(x, (x.shape[-1],), self.norm1, EPS)
        qkv = F.linear(xn, self.wqkv)
        q, k, v = qkv.split([nh * dqk, kvh * dqk, kvh * dv], dim=-1)
        kv.k[a.slots, a.positions] = k.view(T, kvh, dqk)
        kv.v[a.slots, a.positions] = v.view(T, kvh, dv)
        qp = q.new_zeros((a.num_rows * a.q_max, nh, dqk))
        qp[a.flat] = q.view(T, nh, dqk)
        qp = qp.view(a.num_rows, a.q_max, nh, dqk).transpose(1, 2)
        keys = kv.k.index_select(0, a.rows)[:, : a.context].transpose(1, 2)
        values = kv.v.index_select(0, a.rows)[:, : a.context].transpose(1, 2)
        o = F.scaled_dot_product_attention(qp, keys, values, attn_mask=a.mask, enable_gqa=kvh != nh)
        o = o.transpose(1, 2).reshape(a.num_rows * a.q_max, nh * dv)[a.flat]
        return x + F.linear(o, self.wo)

    def __call__(self, x: torch.Tensor, a: StepAttention, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MoE block: (residual incl. shared experts, gate input); non-MoE block: (output, None)."""
        h = self._attention(x, a, kv)
        hn = F.rms_norm(h, (h.shape[-1],), self.norm2, EPS)
        if self.moe:
            F.linear(hn, self.router)  # the router's cost; its top-k is the trace's
        for layout, w in self.ffns:
            h = h + layout.forward(w, hn)
        return h, (hn if self.moe else None)

    @property
    def nbytes(self) -> int:
        tensors = [self.norm1, self.norm2, self.wqkv, self.wo] + [w for _, w in self.ffns]
        if self.moe:
            tensors.append(self.router)
        return sum(t.numel() * t.element_size() for t in tensors)


class DenseWeights:
    """A model's dense blocks (every block's :class:`DenseBlock`, random weights fixed by ``seed``), drawn once
    per device and shared by every replay of the same model, dtype and seed that is given them, as the expert
    store is: a validation replays each system twice or more, and one thread draws about 200 M values/s
    (DeepSeek-V2-Lite's seven blocks at full size took 2.0 s on the 2-core VM). A block holds only weights (the
    KV cache is the replay's), so replays can share it."""

    def __init__(self, model: ModelSpec, dtype: torch.dtype, seed: int = 0):
        self.model, self.dtype, self.seed = model, dtype, seed
        self._on: dict[str, list[DenseBlock]] = {}

    def fits(self, model: ModelSpec, dtype: torch.dtype, seed: int) -> bool:
        return self.model == model and self.dtype == dtype and self.seed == seed

    def on(self, device: torch.device) -> list[DenseBlock]:
        """The blocks on ``device``, drawn the first time they are asked for there."""
        blocks = self._on.get(str(device))
        if blocks is None:
            moe, n = set(self.model.moe_layers), self.model.num_layers
            with drawing_pool(n) as pool:  # (each block has its own generator)
                blocks = self._on[str(device)] = list(pool.map(
                    lambda b: DenseBlock(self.model, b, b in moe, self.dtype, device, self.seed), range(n)))
        return blocks
