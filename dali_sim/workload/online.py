"""Online workloads: the routing of each (step, MoE layer) as a real model computes it, layer by layer.

A trace-driven :class:`~dali_sim.workload.builder.Workload` knows every step in advance; when a real
model generates (``dali exec generate``), the routing of (step, layer) exists only once that layer's
router has run. :class:`OnlineWorkload` has the read interface the :class:`~dali_sim.runtime.controller.Controller`
uses (``activated``, ``step_phase``, ``step_tokens``, ``predicted_counts`` / ``predicted_ranks``,
``frequencies``, ...) and is fed as the model runs::

    w = OnlineWorkload(model_spec, predictors=("residual",))
    controller = Controller(w, costs, placement, cache, prefetch, capacities, ...)
    step = w.begin_step("prefill", tokens, batch=0, seq_ids=..., positions=...)
    for layer in range(w.num_layers):
        w.set_layer(layer, ids, predicted={"residual": ids_predicted_for_layer_plus_1})
        plan = controller.plan(step, layer)      # the same controller and policies as the simulator

so the same controller and policies run unchanged. What cannot be run online is refused by
:func:`check_online`: bounds (``optimal`` placement and cache, the ``lower-bound`` preset) and oracle
heuristics (policies that read the future: ``belady`` cache, ``oracle`` prefetch); asking for a layer
not yet routed is an error. Frequencies (for ``cache_init = frequency`` and frequency-based
placements) come from a prior trace (:func:`frequencies_from_trace`) or are uniform. No torch here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from dali_sim.models.spec import ModelSpec
from dali_sim.policies import kernels
from dali_sim.policies.base import readonly
from dali_sim.trace.reader import read_trace
from dali_sim.trace.schema import DECODE, PREFILL
from dali_sim.workload.builder import SparseCounts, WorkloadConfig, predicted_top_k
from dali_sim.workload.profiling import trace_frequencies

#: lookahead predictors a running model can compute at MoE layer l from its gate input x_l
ONLINE_PREDICTORS = {
    "next-gate": "router of MoE layer l+1 on x_l (mixtral-offloading, AdapMoE)",
    "residual": "router of MoE layer l+1 on x_l + r_l, r_l a calibrated residual vector (DALI); needs --residual",
    "gate<d>": "router of MoE layer l+d on x_l, d >= 2 (HybriMoE's look-ahead of the next layers: gate2, gate3)",
}
_GATE_D = re.compile(r"^gate([2-9]|[1-9][0-9]+)$")
_PHASES = {"prefill": PREFILL, "decode": DECODE, PREFILL: PREFILL, DECODE: DECODE}


def predictor_offset(name: str) -> int:
    """How many MoE layers ahead an online predictor looks (``next-gate``, ``residual``: 1; ``gate<d>``: d)."""
    if name in ("next-gate", "residual"):
        return 1
    m = _GATE_D.match(name)
    if m:
        return int(m.group(1))
    known = "; ".join(f"{k}: {v}" for k, v in ONLINE_PREDICTORS.items())
    raise ValueError(f"lookahead {name!r} cannot be computed while the model runs; online predictors: {known}")


def check_online(sysconf) -> None:
    """Refuse a system that a running model cannot run: a time bound, a bound policy, or a policy that
    reads the future (a running model knows the routing of a layer only once it has run). ``sysconf``: a
    resolved ``SystemConfig``."""
    if sysconf.time_bound:
        raise ValueError(f"system {sysconf.name!r} is a time bound computed by the simulator (`dali sim run`), "
                         "not a system that runs")
    if sysconf.memory.cache_init == "frequency-hindsight":
        raise ValueError(f"system {sysconf.name!r}: memory.cache_init=frequency-hindsight reads the frequencies of "
                         "the data being run, which a running model does not know: use frequency with --profile-trace")
    for family in ("placement", "cache", "prefetch"):
        policy = getattr(sysconf, family).build()
        if not (policy.is_bound or policy.reads_future):
            continue
        kind = "a bound" if policy.is_bound else "an oracle heuristic"
        if policy.reads_future:
            what = "next-use times" if policy.needs_future else "the true routing of later layers"
            why = f"it reads the future ({what}), which a running model does not know"
        else:
            why = "a reference to compare with, not a system"
        raise ValueError(
            f"system {sysconf.name!r}: the {family} policy {policy.name!r} is {kind}: {why}; bounds and oracle "
            f"heuristics can only be simulated on a recorded trace (`dali trace record`, then `dali sim run`). "
            f"Choose another system or --set {family}.policy=...")


def frequencies_from_trace(path: str | Path, model: ModelSpec) -> np.ndarray:
    """(L, E) total workload of every expert in a prior trace of the same model (``--profile-trace``, the
    profiling input of a run on a live model; ``--frequencies-from`` is its old name)."""
    trace = read_trace(path)
    have = (tuple(trace.layers), trace.num_experts)
    want = (tuple(model.moe_layers), model.num_experts)
    if have != want:
        raise ValueError(f"--profile-trace {path}: the trace has MoE layers {list(have[0])} with {have[1]} experts, "
                         f"the model {list(want[0])} with {want[1]}: use a trace recorded from this model")
    return trace_frequencies(trace)


def _segment_rule(ids, num_experts):
    """:meth:`OnlineWorkload._segment` with the range check and the counts, as one loop (compiled with numba):
    (ok, experts in touch order (int16), workloads (int32), best ranks (int8), (E,) counts, (E,) best rank
    per expert (top_k where absent)). Touch order: workload descending, then best rank, then id."""
    n, k = ids.shape
    counts = np.zeros(num_experts, np.int64)
    best = np.full(num_experts, k, np.int64)
    for r in range(k):
        for t in range(n):
            e = ids[t, r]
            if e < 0 or e >= num_experts:
                return False, np.zeros(0, np.int16), np.zeros(0, np.int32), np.zeros(0, np.int8), counts, best
            counts[e] += 1
            if best[e] > r:
                best[e] = r
    m = 0
    for e in range(num_experts):
        if counts[e] > 0:
            m += 1
    experts = np.empty(m, np.int64)
    m = 0
    for e in range(num_experts):
        if counts[e] > 0:
            experts[m] = e
            m += 1
    # lexsort((experts, best, -count)): stable sorts by the minor keys first
    by_rank = experts[np.argsort(best[experts], kind="mergesort")]
    touch = by_rank[np.argsort(-counts[by_rank], kind="mergesort")]
    return (True, touch.astype(np.int16), counts[touch].astype(np.int32), best[touch].astype(np.int8), counts,
            best)


def _routing_rule(ids, observed):
    """:func:`_segment_rule` of a layer's routing, its counts added to the layer's (E,) ``observed`` workloads
    (compiled): (ok, experts, workloads, best ranks)."""
    ok, experts, cnt, best, counts, _ = _segment_rule_fn(ids, observed.shape[0])
    if ok:
        observed += counts
    return ok, experts, cnt, best


def _prediction_rule(ids, num_experts, target, ptr, expert, count, rank):
    """:func:`_segment_rule` of a prediction, written as segment ``target`` of a step's buffers
    (:class:`_StepColumn`, :meth:`_StepColumn.set`'s rule; compiled); False, nothing written, for an id out
    of range."""
    ok, experts, cnt, best, _, _ = _segment_rule_fn(ids, num_experts)
    if ok:
        lo = ptr[target]
        hi = lo + experts.shape[0]
        expert[lo:hi] = experts
        count[lo:hi] = cnt
        rank[lo:hi] = best
        ptr[target + 1:] = hi
    return ok


_segment_rule_fn = _segment_rule  # what _routing_rule and _prediction_rule call: the compiled _segment_rule
_SEGMENT: list = []  # the compiled _segment_rule, _routing_rule and _prediction_rule (or None)


def _where(where) -> str:
    """An error message's prefix: a string, or (format, args...) formatted now (set_layer builds its
    prefixes only when it raises)."""
    return where if isinstance(where, str) else where[0].format(*where[1:])


def _segment_kernel():
    """The compiled :func:`_segment_rule` (and, in ``_SEGMENT``, :func:`_routing_rule` and
    :func:`_prediction_rule`), or None without numba."""
    if not _SEGMENT:
        global _segment_rule_fn
        rule = kernels.jit(_segment_rule)
        if rule is not None:
            _segment_rule_fn = rule
        _SEGMENT.extend([rule, *(kernels.jit(f) if rule is not None else None
                                 for f in (_routing_rule, _prediction_rule))])
    return _SEGMENT[0]


class _Growing:
    """A 1-D array that grows by appending; ``view`` is the filled part (no copy)."""

    def __init__(self, dtype):
        self.data = np.zeros(16, dtype)
        self.n = 0

    def append(self, value) -> None:
        if self.n == len(self.data):
            self.data = np.concatenate([self.data, np.zeros_like(self.data)])
        self.data[self.n] = value
        self.n += 1

    @property
    def view(self) -> np.ndarray:
        return self.data[: self.n]


class _StepColumn:
    """One predictor's predictions of the current step as sparse segments, segment ``i`` = target MoE layer
    ``i`` (:class:`~dali_sim.workload.builder.SparseCounts`' layout for one step): fixed buffers, filled as
    the layers are set, emptied at each step. ``sparse`` holds read-only views of them (the controller binds
    them once; they show the current step's content)."""

    def __init__(self, num_layers: int, num_experts: int):
        n = num_layers * num_experts  # each target layer predicts at most every expert once
        self.ptr = np.zeros(num_layers + 1, np.int64)
        self.expert, self.count, self.rank = np.zeros(n, np.int16), np.zeros(n, np.int32), np.zeros(n, np.int8)
        self.sparse = SparseCounts(*(readonly(a) for a in (self.ptr, self.expert, self.count, self.rank)))

    def set(self, target: int, experts: np.ndarray, counts: np.ndarray, ranks: np.ndarray) -> None:
        """The segment of ``target`` (targets are set in ascending order within a step); every later
        segment reads empty until set."""
        lo = int(self.ptr[target])
        hi = lo + len(experts)
        self.expert[lo:hi] = experts
        self.count[lo:hi] = counts
        self.rank[lo:hi] = ranks
        self.ptr[target + 1:] = hi


class OnlineWorkload:
    """The workload of a model that is running: steps begin one after another, the routing of each MoE
    layer is set when its router has run (module docstring). Read it like a
    :class:`~dali_sim.workload.builder.Workload`; only the current step is readable, and only its layers
    already set.

    ``predictors``: the lookahead predictors the policies read (names of :data:`ONLINE_PREDICTORS`, or a
    mapping name -> target offset). ``frequencies``: (L, E) prior workloads (default: uniform, all 1);
    ``frequencies_source`` says where they came from (recorded in results).
    """

    def __init__(self, model: ModelSpec, predictors: Sequence[str] | Mapping[str, int] = (), *,
                 frequencies: np.ndarray | None = None, frequencies_source: str = "uniform",
                 config: WorkloadConfig = WorkloadConfig()):
        self.model = model
        self.config = config
        self.num_layers = model.num_moe_layers
        self.num_experts = model.num_experts
        self.top_k = model.top_k
        L, E = self.num_layers, self.num_experts
        if isinstance(predictors, Mapping):
            offsets = {str(k): int(v) for k, v in predictors.items()}
        else:
            offsets = {name: predictor_offset(name) for name in predictors}
        for name, off in offsets.items():
            if off < 1:
                raise ValueError(f"lookahead {name!r}: target offset must be >= 1, got {off}")
        self.predictor_offsets: dict[str, int] = offsets
        #: the predictors, as the controller lists them (``tuple(workload.predicted)``)
        self.predicted: dict[str, int] = dict(offsets)
        self._columns = {name: _StepColumn(L, E) for name in offsets}
        #: per predictor, the current step's predictions as read-only sparse segments, segment ``i`` = target
        #: MoE layer ``i`` (a trace workload's ``predicted`` layout for one step; the views stay valid, their
        #: content follows the step): what the controller's compiled plans read
        self.step_predicted: dict[str, SparseCounts] = {name: c.sparse for name, c in self._columns.items()}
        if frequencies is None:
            self._freq = np.ones((L, E), np.int64)
            frequencies_source = "uniform"
        else:
            self._freq = np.asarray(frequencies, np.int64)
            if self._freq.shape != (L, E):
                raise ValueError(f"frequencies must be ({L}, {E}) (MoE layers x experts), got {self._freq.shape}")
        self.frequencies_source = frequencies_source
        self._phase, self._tokens, self._batch = _Growing(np.int8), _Growing(np.int64), _Growing(np.int64)
        self._context, self._kv = _Growing(np.float64), _Growing(np.int64)
        self._step = -1
        self._now = (-1, 0, 0)  # the open step: (index, phase, tokens)
        self._next_layer = L  # no step open
        self._act: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._observed = np.zeros((L, E), np.int64)
        self._seqs: dict[int, list[int]] = {}  # seq_id -> [batch, prefill, decode, first/last prefill, first/last decode]

    # ---- feeding --------------------------------------------------------------------------------
    def begin_step(self, phase: int | str, tokens: int, *, batch: int = 0, seq_ids: np.ndarray | None = None,
                   positions: np.ndarray | None = None) -> int:
        """Open the next step (the previous one must have every MoE layer set); returns its index.
        ``seq_ids`` and ``positions`` (one per token) feed the per-sequence table and the context sizes."""
        if self._step >= 0 and self._next_layer != self.num_layers:
            raise ValueError(f"online workload: step {self._step} ended after {self._next_layer} of "
                             f"{self.num_layers} MoE layers (every MoE layer must be set once per step)")
        if phase not in _PHASES:
            raise ValueError(f"phase must be prefill or decode, got {phase!r}")
        tokens = int(tokens)
        if tokens < 1:
            raise ValueError(f"a step needs at least one token, got {tokens}")
        ph = _PHASES[phase]
        self._step += 1
        s = self._step
        context, kv = 0.0, 0
        if seq_ids is not None or positions is not None:
            if seq_ids is None or positions is None:
                raise ValueError("give both seq_ids and positions, or neither")
            seq_ids = np.asarray(seq_ids, np.int64)
            positions = np.asarray(positions, np.int64)
            if seq_ids.shape != (tokens,) or positions.shape != (tokens,):
                raise ValueError(f"seq_ids and positions must have one value per token ({tokens})")
            # one pass over the tokens in Python (a step has a few: the array operations cost more); the
            # integer sum is exact, so the mean is float((positions + 1).mean())'s
            sids, pos = seq_ids.tolist(), positions.tolist()
            context = (sum(pos) + tokens) / tokens
            last: dict[int, int] = {}  # per sequence: its last position (at least -1), its tokens in the step
            per_seq: dict[int, int] = {}
            for sid, p in zip(sids, pos):
                if last.get(sid, -1) < p:
                    last[sid] = p
                else:
                    last.setdefault(sid, -1)
                per_seq[sid] = per_seq.get(sid, 0) + 1
            kv = sum(last.values()) + len(last)
            for sid in sorted(per_seq):
                n = per_seq[sid]
                rec = self._seqs.setdefault(sid, [batch, 0, 0, -1, -1, -1, -1])
                if ph == PREFILL:
                    rec[1] += n
                    rec[3] = s if rec[3] < 0 else rec[3]
                    rec[4] = s
                else:
                    rec[2] += n
                    rec[5] = s if rec[5] < 0 else rec[5]
                    rec[6] = s
        self._phase.append(ph)
        self._tokens.append(tokens)
        self._batch.append(batch)
        self._context.append(context)
        self._kv.append(kv)
        self._next_layer = 0
        self._act = []
        for column in self._columns.values():
            column.ptr[:] = 0
        self._now = (s, ph, tokens)
        return s

    def set_layer(self, layer: int, ids: np.ndarray, predicted: Mapping[str, np.ndarray] | None = None) -> None:
        """The routing of MoE layer ordinal ``layer`` (the next one) in the current step.

        ``ids``: (tokens, top_k) expert ids per token in rank order. ``predicted``: per predictor, what it
        predicts for MoE layer ``layer + offset``, made from this layer's gate input: either (tokens,
        top_k) integer expert ids in rank order, or (tokens, num_experts) float logits (top-k as for a
        trace's lookahead column). Every predictor whose target layer exists must be given."""
        if self._step < 0 or self._next_layer >= self.num_layers:
            raise ValueError("online workload: no step is open (call begin_step first)")
        if layer != self._next_layer:
            raise ValueError(f"online workload: step {self._step} expects MoE layer {self._next_layer}, got {layer}")
        T, k, E = int(self._tokens.view[-1]), self.top_k, self.num_experts
        where = ("step {} layer {}: routing", self._step, layer)  # formatted only for an error
        compiled = _segment_kernel() is not None
        if compiled:  # the checks, the counts and the segment in one compiled loop
            ok, *segment = _SEGMENT[1](self._ids_shape(ids, T, where), self._observed[layer])
            if not ok:
                raise ValueError(f"{_where(where)}: expert ids must lie in 0..{E - 1}")
        else:
            ids = self._ids(ids, T, where)
            counts = np.bincount(ids.reshape(-1), minlength=E)
            segment = self._segment(ids, counts)
            self._observed[layer] += counts
        for a in segment:  # (fresh arrays: read-only as a trace workload's, without a view)
            a.flags.writeable = False
        self._act.append(tuple(segment))
        predicted = predicted or {}
        unknown = [name for name in predicted if name not in self.predictor_offsets]
        if unknown:
            unknown = sorted(unknown)
            raise ValueError(f"online workload: predictors {unknown} were not declared; "
                             f"declared: {sorted(self.predictor_offsets) or 'none'}")
        for name, off in self.predictor_offsets.items():
            target = layer + off
            if target >= self.num_layers:
                if name in predicted:
                    raise ValueError(f"online workload: {name!r} at layer {layer} would predict MoE layer {target}, "
                                     f"but the model has {self.num_layers}")
                continue
            if name not in predicted:
                raise ValueError(f"online workload: step {self._step} layer {layer} lacks the {name!r} prediction "
                                 f"of layer {target}")
            arr = np.asarray(predicted[name])
            if arr.dtype.kind == "f":
                if arr.shape != (T, E):
                    raise ValueError(f"{name!r} logits must be ({T}, {E}), got {arr.shape}")
                keep = ~np.isnan(arr).all(axis=1)
                arr = predicted_top_k(arr[keep], k)
            where = ("step {} layer {}: {!r} prediction", self._step, layer, name)
            column = self._columns[name]
            if compiled:
                if not _SEGMENT[2](self._ids_shape(arr, None, where), E, target, column.ptr, column.expert,
                                   column.count, column.rank):
                    raise ValueError(f"{_where(where)}: expert ids must lie in 0..{E - 1}")
            else:
                column.set(target, *self._segment(self._ids(arr, None, where)))
        self._next_layer += 1

    def _ids_shape(self, ids: np.ndarray, tokens: int | None, where) -> np.ndarray:
        """``ids`` as a (tokens, top_k) int64 array (the range is the caller's check). ``where``: the error's
        prefix, or (format, args...) to format for an error (:func:`_where`)."""
        ids = np.asarray(ids)
        k = self.top_k
        shape = ids.shape
        if len(shape) != 2 or shape[1] != k or (tokens is not None and shape[0] != tokens):
            want = f"({tokens}, {k})" if tokens is not None else f"(tokens, {k})"
            raise ValueError(f"{_where(where)}: expected {want} expert ids, got shape {ids.shape}")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"{_where(where)}: expert ids must be integers, got {ids.dtype}")
        return ids if ids.dtype == np.int64 and ids.flags.c_contiguous else np.ascontiguousarray(ids, dtype=np.int64)

    def _ids(self, ids: np.ndarray, tokens: int | None, where) -> np.ndarray:
        ids = self._ids_shape(ids, tokens, where)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_experts):
            raise ValueError(f"{_where(where)}: expert ids must lie in 0..{self.num_experts - 1}")
        return ids

    def _segment(self, ids: np.ndarray, counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(experts in touch order, workloads, best ranks): the trace workload's rule for one (step, layer)
        (:func:`~dali_sim.workload.builder._sparse_counts` for a single segment, in a few array operations;
        the same values and dtypes). ``counts``: ``bincount`` of the ids, if already known."""
        n = ids.shape[0]
        experts, first = np.unique(ids.T.reshape(-1), return_index=True)  # rank-major: the first hit is the best rank
        best = first // n
        if counts is None:
            counts = np.bincount(ids.reshape(-1), minlength=self.num_experts)
        cnt = counts[experts]
        touch = np.lexsort((experts, best, -cnt))
        return experts[touch].astype(np.int16), cnt[touch].astype(np.int32), best[touch].astype(np.int8)

    # ---- the Workload read interface ----------------------------------------------------------
    def _check(self, step: int, layer: int, what: str) -> None:
        if step != self._step or not 0 <= layer < self._next_layer:
            raise ValueError(f"online workload: the {what} of step {step}, MoE layer {layer} is not known "
                             f"(now: step {self._step}, {self._next_layer} of {self.num_layers} layers routed); "
                             "a running model knows a layer's routing only once it has run")

    def activated(self, step: int, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(expert ids in touch order, workloads, best ranks) of MoE layer ``layer`` at ``step``."""
        self._check(step, layer, "routing")
        return self._act[layer]

    def layer_segment(self, step: int, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
        """(expert ids in touch order, workloads, best ranks, phase, tokens) of MoE layer ``layer`` at ``step``,
        the arrays read-only: the controller's read of a layer in one call."""
        s, phase, tokens = self._now
        if step != s or not 0 <= layer < self._next_layer:
            self._check(step, layer, "routing")
        experts, counts, ranks = self._act[layer]
        return experts, counts, ranks, phase, tokens

    def _prediction(self, name: str, step: int, layer: int) -> SparseCounts | None:
        """The step's segments of predictor ``name`` once its prediction of ``layer`` is known (None: nothing
        predicts ``layer``)."""
        if name not in self.predictor_offsets:
            raise KeyError(f"predictor {name!r} was not loaded into this workload")
        source = layer - self.predictor_offsets[name]
        if source < 0:
            return None  # nothing predicts this layer (as a trace's workload: all zeros)
        self._check(step, source, f"{name!r} prediction (made at layer {source})")
        return self.step_predicted[name]

    def predicted_counts(self, name: str, step: int, layer: int) -> np.ndarray:
        """(E,) number of the step's tokens whose predicted top-k for MoE layer ``layer`` holds each expert."""
        p = self._prediction(name, step, layer)
        out = np.zeros(self.num_experts, np.float64)
        if p is not None:
            seg = p.segment(layer)
            out[p.expert[seg]] = p.count[seg]
        return out

    def predicted_ranks(self, name: str, step: int, layer: int) -> np.ndarray:
        """(E,) best predicted rank of each expert for MoE layer ``layer``; ``top_k`` where not predicted."""
        p = self._prediction(name, step, layer)
        out = np.full(self.num_experts, self.top_k, np.int64)
        if p is not None:
            seg = p.segment(layer)
            out[p.expert[seg]] = p.rank[seg]
        return out

    def frequencies(self) -> np.ndarray:
        """(L, E) prior workloads for frequency-based choices: a prior trace's, or uniform."""
        return self._freq.copy()

    def observed_frequencies(self) -> np.ndarray:
        """(L, E) workloads of the steps fed so far."""
        return self._observed.copy()

    @property
    def routed_layers(self) -> int:
        """MoE layers of the current step set so far (``num_layers`` once the step is complete)."""
        return self._next_layer if self._step >= 0 else 0

    @property
    def num_steps(self) -> int:
        return self._step + 1

    @property
    def step_phase(self) -> np.ndarray:
        return self._phase.view

    @property
    def step_tokens(self) -> np.ndarray:
        return self._tokens.view

    @property
    def step_batch(self) -> np.ndarray:
        return self._batch.view

    @property
    def step_context(self) -> np.ndarray:
        return self._context.view

    @property
    def step_kv(self) -> np.ndarray:
        return self._kv.view

    @property
    def max_batch_context(self) -> int:
        return int(self.step_kv.max()) if self.num_steps else 0

    @property
    def sequences(self) -> pd.DataFrame:
        """One row per sequence seen, as :attr:`Workload.sequences`."""
        cols = ["batch", "prompt_tokens_traced", "decode_tokens", "first_prefill_step", "last_prefill_step",
                "first_decode_step", "last_decode_step"]
        ids = sorted(self._seqs)
        data = np.array([self._seqs[i] for i in ids], np.int64).reshape(len(ids), len(cols))
        df = pd.DataFrame(data, columns=cols)
        df.insert(0, "seq_id", np.array(ids, np.int64))
        return df

    def describe(self) -> dict:
        phase = self.step_phase
        seqs = self.sequences
        return {
            "steps": self.num_steps,
            "prefill_steps": int((phase == PREFILL).sum()),
            "decode_steps": int((phase == DECODE).sum()),
            "batches": int(seqs["batch"].max()) + 1 if len(seqs) else 0,
            "sequences": len(seqs),
            "tokens": int(self.step_tokens.sum()),
        }


__all__ = ["ONLINE_PREDICTORS", "OnlineWorkload", "check_online", "frequencies_from_trace", "predictor_offset"]
