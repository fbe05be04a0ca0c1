"""Prompt and calibration-text files.

* ``.txt``: one prompt per non-empty line;
* ``.jsonl``: one JSON value per line, ``.json``: a list of them. A value is a string (the text) or an
  object with ``text`` (or ``prompt``) or ``input_ids`` (token ids, for models without a tokenizer),
  and optionally ``name``; its other keys with string, number or boolean values (``domain``, ...) are
  kept as attributes of the sequence in the trace's metadata.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from dali_sim.files import check_input


@dataclass(frozen=True)
class Prompt:
    index: int  # 0-based position in the file (seq_id of its sequence)
    name: str
    text: str | None = None
    input_ids: tuple[int, ...] | None = None
    attrs: dict[str, Any] = field(default_factory=dict)  # other keys of a JSON prompt (domain, source, ...)


_KEYS = ("name", "id", "text", "prompt", "input_ids")


def _parse(value: Any, index: int, where: str) -> Prompt:
    name = f"prompt-{index}"
    if isinstance(value, str):
        return Prompt(index, name, text=value)
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a string or an object with 'text' or 'input_ids', "
                         f"got {type(value).__name__}")
    name = str(value.get("name", value.get("id", name)))
    text = value.get("text", value.get("prompt"))
    ids = value.get("input_ids")
    if (text is None) == (ids is None):
        raise ValueError(f"{where}: give exactly one of 'text' (or 'prompt') and 'input_ids'")
    attrs = {k: v for k, v in value.items() if k not in _KEYS and isinstance(v, (str, int, float, bool))}
    if text is not None:
        if not isinstance(text, str):
            raise ValueError(f"{where}: 'text' must be a string")
        return Prompt(index, name, text=text, attrs=attrs)
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"{where}: 'input_ids' must be a list of non-negative integers")
    return Prompt(index, name, input_ids=tuple(ids), attrs=attrs)


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts of a .txt / .jsonl / .json file; errors name the file and line (or item)."""
    path = check_input(path, "prompt file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    suffix = path.suffix.lower()
    values: list[tuple[Any, str]] = []
    if suffix == ".txt":
        values = [(line, f"{path}:{i}") for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    elif suffix == ".jsonl":
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                values.append((json.loads(line), f"{path}:{i}"))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i}: not valid JSON ({exc.msg})") from None
    elif suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of prompts")
        values = [(v, f"{path}: item {i}") for i, v in enumerate(data)]
    else:
        raise ValueError(f"{path}: unknown prompt file type {suffix!r}; use .txt, .jsonl or .json")
    prompts = [_parse(v, i, where) for i, (v, where) in enumerate(values)]
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def tokenize(prompts: Sequence[Prompt], tokenizer, where: str, max_length: int | None = None) -> list[list[int]]:
    """Token ids of each prompt; ``max_length`` truncates (for calibration texts)."""
    out = []
    for p in prompts:
        if p.input_ids is not None:
            ids = list(p.input_ids)
        else:
            if tokenizer is None:
                raise ValueError(f"{where}: prompt {p.index} ({p.name}) is text but the model has no tokenizer; "
                                 "give 'input_ids' instead")
            ids = list(tokenizer(p.text)["input_ids"])
        if max_length:
            ids = ids[:max_length]
        if not ids:
            raise ValueError(f"{where}: prompt {p.index} ({p.name}) has no tokens")
        out.append(ids)
    return out


def check_fits(prompts: Sequence[Prompt], token_ids: Sequence[Sequence[int]], config, max_new_tokens: int,
               where: str) -> None:
    """Every prompt's ids lie in the model's vocabulary and the prompt plus ``max_new_tokens`` fits its
    positions (``max_position_embeddings``; beyond it transformers only warns and the routing is garbage)."""
    vocab = int(config.vocab_size)
    limit = getattr(config, "max_position_embeddings", None)
    for p, ids in zip(prompts, token_ids):
        if max(ids) >= vocab:
            raise ValueError(f"{where}: prompt {p.index} ({p.name}) has token id {max(ids)} >= vocab_size {vocab}")
        if limit is not None and len(ids) + max_new_tokens > int(limit):
            raise ValueError(f"{where}: prompt {p.index} ({p.name}) has {len(ids)} tokens; with --max-new-tokens "
                             f"{max_new_tokens} that exceeds the model's {int(limit)} positions "
                             "(max_position_embeddings): shorten it or generate fewer tokens")
