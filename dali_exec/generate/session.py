"""The offloaded model while it runs: every MoE block's routed experts replaced by the offloading runtime.

:class:`OffloadSession` swaps each MoE block's ``experts`` module for an :class:`OffloadedExperts`
(same call: gate input, the router's top-k ids and weights -> the weighted sum of the routed experts),
so the model's own code still runs everything else: attention, norms, the router, shared experts and
their gates, the residual additions, the LM head. Per MoE layer of a step, when the block calls its
experts:

1. the router's ids (the step's real tokens: no padding, no finished sequences) and the lookahead
   predictions made from this gate input (``next-gate``: router_{l+1}(x_l), ``residual``:
   router_{l+1}(x_l + r_l), ``gate<d>``: router_{l+d}(x_l); top-k by the family's rule) feed the
   :class:`~dali_sim.workload.online.OnlineWorkload`;
2. the simulator's :class:`~dali_sim.runtime.controller.Controller` plans the layer (the same policies,
   cache semantics and prefetch bookkeeping as ``dali sim``);
3. the :class:`~dali_exec.executor.runtime.OffloadRuntime` performs the plan: swaps land, prefetches
   start, CPU experts run on the CPU lane from host memory, GPU experts from cache slots, prefetch or
   staging buffers after their copies; the outputs are combined as transformers combines them.

Every row the model itself would give an expert is computed, in the model's order (padding rows ride
along with the experts real tokens activate; they are not part of the workload), with the model's own
operations (:mod:`.experts`), so on one device the output is bit for bit the model's, whatever the
placement, prefetching or cache decided.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from dali_exec.executor import kernels as _kernels
from dali_exec.executor.devices import Devices
from dali_exec.executor.routing import LayerRouting
from dali_exec.executor.runtime import OffloadRuntime
from dali_exec.executor.timing import LayerSeconds, Stopwatch, Timer
from dali_exec.models import MoEAdapter, MoEBlock
from dali_exec.recorder.generation import ForwardRows
from dali_sim.runtime.controller import Controller
from dali_sim.sim.counters import PlanCounters
from dali_sim.workload.online import OnlineWorkload


_ALL_ROWS = np.zeros(0, np.int64)

#: how rows that are not part of the workload (left padding, sequences that have stopped) are computed:
#: ``exact``: as the model computes them (they ride along with the plan's experts; experts only they use
#: run on the CPU lane, outside the plan), so every row is bit for bit the model's; ``skip``: not at all
#: (no routed output), as an offloading system would, the real tokens then equal the model's up to rounding
PADDING = ("exact", "skip")


class OffloadedExperts(nn.Module):
    """Stands in for a MoE block's ``experts``: ``forward(x, top_k_index, top_k_weights)`` -> (T, H)."""

    def __init__(self, session: "OffloadSession", ordinal: int, num_experts: int):
        super().__init__()
        self.ordinal = ordinal
        self.num_experts = num_experts
        object.__setattr__(self, "_session", session)  # not a submodule

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return self._session.run_layer(self.ordinal, hidden_states, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        return f"MoE layer {self.ordinal}: offloaded ({self.num_experts} experts in the dali runtime)"


class LayerTimes:
    """Per MoE layer accumulators (seconds): ``time`` (L,), and wall clock and thread CPU of the decisions,
    the session's bookkeeping and the lookahead (:class:`LayerSeconds`; ``(2, L)`` arrays from their
    ``array()``)."""

    def __init__(self, L: int):
        self.L = L
        self.time = np.zeros(L)
        self.decision = LayerSeconds(L)
        self.bookkeeping = LayerSeconds(L)
        self.lookahead = LayerSeconds(L)


class OffloadSession:
    """Installs the offloaded experts into ``model`` (:meth:`install`) and runs each MoE layer's plan
    (:meth:`run_layer`); :meth:`begin_forward` / :meth:`end_forward` bracket each forward pass (one step).

    ``residuals``: MoE block index -> vector (on the dense device, float32), for the ``residual``
    predictor. ``dense_device``: where the model's dense part runs (the model is moved there while
    installed, its routed experts left out)."""

    def __init__(self, model: nn.Module, adapter: MoEAdapter, blocks: list[MoEBlock], workload: OnlineWorkload,
                 controller: Controller, runtime: OffloadRuntime, devices: Devices, timer: Timer, *,
                 dense_device: torch.device, dense_track: str, residuals: Mapping[int, torch.Tensor] | None = None,
                 padding: str = "exact"):
        if padding not in PADDING:
            raise ValueError(f"padding must be one of {', '.join(PADDING)}, got {padding!r}")
        self.padding = padding
        self.model, self.adapter, self.blocks = model, adapter, blocks
        self.w, self.controller, self.runtime, self.dev, self.timer = workload, controller, runtime, devices, timer
        self.dense_device, self.dense_track = dense_device, dense_track
        self.residuals = dict(residuals or {})
        L = len(blocks)
        self.counters = PlanCounters(L)
        self.times = LayerTimes(L)
        self.step: int | None = None
        self.index: torch.Tensor | None = None  # real rows of the current forward pass (None: all)
        self._real_rows: np.ndarray | None = None
        self.step_start: list[float] = []
        self.step_end: list[float] = []
        self._layer_t0 = None  # the current block's start stamp (a CUDA event on the compute stream)
        self._layer_spans: list[tuple[int, object, object]] = []
        self._dense_start: Any = None
        self._installed: list[tuple[MoEBlock, nn.Module]] = []
        self._hooks: list[Any] = []
        self._moved_from: torch.device | None = None
        self._stream = runtime.compute_stream if (devices.is_cuda and dense_track == "gpu") else None
        self._predictions = self._prediction_plan()
        self._plain_select = type(adapter).select is MoEAdapter.select  # rank_order(rule.select(...))

    # ---- installing ---------------------------------------------------------------------------
    def install(self) -> "OffloadSession":
        layers = self.adapter.decoder_layers(self.model)
        for ordinal, b in enumerate(self.blocks):
            original = getattr(b.block, self.adapter.experts_attr, None)
            if original is None or original is not b.experts:
                raise ValueError(f"block {b.layer}: its experts module is not the adapter's (installed twice?)")
            self._installed.append((b, original))
            setattr(b.block, self.adapter.experts_attr, OffloadedExperts(self, ordinal, b.num_experts))
            decoder = layers[b.layer]
            self._hooks.append(decoder.register_forward_pre_hook(self._pre_hook(ordinal)))
            self._hooks.append(decoder.register_forward_hook(self._post_hook(ordinal)))
        here = next(self.model.parameters()).device
        if here != self.dense_device:
            self._moved_from = here
            self.model.to(self.dense_device)
        return self

    def uninstall(self, restore: bool = True) -> None:
        """Remove the hooks; with ``restore``, put the original experts back (and the model where it was)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if restore and self._moved_from is not None:
            self.model.to(self._moved_from)
        for b, original in self._installed:
            setattr(b.block, self.adapter.experts_attr, original if restore else nn.Module())
        self._installed.clear()

    # ---- steps --------------------------------------------------------------------------------
    def begin_forward(self, rows: ForwardRows, seq_ids: np.ndarray, batch: int) -> None:
        """Before a forward pass: its real tokens form one step (a pass of padding only is no step)."""
        if len(rows) == 0:
            self.step, self.index, self._real_rows = None, None, None
            return
        self.dev.synchronize()
        self.step_start.append(self.timer.now())
        self.step = self.w.begin_step(rows.phase, len(rows), batch=batch, seq_ids=seq_ids, positions=rows.pos)
        self.index = rows.index
        self._real_rows = None if rows.index is None else rows.index.cpu().numpy()

    def end_forward(self) -> None:
        if self.step is None:
            return
        self.dev.synchronize()
        self.step_end.append(self.timer.now())
        if self.w.routed_layers != self.w.num_layers:
            raise RuntimeError(f"step {self.step}: {self.w.routed_layers} of {self.w.num_layers} MoE layers ran; "
                               "was a MoE block's forward replaced (hub kernels)?")
        self.step = None

    def _pre_hook(self, ordinal: int):
        def hook(module, args):
            if self.step is not None:
                self._layer_t0 = self._dense_start = self.timer.mark(self._stream)
        return hook

    def _post_hook(self, ordinal: int):
        # no device synchronisation: on CUDA both ends are events on the compute stream (resolved at the
        # end), so the host goes on to the next layer while the device works
        def hook(module, args, output):
            if self.step is not None and self._layer_t0 is not None:
                self._layer_spans.append((ordinal, self._layer_t0, self.timer.mark(self._stream)))
                self._layer_t0 = None
        return hook

    def layer_times(self) -> np.ndarray:
        """(L,) seconds spent in each MoE block (call once the device is synchronised)."""
        seconds = self.timer.seconds
        for ordinal, a, b in self._layer_spans:
            self.times.time[ordinal] += seconds(b) - seconds(a)
        self._layer_spans.clear()
        return self.times.time

    # ---- one MoE layer ------------------------------------------------------------------------
    def run_layer(self, ordinal: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts of MoE layer ``ordinal`` for gate inputs ``x`` (T x H): the plan performed."""
        if self.step is None:  # padding only (a prefill chunk without real tokens): nothing is part of the work
            return torch.zeros_like(x)
        step, t = self.step, self.times
        if self._dense_start is not None:
            self.timer.add_activity(self.dense_track, "dense", step, ordinal, self._dense_start,
                                    self.timer.mark(self._stream))
            self._dense_start = None
        sw = Stopwatch().start()
        idx, rows = self.index, self._real_rows
        flat = ids.reshape(-1)
        perm = torch.sort(flat)[1]  # transformers' grouped_mm order of the (token, k) pairs
        if flat.device.type == "cpu":  # views, no copies
            ids_np, perm, w_np = ids.numpy(), perm.numpy(), weights.float().numpy()
        else:  # the routing to the host: the layer's one wait for the device (two copies: ids with the order, weights)
            both = torch.cat([flat, perm]).cpu().numpy()
            n = flat.numel()
            ids_np, perm, w_np = both[:n].reshape(ids.shape), both[n:], weights.float().cpu().numpy()
        ids_real = ids_np if rows is None else ids_np[rows]
        w_real = w_np if rows is None else w_np[rows]
        # rank order: descending weight, ties keep their column (as rank_order's stable sort)
        rank = _kernels.compiled("rank_order")
        if rank is not None:
            ranked = rank(ids_np, w_np, _ALL_ROWS if rows is None else rows)
        else:
            ranked = np.take_along_axis(ids_real, np.argsort(-w_real, axis=1, kind="stable"), 1)
        # adjacent segments hand over at a shared clock reading (Stopwatch.hand_to)
        if self.w.predictor_offsets:
            look = sw.hand_to(Stopwatch())
            predicted = self._lookahead(ordinal, x if idx is None else x.index_select(0, idx))
            look.hand_to(sw)
            t.lookahead.add(ordinal, look)
        else:
            predicted = None
        self.w.set_layer(ordinal, ranked, predicted)
        dec = sw.hand_to(Stopwatch())
        plan = self.controller.plan(step, ordinal)
        self.counters.add(plan)
        self.runtime.start_layer(plan, handoff=(dec, sw))
        t.decision.add(ordinal, dec)
        skip = self.padding == "skip" and idx is not None
        counted = None
        if skip:  # only the real rows reach the experts; the others get no routed output
            ids_np, w_np = ids_real, w_real
            perm = torch.sort(torch.from_numpy(ids_real.reshape(-1)))[1].numpy()
        elif rows is not None:
            counted = np.zeros(ids_np.shape[0], bool)
            counted[rows] = True
        routing = LayerRouting.group(ids_np, w_np, counted=counted, order=perm)
        if skip:
            sw.stop()
            t.bookkeeping.add(ordinal, sw)
            out = torch.zeros_like(x)
            out.index_copy_(0, idx, self.runtime.run_experts(plan, x.index_select(0, idx), routing).to(x.dtype))
            return out
        out = self.runtime.run_experts(plan, x, routing, uncounted_on_cpu=True, handoff=sw)
        t.bookkeeping.add(ordinal, sw)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _lookahead(self, ordinal: int, x: torch.Tensor) -> dict[str, np.ndarray]:
        """What each predictor the policies read predicts from this gate input (rows: the real tokens)."""
        out: dict[str, np.ndarray] = {}
        adapter = self.adapter
        # on the CPU the top-k's rank order by the compiled kernel (the stable sort of MoEAdapter.select's
        # rank_order: the same ids), on views of the top-k, without three more tensor operations
        rank = _kernels.compiled("rank_order") if self._plain_select and x.device.type == "cpu" else None
        for name, target, residual in self._predictions[ordinal]:
            inp = x if residual is None else (x.float() + residual).to(x.dtype)
            logits = adapter.router_logits(target, inp)
            if rank is not None:
                ids, w = adapter.rule.select(target.router, logits)
                out[name] = rank(ids.numpy(), w.detach().float().numpy(), _ALL_ROWS)
            else:
                out[name] = adapter.select(target, logits)[0].cpu().numpy()
        return out

    def _prediction_plan(self) -> list[tuple[tuple[str, MoEBlock, torch.Tensor | None], ...]]:
        """Per MoE layer ordinal: (predictor, the block it predicts, the residual vector added or None) for
        each predictor whose target layer exists (fixed for the run: made once)."""
        L = len(self.blocks)
        plan = []
        for ordinal, block in enumerate(self.blocks):
            items = []
            for name, offset in self.w.predictor_offsets.items():
                if ordinal + offset >= L:
                    continue
                residual = None
                if name == "residual":
                    residual = self.residuals.get(block.layer)
                    if residual is None:
                        raise ValueError(f"the residual predictor needs a residual vector for MoE block {block.layer}")
                items.append((name, self.blocks[ordinal + offset], residual))
            plan.append(tuple(items))
        return plan


__all__ = ["PADDING", "LayerTimes", "OffloadSession", "OffloadedExperts"]
