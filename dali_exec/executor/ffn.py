"""One routed expert as a flat parameter vector, and its forward pass.

An expert's weights live in one contiguous vector so that a transfer is one copy and a cache slot is
one row of a preallocated tensor. Layout (``ExpertLayout``): for gated FFNs (``ffn_matrices = 3``)
``w13`` (2I x H: gate rows, then up rows), ``w2`` (H x I), then, with ``expert_bias``, ``b13`` (2I)
and ``b2`` (H); for plain FFNs (``ffn_matrices = 2``) ``w1`` (I x H), ``w2`` (H x I), ``b1``, ``b2``.
Its length is ``ModelSpec.expert_params``.

Activations: gated FFNs compute ``w2(act(gate) * up)`` with SiLU (SwiGLU: Mixtral, DeepSeek, Qwen,
OLMoE); the ``gpt_oss`` family uses its clamped GLU (gpt-oss ``GptOssExperts``: gate clamped to
<= 7, up to [-7, 7], ``(up + 1) * gate * sigmoid(1.702 gate)``); plain FFNs use ReLU (Switch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from dali_exec.executor.grouped import grouped_mm
from dali_sim.models.spec import ModelSpec

GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0  # part of gpt-oss's activation function (its modeling code)


def _silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _gpt_oss_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate = gate.clamp(max=GPT_OSS_LIMIT)
    up = up.clamp(min=-GPT_OSS_LIMIT, max=GPT_OSS_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * GPT_OSS_ALPHA))


#: gated activations by model family (ModelSpec.family); others use SwiGLU
GATED = {"gpt_oss": ("gpt-oss clamped GLU", _gpt_oss_glu)}


@dataclass(frozen=True)
class ExpertLayout:
    """Offsets of the matrices of one expert inside its flat parameter vector."""

    hidden: int
    inter: int
    gated: bool
    bias: bool
    activation: str
    glu: Callable | None

    @classmethod
    def of(cls, model: ModelSpec) -> "ExpertLayout":
        """A routed expert of ``model``."""
        layout = cls.ffn(model, model.expert_intermediate_size, model.expert_bias)
        if layout.numel != model.expert_params:
            raise AssertionError(f"expert layout has {layout.numel} parameters, the spec {model.expert_params}")
        return layout

    @classmethod
    def ffn(cls, model: ModelSpec, intermediate: int, bias: bool = False) -> "ExpertLayout":
        """Any FFN of ``model``'s kind (routed or shared expert, dense MLP) with this intermediate size."""
        gated = model.ffn_matrices == 3
        name, fn = GATED.get(model.family, ("SwiGLU (SiLU)", _silu_glu)) if gated else ("ReLU", None)
        return cls(model.hidden_size, intermediate, gated, bias, name, fn)

    @property
    def up_rows(self) -> int:
        return 2 * self.inter if self.gated else self.inter

    @property
    def numel(self) -> int:
        h, r = self.hidden, self.up_rows
        return r * h + h * self.inter + ((r + h) if self.bias else 0)

    def views(self, flat: torch.Tensor):
        """(w_up (R x H), w_down (H x I), b_up or None, b_down or None) as views into ``flat``."""
        h, i, r = self.hidden, self.inter, self.up_rows
        w_up = flat[: r * h].view(r, h)
        o = r * h
        w_down = flat[o: o + h * i].view(h, i)
        o += h * i
        if not self.bias:
            return w_up, w_down, None, None
        return w_up, w_down, flat[o: o + r], flat[o + r: o + r + h]

    def table_views(self, table: torch.Tensor):
        """:meth:`views` of every row of a table of flat experts ((R, numel), rows may be padded):
        (w_up (R, R_up, H), w_down (R, H, I), b_up (R, R_up) or None, b_down (R, H) or None)."""
        h, i, r = self.hidden, self.inter, self.up_rows
        w_up = table[:, : r * h].view(-1, r, h)
        o = r * h
        w_down = table[:, o: o + h * i].view(-1, h, i)
        o += h * i
        if not self.bias:
            return w_up, w_down, None, None
        return w_up, w_down, table[:, o: o + r], table[:, o + r: o + r + h]

    def forward_grouped(self, table: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, counts,
                        pair_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Many experts at once (:mod:`.grouped`): ``x`` (S x H) sorted by table row, ``offs`` / ``counts``
        the rows' token boundaries, ``pair_rows`` (S,) the table row of each token row (biases only)."""
        w_up, w_down, b_up, b_down = self.table_views(table)
        y = grouped_mm(x, w_up.transpose(-2, -1), offs, counts)
        if b_up is not None:
            y = y + b_up.index_select(0, pair_rows)
        if self.gated:
            y = self.glu(y[:, : self.inter], y[:, self.inter:])
        else:
            y = F.relu(y)
        y = grouped_mm(y, w_down.transpose(-2, -1), offs, counts)
        if b_down is not None:
            y = y + b_down.index_select(0, pair_rows)
        return y

    def forward(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The expert on tokens ``x`` (n x H), weights in ``flat`` (on ``x``'s device and dtype)."""
        return self.forward_prepared(self.views(flat), x)

    def prepare(self, flat: torch.Tensor) -> tuple:
        """What :meth:`forward_prepared` takes for the expert in ``flat``: its :meth:`views`. Made once for a
        buffer that holds expert after expert (a staging buffer: four tensor calls less per expert)."""
        return self.views(flat)

    def forward_prepared(self, views: tuple, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` of the expert that :meth:`prepare` made ``views`` of."""
        w_up, w_down, b_up, b_down = views
        y = F.linear(x, w_up, b_up)
        if self.gated:
            gate, up = y[:, : self.inter], y[:, self.inter:]
            y = self.glu(gate, up)
        else:
            y = F.relu(y)
        return F.linear(y, w_down, b_down)


def init_expert_(flat: torch.Tensor, layout: ExpertLayout, generator: torch.Generator) -> torch.Tensor:
    """Fill ``flat`` (one expert, any float dtype, on the host) with random weights in place: matrices
    uniform with variance 1/fan_in, biases with standard deviation 0.02, so activations keep their scale
    through the layers. Uniform draws (not normal) because they are several times faster to make."""
    w_up, w_down, b_up, b_down = layout.views(flat)
    for part, std in ((w_up, layout.hidden ** -0.5), (w_down, layout.inter ** -0.5), (b_up, 0.02), (b_down, 0.02)):
        if part is not None:
            bound = 3 ** 0.5 * std
            part.uniform_(-bound, bound, generator=generator)
    return flat


def init_expert(layout: ExpertLayout, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """A new flat expert (host) with :func:`init_expert_`'s weights."""
    return init_expert_(torch.empty(layout.numel, dtype=dtype), layout, generator)
