"""``gpt-oss-fingerprint``: per-generation JSON files of GPT-OSS-MoE-ExpertFingerprinting.

Each file is one greedy generation of openai/gpt-oss-20b at batch size 1. ``router_data`` holds one
entry per *decode* step: ``token_<pos>`` is the routing of the token at absolute position ``pos``
(the previously generated token) in the step that produces token ``pos + 1``. Positions start at the
prompt length (``len(full_text) - len(generated_only)``) and are contiguous; the last generated token
is never fed back, so there are ``len(generated_only) - 1`` entries. Prefill routing is not in the data.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from dali_sim.models.presets import get_model
from dali_sim.trace.importers import IMPORTERS, Importer, expand_inputs, input_named
from dali_sim.trace.importers.jsonio import load_json, require
from dali_sim.trace.provenance import default_provenance
from dali_sim.trace.schema import SequenceInfo

MODEL = "gpt-oss-20b"
SOURCE = "github.com/AmanPriyanshu/GPT-OSS-MoE-ExpertFingerprinting@72b368f60045221f21eeb65debb27d58de92e565"
WEIGHT_SUM_TOLERANCE = 0.01  # bf16 softmax over the top-4; the source README measures +/- 0.003


def _parse_file(path: Path, num_layers: int, top_k: int, num_experts: int):
    """-> (prompt_len, positions (T,), experts (T, L, k), weights (T, L, k), SequenceInfo fields)."""
    where = str(path)
    doc = load_json(path)
    full = require(doc, "full_text", list, where)
    gen = require(doc, "generated_only", list, where)
    entries = require(doc, "router_data", list, where)
    prompt_len = len(full) - len(gen)
    if prompt_len < 0:
        raise ValueError(f"{where}: generated_only is longer than full_text")
    if len(entries) != max(len(gen) - 1, 0):
        raise ValueError(
            f"{where}: router_data has {len(entries)} entries; expected len(generated_only) - 1 = {len(gen) - 1}"
        )
    t = len(entries)
    experts = np.empty((t, num_layers, top_k), dtype=np.int64)
    weights = np.empty((t, num_layers, top_k), dtype=np.float64)
    for i, entry in enumerate(entries):
        here = f"{where}: router_data[{i}]"
        if not isinstance(entry, dict) or len(entry) != 1:
            raise ValueError(f"{here}: expected one 'token_<pos>' key")
        (key, layers), = entry.items()
        expected_key = f"token_{prompt_len + i}"
        if key != expected_key:
            raise ValueError(f"{here}: key {key!r}, expected {expected_key!r} (positions must be contiguous "
                             f"from the prompt length {prompt_len})")
        if not isinstance(layers, dict) or len(layers) != num_layers:
            raise ValueError(f"{here} ({key}): expected {num_layers} layers, got "
                             f"{len(layers) if isinstance(layers, dict) else type(layers).__name__}")
        for layer in range(num_layers):
            lw = f"{here} ({key}) layer_{layer}"
            rec = layers.get(f"layer_{layer}")
            if rec is None:
                raise ValueError(f"{lw}: missing")
            ids = require(rec, "selected_experts", list, lw)
            probs = require(rec, "selected_probs", list, lw)
            if len(ids) != top_k or len(probs) != top_k:
                raise ValueError(f"{lw}: expected {top_k} experts and probs, got {len(ids)} and {len(probs)}")
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
                raise ValueError(f"{lw}: selected_experts must be integers, got {ids}")
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in probs):
                raise ValueError(f"{lw}: selected_probs must be numbers, got {probs}")
            if len(set(ids)) != len(ids):
                raise ValueError(f"{lw}: selected_experts has a duplicate id: {ids}")
            if not all(math.isfinite(x) and x >= 0 for x in probs):
                raise ValueError(f"{lw}: selected_probs must be finite and non-negative, got {probs}")
            experts[i, layer] = ids
            weights[i, layer] = probs
    if t:
        bad = (experts < 0) | (experts >= num_experts)
        if bad.any():
            i, layer, _ = np.argwhere(bad)[0]
            raise ValueError(f"{where}: router_data[{i}] layer_{layer}: expert id out of range 0..{num_experts - 1}: "
                             f"{experts[i, layer].tolist()}")
        sums = weights.sum(axis=2)
        off = ~(np.abs(sums - 1.0) <= WEIGHT_SUM_TOLERANCE)
        if off.any():
            i, layer = np.argwhere(off)[0]
            raise ValueError(f"{where}: router_data[{i}] layer_{layer}: selected_probs sum to {sums[i, layer]:.4f}, "
                             f"expected 1 +/- {WEIGHT_SUM_TOLERANCE}")
    info = {
        "name": path.stem,
        "prompt_tokens": prompt_len,
        "generated_tokens": len(gen),
        "attrs": {k: doc[k] for k in ("dataset", "category", "row_index", "finished_successfully", "has_repetition")
                  if k in doc},
    }
    return prompt_len, prompt_len + np.arange(t), experts, weights, info


def run(paths: Sequence[Path], out: Path, command: str) -> Path:
    from dali_sim.trace.writer import TraceWriter  # here: pyarrow is slow to import, `dali --help` lists formats

    files = expand_inputs(paths, "*.json")
    model = get_model(MODEL)
    layers = np.asarray(model.moe_layers)
    num_layers = len(layers)
    provenance = default_provenance(
        "import:gpt-oss-fingerprint", command, upstream=SOURCE,
        inputs=[f.name for f in files],
        capture="forward hooks on model.layers[i].mlp.router, greedy decoding, batch size 1, decode steps only",
    )
    with TraceWriter(
        out, model, provenance=provenance,
        weights_note="softmax over the top-4 router logits (bf16 values; each row sums to 1 +/- 0.003)",
    ) as writer:
        for seq_id, path in enumerate(files):
            _, positions, experts, weights, info = _parse_file(path, num_layers, model.top_k, model.num_experts)
            writer.add_sequence(SequenceInfo(seq_id=seq_id, **info))
            t = len(positions)
            if t == 0:
                continue
            # rows in (pos, layer) order
            with input_named(path):
                writer.write(
                    seq_id=seq_id,
                    phase="decode",
                    pos=np.repeat(positions, num_layers),
                    layer=np.tile(layers, t),
                    experts=experts.reshape(t * num_layers, -1),
                    weights=weights.reshape(t * num_layers, -1),
                )
    return out


IMPORTERS.add("gpt-oss-fingerprint", Importer(
    "gpt-oss-fingerprint",
    "GPT-OSS-MoE-ExpertFingerprinting JSON generations (gpt-oss-20b, decode only, top-4 ids + weights); "
    "files or folders of *.json",
    run,
))
