"""A transformers model's routed experts in the executor's host store, computed exactly as the model does.

transformers 5 keeps a MoE block's routed experts as stacked tensors (``gate_up_proj``, ``down_proj``
and, for GPT-OSS, their biases; see ``MoEAdapter.expert_layout``). :func:`pack_experts` copies every
expert's slices, in the model's own layout, into one flat vector per expert of a
:class:`~dali_exec.executor.store.HostExpertStore`, so a transfer is one copy and a cache slot one row.
:class:`HFExpertLayout` computes one expert from such a vector with the operations of transformers'
default ``grouped_mm`` experts implementation (``transformers.integrations.moe``) for a group of one
expert: the same grouped matrix product (which computes each expert's rows independently of the other
experts'), the bias added in place, the model's own gating function (``experts._apply_gate``: SwiGLU, or
GPT-OSS's clamped GLU on interleaved gate/up columns), so that given the same rows in the same order an
expert's output is bit for bit the model's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from dali_exec.executor.grouped import grouped_mm
from dali_exec.executor.store import HostExpertStore

try:  # the function transformers' grouped_mm experts implementation calls (same dispatch, same kernels)
    from transformers.integrations.moe import _grouped_linear as _hf_grouped_linear
except ImportError:  # pragma: no cover - another transformers version: the plain equivalent
    _hf_grouped_linear = None


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


#: transformers' grouped linear on the CPU with torch >= 2.11 always ends in ``F.grouped_mm(x.to(w.dtype), w,
#: offs=offs)`` (its alignment condition is for older torch): the experts call that directly on the CPU, the
#: same product without transformers' per-call dispatch checks (the CPU device's main cost per call here)
_CPU_GROUPED_MM = (getattr(torch.nn.functional, "grouped_mm", None)
                   if _hf_grouped_linear is not None and _torch_version() >= (2, 11) else None)

logger = logging.getLogger(__name__)
#: (device type, dtype) where transformers' grouped linear refused the slot table: the loop is used there
_HF_UNSUPPORTED: set[tuple[str, torch.dtype]] = set()


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, bias: torch.Tensor | None,
                    transposed: bool) -> torch.Tensor:
    """``weight`` (1, out, in), or (1, in, out) if ``transposed``: one expert's group of rows."""
    if _hf_grouped_linear is not None:
        return _hf_grouped_linear(x, weight, offs, bias=bias, is_transposed=transposed)
    w = weight[0] if transposed else weight[0].t()
    out = torch.mm(x.to(w.dtype), w)
    if bias is not None:
        out.add_(bias)
    return out


@dataclass(frozen=True, eq=False)
class HFExpertLayout:
    """Offsets of one expert's tensors inside its flat vector, in the model's own layout:
    ``gate_up`` ((2I, H), or (H, 2I) when ``transposed``), ``down`` ((H, I), or (I, H)), then, with
    ``bias``, ``gate_up_bias`` (2I) and ``down_bias`` (H)."""

    hidden: int
    inter: int
    transposed: bool
    bias: bool
    gate: Callable[[torch.Tensor], torch.Tensor]  # the model's gating: (n, 2I) -> (n, I)
    activation: str
    source: str  # the experts class it was packed from

    @classmethod
    def of(cls, experts: nn.Module) -> "HFExpertLayout":
        """The layout of a transformers (v5) experts module (stacked ``gate_up_proj`` / ``down_proj``)."""
        name = type(experts).__name__
        if not (hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj")) \
                or not getattr(experts, "has_gate", True) or getattr(experts, "has_post_expert_norm", False):
            raise ValueError(f"{name}: expected gated experts with stacked gate_up_proj and down_proj "
                             "(transformers 5); this experts module is not supported")
        transposed = bool(getattr(experts, "is_transposed", False))
        bias = bool(getattr(experts, "has_bias", False))
        gu = experts.gate_up_proj
        hidden, two_i = (gu.shape[1], gu.shape[2]) if transposed else (gu.shape[2], gu.shape[1])
        inter = two_i // 2
        down = tuple(experts.down_proj.shape[1:])
        if down != ((inter, hidden) if transposed else (hidden, inter)):
            raise ValueError(f"{name}: down_proj {tuple(experts.down_proj.shape)} does not fit gate_up_proj "
                             f"{tuple(gu.shape)}")
        gate = getattr(experts, "_apply_gate", None)
        if gate is None:
            raise ValueError(f"{name}: no _apply_gate (transformers' experts interface); not supported")
        act = getattr(experts, "act_fn", None)
        if type(experts).__dict__.get("_apply_gate") is not None:
            activation = f"{name}._apply_gate (the model's own)"
        else:
            activation = f"{type(act).__name__ if act is not None else '?'}(gate) * up"
        return cls(hidden, inter, transposed, bias, gate, activation, name)

    def __post_init__(self) -> None:
        # (start, end, shape) of each tensor in the flat vector: sliced per call, computed once
        spans, o = [], 0
        for s in self.shapes:
            n = 1
            for d in s:
                n *= d
            spans.append((o, o + n, s))
            o += n
        object.__setattr__(self, "_spans", tuple(spans))
        # the two matrices as right operands of a product (in, out): (shape, strides, start) in the flat
        # vector (a transposed view where the layout is (out, in)), for one as_strided per matrix per call
        ops = []
        for a, _, (r, c) in spans[:2]:
            ops.append(((r, c), (c, 1), a) if self.transposed else ((c, r), (1, c), a))
        object.__setattr__(self, "_operands", tuple(ops))

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        h, i = self.hidden, self.inter
        mats = ((h, 2 * i), (i, h)) if self.transposed else ((2 * i, h), (h, i))
        return mats + (((2 * i,), (h,)) if self.bias else ())

    @property
    def numel(self) -> int:
        return self._spans[-1][1]

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(gate_up, down, gate_up_bias or None, down_bias or None) as views into ``flat``."""
        out = [flat[a:b].view(s) for a, b, s in self._spans]
        return (out[0], out[1], out[2], out[3]) if self.bias else (out[0], out[1], None, None)

    def table_views(self, table: torch.Tensor):
        """:meth:`views` of every row of a table of flat experts ((R, numel), rows may be padded)."""
        out = [table[:, a:b].view(-1, *s) for a, b, s in self._spans]
        return (out[0], out[1], out[2], out[3]) if self.bias else (out[0], out[1], None, None)

    def operands(self, flat: torch.Tensor):
        """(gate_up, down) as right operands of a product ((H, 2I), (I, H): the layout's matrices, transposed
        where it stores them (out, in)), then the biases or None: views into ``flat`` (contiguous)."""
        base = flat.storage_offset()
        (s1, t1, a1), (s2, t2, a2) = self._operands
        w1, w2 = flat.as_strided(s1, t1, base + a1), flat.as_strided(s2, t2, base + a2)
        if not self.bias:
            return w1, w2, None, None
        (a3, b3, _), (a4, b4, _) = self._spans[2:]
        return w1, w2, flat[a3:b3], flat[a4:b4]

    def table_operands(self, table: torch.Tensor):
        """:meth:`operands` of every row of a table of flat experts ((R, numel), rows contiguous, may be
        padded): (R, H, 2I) and (R, I, H), then the biases' (R, 2I) and (R, H) or None."""
        base, rs, R = table.storage_offset(), table.stride(0), table.shape[0]
        (s1, t1, a1), (s2, t2, a2) = self._operands
        w1 = table.as_strided((R, *s1), (rs, *t1), base + a1)
        w2 = table.as_strided((R, *s2), (rs, *t2), base + a2)
        if not self.bias:
            return w1, w2, None, None
        (a3, b3, _), (a4, b4, _) = self._spans[2:]
        return w1, w2, table[:, a3:b3], table[:, a4:b4]

    def forward_grouped(self, table: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, counts,
                        pair_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Many experts at once (``dali_exec.executor.grouped``), with transformers' own grouped linear and
        the model's gate, as its ``grouped_mm`` experts implementation computes them: ``x`` sorted by table
        row, ``offs`` the rows' cumulative token counts (int32, on ``x``'s device), ``pair_rows`` the table
        row of each token row (biases only). ``counts`` (host) serve the fallback without transformers."""
        if _CPU_GROUPED_MM is not None and x.device.type == "cpu" and table.stride(-1) == 1:
            w1, w2, b1, b2 = self.table_operands(table)
            y = _CPU_GROUPED_MM(x if x.dtype == w1.dtype else x.to(w1.dtype), w1, offs=offs)
            y = self.gate(y if b1 is None else y.add_(b1.index_select(0, pair_rows)))
            y = _CPU_GROUPED_MM(y if y.dtype == w2.dtype else y.to(w2.dtype), w2, offs=offs)
            return y if b2 is None else y.add_(b2.index_select(0, pair_rows))
        w1, w2, b1, b2 = self.table_views(table)
        if b1 is not None:
            b1, b2 = b1.index_select(0, pair_rows), b2.index_select(0, pair_rows)
        if _hf_grouped_linear is None or (x.device.type, table.dtype) in _HF_UNSUPPORTED:
            w1, w2 = (w if self.transposed else w.transpose(-2, -1) for w in (w1, w2))
            y = grouped_mm(x, w1, offs, counts)
            y = self.gate(y if b1 is None else y.add_(b1))
            y = grouped_mm(y, w2, offs, counts)
            return y if b2 is None else y.add_(b2)
        try:
            y = _hf_grouped_linear(x, w1, offs, bias=b1, is_transposed=self.transposed)
        except (RuntimeError, NotImplementedError) as exc:  # e.g. a kernel that refuses the slot table's strides
            if x.device.type == "cpu":
                raise
            _HF_UNSUPPORTED.add((x.device.type, table.dtype))
            logger.warning("transformers' grouped linear failed on %s (%s); using one product per expert", x.device, exc)
            return self.forward_grouped(table, x, offs, counts, pair_rows)
        y = self.gate(y)
        return _hf_grouped_linear(y, w2, offs, bias=b2, is_transposed=self.transposed)

    def forward(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The expert on tokens ``x`` (n x H), weights in ``flat`` (on ``x``'s device).

        On the CPU the grouped product computes each group as one matrix product
        (``at::mm_out(out[rows], x[rows], weight[g])``, and transformers' own fallback likewise), so one
        expert is one ``torch.mm`` with the same operands: the same bits, without the grouped call's
        dispatch (a staging turn computes one expert; this is its cost on the CPU device). Elsewhere
        (CUDA's grouped kernels) the grouped call for a group of one."""
        return self.forward_prepared(self.prepare(flat), x)

    def prepare(self, flat: torch.Tensor) -> tuple:
        """What :meth:`forward_prepared` takes for the expert in ``flat`` (on the device it is computed on): on
        the CPU its :meth:`operands`, else its :meth:`views`. Made once for a buffer that holds expert after
        expert (a staging buffer)."""
        if flat.device.type == "cpu" and flat.stride(-1) == 1:
            return True, self.operands(flat)
        return False, self.views(flat)

    def forward_prepared(self, prepared: tuple, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` of the expert that :meth:`prepare` made ``prepared`` of."""
        products, (w1, w2, b1, b2) = prepared
        if products:
            y = torch.mm(x if x.dtype == w1.dtype else x.to(w1.dtype), w1)
            y = self.gate(y if b1 is None else y.add_(b1))
            y = torch.mm(y if y.dtype == w2.dtype else y.to(w2.dtype), w2)
            return y if b2 is None else y.add_(b2)
        offs = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)  # no host-to-device copy
        y = _grouped_linear(x, w1.unsqueeze(0), offs, b1, self.transposed)
        y = self.gate(y)
        return _grouped_linear(y, w2.unsqueeze(0), offs, b2, self.transposed)


def expert_tensors(experts: nn.Module, layout: HFExpertLayout) -> list[torch.Tensor]:
    """The stacked (E, ...) tensors of an experts module in the layout's order."""
    names = ("gate_up_proj", "down_proj") + (("gate_up_proj_bias", "down_proj_bias") if layout.bias else ())
    return [getattr(experts, n).detach() for n in names]


@torch.no_grad()
def pack_experts(experts_modules: list[nn.Module], dtype: torch.dtype, *, pin: bool = False) -> HostExpertStore:
    """Every routed expert of the given experts modules (one per MoE layer, in order) as flat vectors of
    a host store ((layers, experts, numel), pinned if asked). The modules' tensors are copied."""
    layout = HFExpertLayout.of(experts_modules[0])
    E = int(experts_modules[0].gate_up_proj.shape[0])
    weights = torch.empty((len(experts_modules), E, layout.numel), dtype=dtype, pin_memory=pin)
    for layer, experts in enumerate(experts_modules):
        mine = HFExpertLayout.of(experts)
        if (mine.hidden, mine.inter, mine.transposed, mine.bias) != (layout.hidden, layout.inter, layout.transposed,
                                                                      layout.bias) \
                or experts.gate_up_proj.shape[0] != E:
            raise ValueError(f"MoE layer {layer}: its experts differ in shape from the first layer's; "
                             "every MoE layer must have the same experts")
        o = 0
        for t, shape in zip(expert_tensors(experts, layout), layout.shapes):
            n = t[0].numel()
            if tuple(t.shape[1:]) != shape:
                raise AssertionError(f"MoE layer {layer}: tensor {tuple(t.shape)} does not fit {shape}")
            weights[layer, :, o:o + n].copy_(t.reshape(E, n))
            o += n
    return HostExpertStore(weights, layout)


__all__ = ["HFExpertLayout", "expert_tensors", "pack_experts"]
