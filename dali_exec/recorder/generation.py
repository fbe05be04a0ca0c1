"""Batched greedy generation with an explicit prefill (+ chunks) / decode loop.

Written out instead of driving ``model.generate`` so that the recorder knows, for every forward pass,
whether it is prefill or decode, which cells of the (batch, sequence) input are padding, and which
sequences have already finished: only the other cells are recorded. Same tokens as
``model.generate(do_sample=False)`` with left padding (tested).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class ForwardRows:
    """The tokens of one forward pass that are recorded.

    ``index``: positions in the flattened (batch * seq_len) input (the row order routers see), or None
    when every position is recorded. ``row``: batch row of each recorded token; ``pos``: its absolute
    position in its sequence.
    """

    phase: str  # "prefill" or "decode"
    index: torch.Tensor | None
    row: np.ndarray
    pos: np.ndarray

    def __len__(self) -> int:
        return len(self.row)


class ForwardObserver(Protocol):
    def before_forward(self, rows: ForwardRows) -> None: ...

    def after_forward(self, rows: ForwardRows) -> None: ...


@dataclass
class BatchResult:
    """Per batch row: the prompt length and the generated tokens (EOS included when it came)."""

    prompt_lengths: list[int]
    generated: list[list[int]] = field(default_factory=list)


def _cache_kwarg(model) -> str:
    """transformers 5 renames ``past_key_values`` to ``cache`` (old name deprecated until 5.40)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of shape (batch, longest prompt), prompts aligned to the right."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def _prefill_rows(mask_chunk: torch.Tensor, positions_chunk: torch.Tensor) -> ForwardRows:
    flat = mask_chunk.reshape(-1).bool()
    index = flat.nonzero().squeeze(1)
    row = (index // mask_chunk.shape[1]).cpu().numpy()
    pos = positions_chunk.reshape(-1)[index].cpu().numpy()
    return ForwardRows("prefill", None if len(index) == len(flat) else index, row, pos)


@torch.inference_mode()
def greedy_generate(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    pad_id: int = 0,
    prefill_chunk: int = 0,
    observer: ForwardObserver | None = None,
) -> BatchResult:
    """Greedy-decode one batch of token-id prompts with a KV cache.

    Prefill runs the left-padded prompts in chunks of ``prefill_chunk`` columns (0 = all at once);
    each decode step feeds the last token of every row. A row stops at an EOS token or after
    ``max_new_tokens`` tokens; finished rows keep being fed ``pad_id`` (as ``generate`` does) but are
    not reported to the observer. The last generated token is never fed back, so a sequence with G
    generated tokens has G - 1 decode forwards.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 0 or prefill_chunk < 0:
        raise ValueError("max_new_tokens and prefill_chunk must be >= 0")
    device = model.device
    ids, mask = left_pad(prompts, pad_id, device)
    batch, width = ids.shape
    # same position ids as generate(): count of real tokens so far, 0 on padding
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    cache_key, cache = _cache_kwarg(model), _new_cache(model)
    result = BatchResult([len(p) for p in prompts], [[] for _ in prompts])

    def forward(input_ids, attention_mask, position_ids, rows: ForwardRows):
        if observer is not None:
            observer.before_forward(rows)
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=True, logits_to_keep=1, **{cache_key: cache})
        if observer is not None:
            observer.after_forward(rows)
        return out.logits[:, -1, :]

    chunk = prefill_chunk or width
    for start in range(0, width, chunk):
        end = min(width, start + chunk)
        rows = _prefill_rows(mask[:, start:end], positions[:, start:end])
        logits = forward(ids[:, start:end], mask[:, :end], positions[:, start:end], rows)

    eos = torch.as_tensor(list(eos_ids), dtype=torch.long, device=device)
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    last_pos = positions[:, -1:]
    for step in range(max_new_tokens):
        next_tok = logits.argmax(dim=-1)
        active = unfinished.nonzero().squeeze(1).tolist()
        for i, tok in zip(active, next_tok[unfinished].tolist()):
            result.generated[i].append(tok)
        if eos.numel():
            unfinished &= ~torch.isin(next_tok, eos)
        if step == max_new_tokens - 1 or not bool(unfinished.any()):
            break
        fed = torch.where(unfinished, next_tok, torch.full_like(next_tok, pad_id))
        mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=1)
        last_pos = last_pos + 1
        index = unfinished.nonzero().squeeze(1)
        rows = ForwardRows("decode", None if len(index) == batch else index, index.cpu().numpy(),
                           last_pos.squeeze(1)[index].cpu().numpy())
        logits = forward(fed[:, None], mask, last_pos, rows)
    return result
