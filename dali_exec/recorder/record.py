"""Record a routing trace: generate greedily for each prompt, hooks on every MoE router, rows streamed
to a :class:`~dali_sim.trace.TraceWriter` (complete file, or a readable ``.partial`` one on error).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from dali_exec.models import get_adapter
from dali_exec.recorder.generation import ForwardRows, greedy_generate
from dali_exec.recorder.hooks import RoutingCapture
from dali_exec.recorder.prompts import Prompt, check_fits, tokenize
from dali_exec.recorder.residual import ResidualVectors, config_sha256
from dali_exec.recorder.sink import RowSink
from dali_sim.models.hf_config import spec_from_hf_config
from dali_sim.models.spec import ModelSpec
from dali_sim.trace import PredictorInfo, SequenceInfo, TraceWriter
from dali_sim.trace.provenance import default_provenance

NEXT_GATE = PredictorInfo(
    "next-gate", 1, "router of the next MoE layer applied to this layer's gate input (mixtral-offloading, AdapMoE)")


def far_gate(d: int) -> PredictorInfo:
    """``gate<d>``: the router of the MoE layer d layers on, on this layer's gate input (HybriMoE reads d = 2, 3)."""
    return PredictorInfo(f"gate{d}", d, f"router of the MoE layer {d} layers on applied to this layer's gate input "
                                        "(HybriMoE's look-ahead)")
HIDDEN_WHAT = ("gate input of each (token, MoE layer): the hidden state the block's router receives "
               "(after the post-attention norm)")


@dataclass(frozen=True)
class RecordOptions:
    """What to record and how to generate. ``residuals`` adds the ``residual`` lookahead column;
    ``next_gates`` D >= 2 adds ``gate2`` .. ``gate<D>`` (the routers of the MoE layers 2..D on)."""

    batch_size: int = 1
    max_new_tokens: int = 32
    prefill_chunk: int = 0
    router_logits: bool = False
    hidden_states: bool = False
    next_gate: bool = True
    residuals: ResidualVectors | None = None
    next_gates: int = 1

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.next_gates < 1:
            raise ValueError(f"next_gates must be >= 1 (1 = only the next layer's router), got {self.next_gates}")
        for name in ("max_new_tokens", "prefill_chunk"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass
class RecordResult:
    path: Path
    rows: int
    generated: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> generated token ids


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def special_ids(model, tokenizer) -> tuple[list[int], int]:
    """(EOS ids, pad id) from the generation config, the model config or the tokenizer."""
    gen = getattr(model, "generation_config", None)
    eos = _token_ids(getattr(gen, "eos_token_id", None)) or _token_ids(getattr(model.config, "eos_token_id", None))
    if not eos and tokenizer is not None:
        eos = _token_ids(tokenizer.eos_token_id)
    pad = getattr(gen, "pad_token_id", None)
    if pad is None and tokenizer is not None:
        pad = tokenizer.pad_token_id
    if pad is None:
        pad = eos[0] if eos else 0
    return eos, int(pad)


def check_spec(spec: ModelSpec, blocks, where: str) -> None:
    """The trace's model spec must name exactly the blocks the hooks found."""
    found = tuple(b.layer for b in blocks)
    if tuple(spec.moe_layers) != found:
        raise ValueError(f"{where}: the model spec lists MoE blocks {list(spec.moe_layers)}, "
                         f"the model has {list(found)}")
    if (spec.top_k, spec.num_experts) != (blocks[0].top_k, blocks[0].num_experts):
        raise ValueError(f"{where}: the model spec says top-{spec.top_k} of {spec.num_experts} experts, the routers "
                         f"use top-{blocks[0].top_k} of {blocks[0].num_experts}")


class _Observer:
    """Per forward pass: tell the hooks which tokens to keep, then hand their routing to the sink."""

    def __init__(self, capture: RoutingCapture, sink: RowSink, bar):
        self.capture, self.sink, self.bar = capture, sink, bar
        self.seq_ids = np.zeros(0, dtype=np.int64)
        self.tokens = 0

    def before_forward(self, rows: ForwardRows) -> None:
        self.capture.start_forward(rows.index)

    def after_forward(self, rows: ForwardRows) -> None:
        self.sink.add(self.capture.collect(), self.seq_ids[rows.row], rows.pos, rows.phase)
        self.tokens += len(rows)
        self.bar.set_postfix(tokens=self.tokens, refresh=False)


def record_trace(
    model,
    prompts: Sequence[Prompt],
    output: str | Path,
    *,
    tokenizer=None,
    options: RecordOptions = RecordOptions(),
    spec: ModelSpec | None = None,
    provenance: Mapping[str, Any] | None = None,
    prompts_source: str = "",
    progress: bool = False,
) -> RecordResult:
    """Generate for every prompt and write one trace row per (sequence, position, MoE layer).

    Prompts are batched in list order; a sequence's ``seq_id`` is its ``Prompt.index``. ``spec`` defaults to the
    one read from the model's config. On any exception the rows of every finished forward pass are
    kept in ``OUTPUT.partial`` (a readable partial trace) and the exception propagates.
    """
    from tqdm.auto import tqdm

    output = Path(output)
    adapter = get_adapter(model)
    blocks = adapter.blocks(model)
    if spec is None:
        spec = spec_from_hf_config(model.config.to_dict(), name=getattr(model.config, "_name_or_path", None) or None)
    check_spec(spec, blocks, str(output))
    if len({p.index for p in prompts}) != len(prompts):
        raise ValueError(f"{prompts_source or 'prompts'}: prompt indices (the trace's seq_id) must be unique")
    token_ids = tokenize(prompts, tokenizer, prompts_source or "prompts")
    check_fits(prompts, token_ids, model.config, options.max_new_tokens, prompts_source or "prompts")
    eos, pad = special_ids(model, tokenizer)

    predictors = [NEXT_GATE] if options.next_gate else []
    residuals = None
    if options.residuals is not None:
        options.residuals.check_matches(model, spec.moe_layers, options.residuals.source or "residual vectors")
        residuals = {k: v.to(model.device, torch.float32) for k, v in options.residuals.vectors.items()}
        predictors.append(PredictorInfo("residual", 1, (
            "router of the next MoE layer applied to this layer's gate input plus the calibrated residual vector "
            f"(DALI); vectors: {options.residuals.source or '(in memory)'}, "
            f"{options.residuals.meta.get('num_tokens', '?')} calibration tokens")))
    if options.next_gates >= len(blocks):
        raise ValueError(f"--next-gates {options.next_gates}: the model has {len(blocks)} MoE layers, so at most "
                         f"{len(blocks) - 1} of them follow a layer")
    predictors += [far_gate(d) for d in range(2, options.next_gates + 1)]
    prov = dict(provenance) if provenance is not None else default_provenance("record")
    prov.setdefault("recorder", _recorder_details(model, options, eos, pad))

    capture = RoutingCapture(model, adapter, router_logits=options.router_logits, hidden=options.hidden_states,
                             next_gate=options.next_gate, residuals=residuals, blocks=blocks,
                             gate_depth=options.next_gates)
    result = RecordResult(output, 0)
    with TraceWriter(output, spec, provenance=prov, weights_note=adapter.weights_note(blocks[0]),
                     router_logits=options.router_logits, predictors=predictors,
                     hidden_dim=spec.hidden_size if options.hidden_states else None,
                     hidden_what=HIDDEN_WHAT) as writer, \
            tqdm(total=len(prompts), unit="seq", desc="record", disable=not progress) as bar:
        sink = RowSink(writer, spec.moe_layers)
        observer = _Observer(capture, sink, bar)
        running: list[int] = []
        try:
            with capture:
                for start in range(0, len(prompts), options.batch_size):
                    batch = prompts[start:start + options.batch_size]
                    running = list(range(start, start + len(batch)))
                    observer.seq_ids = np.array([p.index for p in batch], dtype=np.int64)
                    out = greedy_generate(model, token_ids[start:start + len(batch)],
                                          max_new_tokens=options.max_new_tokens, eos_ids=eos, pad_id=pad,
                                          prefill_chunk=options.prefill_chunk, observer=observer)
                    for p, n, gen in zip(batch, out.prompt_lengths, out.generated):
                        writer.add_sequence(_sequence_info(p, n, gen, eos, prompts_source))
                        result.generated[p.index] = gen
                    running = []
                    bar.update(len(batch))
        finally:
            sink.flush()
            for i in running:  # interrupted batch: facts known so far
                p = prompts[i]
                attrs = p.attrs | {"source": prompts_source, "index": p.index, "interrupted": True}
                writer.add_sequence(SequenceInfo(p.index, p.name, len(token_ids[i]), None, attrs))
        result.rows = writer.rows_written
    return result


def _sequence_info(p: Prompt, prompt_len: int, gen: list[int], eos: list[int], source: str) -> SequenceInfo:
    stop = "eos" if gen and gen[-1] in eos else "length"
    attrs = p.attrs | {"source": source, "index": p.index, "stop": stop}
    return SequenceInfo(p.index, p.name, prompt_len, len(gen), attrs)


def _recorder_details(model, options: RecordOptions, eos: list[int], pad: int) -> dict[str, Any]:
    return {
        "model_type": model.config.model_type,
        "config_sha256": config_sha256(model.config),
        "dtype": str(model.dtype).replace("torch.", ""),
        "device": str(model.device),
        "decoding": "greedy",
        "batch_size": options.batch_size,
        "max_new_tokens": options.max_new_tokens,
        "prefill_chunk": options.prefill_chunk,
        "padding": "left",
        "eos_token_ids": eos,
        "pad_token_id": pad,
        "decode_rows": "a sequence with G generated tokens has G-1 decode rows: the last token is never fed back",
    }
