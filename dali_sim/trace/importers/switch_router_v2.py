"""``switch-router-v2``: stratamoe-lab's ``router-trace.v2.json`` (google/switch-base-8 encoder, top-1).

``selections[token][layer][rank]`` are argmax expert ids of the 6 sparse encoder blocks over the
concatenation of several prompts. The per-prompt token spans and the sparse block indices live in
``capture-metadata.json`` beside the trace (required: without it prompts cannot be told apart).
Each prompt span becomes one sequence, all positions ``prefill``. There are no gate weights.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import numpy as np

from dali_sim.models.presets import get_model
from dali_sim.trace.importers import IMPORTERS, Importer, expand_inputs, input_named
from dali_sim.trace.importers.jsonio import load_json, require
from dali_sim.trace.provenance import default_provenance
from dali_sim.trace.schema import SequenceInfo

MODEL = "switch-base-8"
METADATA_NAME = "capture-metadata.json"
SOURCE = "github.com/Labeeb2339/stratamoe-lab@08bfd806911082841cc531c4367f424595ddc228 evidence/switch-base-8/"


def _spans(trace_path: Path, tokens: int) -> tuple[list[dict], list[int]]:
    meta_path = trace_path.with_name(METADATA_NAME)
    if not meta_path.exists():
        raise ValueError(f"{trace_path}: needs {METADATA_NAME} beside it (prompt spans and sparse block indices)")
    meta = load_json(meta_path)
    where = str(meta_path)
    expected_sha = meta.get("trace_sha256")
    if expected_sha is not None:
        actual = hashlib.sha256(trace_path.read_bytes()).hexdigest()
        if actual != expected_sha:
            raise ValueError(f"{where}: trace_sha256 {expected_sha} does not match {trace_path.name} ({actual}); "
                             "the metadata belongs to another capture")
    spans = require(meta, "prompt_spans", list, where)
    blocks = require(meta, "sparse_encoder_block_indices", list, where)
    cursor = 0
    for i, span in enumerate(spans):
        here = f"{where}: prompt_spans[{i}]"
        start = require(span, "token_start", int, here)
        end = require(span, "token_end_exclusive", int, here)
        if start != cursor or end <= start:
            raise ValueError(f"{here}: span [{start}, {end}) does not continue the previous one at {cursor}")
        cursor = end
    if cursor != tokens:
        raise ValueError(f"{where}: prompt spans cover {cursor} tokens, the trace has {tokens}")
    return spans, blocks


def _convert_one(path: Path, model) -> tuple[np.ndarray, list[dict]]:
    """-> (selections (tokens, layers), spans)."""
    where = str(path)
    doc = load_json(path)
    if require(doc, "version", int, where) != 2:
        raise ValueError(f"{where}: version {doc['version']}, this importer reads version 2")
    tokens = require(doc, "tokens", int, where)
    layers = require(doc, "layers", int, where)
    top_k = require(doc, "topK", int, where)
    experts_per_layer = require(doc, "expertsPerLayer", int, where)
    if (layers, top_k, experts_per_layer) != (model.num_moe_layers, model.top_k, model.num_experts):
        raise ValueError(f"{where}: layers/topK/expertsPerLayer = {layers}/{top_k}/{experts_per_layer}, "
                         f"{model.name} has {model.num_moe_layers}/{model.top_k}/{model.num_experts}")
    sel = require(doc, "selections", list, where)
    if len(sel) != tokens:
        raise ValueError(f"{where}: {len(sel)} selections for {tokens} tokens")
    out = np.empty((tokens, layers), dtype=np.int64)
    for t, per_layer in enumerate(sel):
        if not isinstance(per_layer, list) or len(per_layer) != layers:
            raise ValueError(f"{where}: selections[{t}] must list {layers} layers")
        for layer, ranks in enumerate(per_layer):
            if not isinstance(ranks, list) or len(ranks) != top_k or not all(
                    isinstance(x, int) and not isinstance(x, bool) for x in ranks):
                raise ValueError(f"{where}: selections[{t}][{layer}] must be {top_k} integer id(s), got {ranks!r}")
            out[t, layer] = ranks[0]
    bad = (out < 0) | (out >= experts_per_layer)
    if bad.any():
        t, layer = np.argwhere(bad)[0]
        raise ValueError(f"{where}: selections[{t}][{layer}] = {out[t, layer]} is out of range 0..{experts_per_layer - 1}")
    spans, blocks = _spans(path, tokens)
    if tuple(blocks) != model.moe_layers:
        raise ValueError(f"{path.with_name(METADATA_NAME)}: sparse blocks {blocks} differ from {model.name}'s "
                         f"MoE layers {list(model.moe_layers)}")
    return out, spans


def run(paths: Sequence[Path], out: Path, command: str) -> Path:
    from dali_sim.trace.writer import TraceWriter  # here: pyarrow is slow to import, `dali --help` lists formats

    files = expand_inputs(paths, "router-trace.v2.json")
    model = get_model(MODEL)
    layers = np.asarray(model.moe_layers)
    provenance = default_provenance(
        "import:switch-router-v2", command, upstream=SOURCE, inputs=[f.name for f in files],
        capture="argmax of raw encoder router logits, google/switch-base-8 rev 92fe2d22, float32 CPU",
    )
    seq_id = 0
    with TraceWriter(out, model, provenance=provenance, weights=False) as writer:
        for path in files:
            selections, spans = _convert_one(path, model)
            for span in spans:
                start, end = span["token_start"], span["token_end_exclusive"]
                n = end - start
                writer.add_sequence(SequenceInfo(
                    seq_id=seq_id, name=str(span.get("id", f"{path.stem}-{seq_id}")), prompt_tokens=n,
                    generated_tokens=0, attrs={"source_file": path.name, "token_start": start},
                ))
                with input_named(path):
                    writer.write(
                        seq_id=seq_id, phase="prefill",
                        pos=np.repeat(np.arange(n), len(layers)),
                        layer=np.tile(layers, n),
                        experts=selections[start:end].reshape(-1, 1),
                    )
                seq_id += 1
    return out


IMPORTERS.add("switch-router-v2", Importer(
    "switch-router-v2",
    "stratamoe-lab router-trace.v2.json (google/switch-base-8 encoder, top-1, no weights); "
    f"needs {METADATA_NAME} beside it",
    run,
))
