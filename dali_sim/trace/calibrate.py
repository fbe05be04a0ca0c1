"""Expert popularity from real routing data, for the synthetic trace generator.

Statistics of a trace (counts, skew, reuse, lookahead recall) are in :mod:`dali_sim.trace.stats`.

Two sources give per-layer selection counts:

* a dali trace (``.parquet``): counts of every (token, MoE layer) row's top-k ids; its model must have
  the same MoE layers and number of experts as the model being generated;
* OLMoE-style aggregate counts (``routing_counts/<model>/expert_counts/<domain>.json`` of
  github.com/allenai/OLMoE): a JSON list with one ``{"expert id": count}`` object per measured layer, or
  a folder of such files (summed). A list as long as the model's MoE layers covers every layer; a list
  of 3 is the OLMoE script's layers **0, 7, 15** (MoE-layer ordinals); ``{"<ordinal>": {...}}`` or
  ``{"layer_<ordinal>": {...}}`` names the layers explicitly.

Counts become a *popularity* vector per layer (what the generator samples top-k from, see
``docs/synthetic-traces.md``): with inclusion frequency ``f_i = count_i / tokens`` (tokens = layer
total / top_k), ``p_i ∝ -log(1 - f_i)``, the inverse of the inclusion probability of successive
sampling without replacement (the exponential-race approximation ``f_i ≈ 1 - exp(-τ p_i)``), so that
the generated traces reproduce the measured per-expert frequencies, not a flattened version of them.
Layers that were not measured take the sorted profile of the nearest measured layer (the lower one on
a tie), laid onto a seeded random permutation of the expert ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from pyarrow import ArrowException

from dali_sim.models.spec import ModelSpec
from dali_sim.trace.importers.jsonio import load_json
from dali_sim.files import check_input
from dali_sim.trace.checksum import ContentHasher, verify_digests
from dali_sim.trace.reader import fixed_list_to_numpy, read_meta_and_checksum
from dali_sim.trace.schema import STATUS_PARTIAL, TraceError
from dali_sim.trace.provenance import file_sha256

#: the layers of a 3-entry counts list, as written by OLMoE's scripts/run_routing_analysis.py
OLMOE_COUNT_LAYERS = (0, 7, 15)
#: popularity floor relative to the most popular expert (an expert never seen stays possible, barely)
POPULARITY_FLOOR = 1e-9
_MAX_FREQUENCY = 1.0 - 1e-6


@dataclass
class LayerCounts:
    """Selection counts of the measured MoE layers (ordinals) and where they came from."""

    counts: dict[int, np.ndarray]  # MoE-layer ordinal -> (num_experts,) counts of (token, rank) selections
    num_experts: int
    sources: list[dict[str, Any]] = field(default_factory=list)  # {"path", "sha256"} per file read
    kind: str = ""  # "trace" or "counts-json"


@dataclass
class Calibration:
    """Per-layer popularity (rows sum to 1) plus what it was made from, for provenance."""

    popularity: np.ndarray  # (num_moe_layers, num_experts)
    measured_layers: tuple[int, ...]  # MoE-layer ordinals taken from data; the others were filled
    filled_from: dict[int, int]  # unmeasured ordinal -> measured ordinal whose profile it uses
    sources: list[dict[str, Any]]
    kind: str
    spread: float = 0.0

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "sources": self.sources,
            "measured_layers": list(self.measured_layers),
            "filled_layers": {str(k): v for k, v in sorted(self.filled_from.items())},
            "inversion": "p ∝ g^-1(f), f = count / tokens, g(x) = E_z[1 - exp(-x e^(spread z))]",
            "spread": self.spread,
        }


# ---- reading counts ----------------------------------------------------------------------------------
def counts_from_trace(path: str | Path, model: ModelSpec) -> LayerCounts:
    """Per-layer selection counts of a dali trace; its layers and experts must match ``model``."""
    path = Path(path)
    meta, record = read_meta_and_checksum(path)
    where = str(path)
    if meta.status == STATUS_PARTIAL:
        raise TraceError(f"{where}: partial trace; calibrate from a complete one")
    src = meta.model
    if src.num_experts != model.num_experts or tuple(src.moe_layers) != tuple(model.moe_layers):
        raise ValueError(
            f"{where}: trace of model {src.name!r} ({src.num_experts} experts, MoE layers "
            f"{_short(src.moe_layers)}) does not match {model.name!r} ({model.num_experts} experts, MoE layers "
            f"{_short(model.moe_layers)}); calibrate from a trace of the same model shape"
        )
    layers = np.asarray(model.moe_layers)
    counts = np.zeros((len(layers), model.num_experts), dtype=np.int64)
    hasher = ContentHasher(("layer", "experts"))
    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True)
        for batch in pf.iter_batches(columns=["layer", "experts"], batch_size=1 << 18):
            layer = batch.column(0).to_numpy()
            ex = fixed_list_to_numpy(batch.column(1), src.top_k, np.int16)
            hasher.update("layer", layer)
            hasher.update("experts", ex)
            bad = ~np.isin(layer, layers) | ((ex < 0) | (ex >= model.num_experts)).any(axis=1)
            if bad.any():
                raise TraceError(f"{where}: a row has a layer or expert id out of range; check it with "
                                 f"`dali trace validate {path}`")
            lo = np.searchsorted(layers, layer)
            np.add.at(counts, (np.repeat(lo, src.top_k), ex.reshape(-1).astype(np.int64)), 1)
    except (OSError, ArrowException) as exc:
        raise TraceError(f"{where}: not a readable Parquet file (truncated or corrupt): {exc}") from None
    if record is not None:
        verify_digests(record, hasher.digests(), where)
    if counts.sum() == 0:
        raise ValueError(f"{where}: trace has no rows to calibrate from")
    return LayerCounts({i: counts[i] for i in range(len(layers))}, model.num_experts,
                       [{"path": str(path), "sha256": file_sha256(path)}], "trace")


def _short(layers) -> str:
    layers = list(layers)
    return str(layers) if len(layers) <= 6 else f"[{layers[0]}, {layers[1]}, ..., {layers[-1]}] ({len(layers)})"


def _parse_layer_dict(obj: Any, where: str) -> dict[int, int]:
    if not isinstance(obj, dict) or not obj:
        raise ValueError(f"{where}: expected a non-empty object mapping expert id -> count")
    out: dict[int, int] = {}
    for key, value in obj.items():
        if isinstance(key, str) and "," in key:
            raise ValueError(f"{where}: key {key!r} is a layer pair; this looks like an expert_counts_crosslayer "
                             "file, not per-layer expert counts")
        try:
            eid = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: key {key!r} is not an expert id") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
            raise ValueError(f"{where}: count of expert {key} must be a non-negative integer, got {value!r}")
        if eid < 0:
            raise ValueError(f"{where}: expert id {eid} is negative")
        out[eid] = int(value)
    return out


def counts_from_json(path: str | Path, model: ModelSpec) -> LayerCounts:
    """Counts from one OLMoE-style JSON file (see the module docstring for the accepted layouts)."""
    path = Path(path)
    where = str(path)
    doc = load_json(path)
    num_layers = model.num_moe_layers
    if isinstance(doc, list):
        if len(doc) == num_layers:
            ordinals = list(range(num_layers))
        elif len(doc) == len(OLMOE_COUNT_LAYERS):
            ordinals = list(OLMOE_COUNT_LAYERS)
        else:
            raise ValueError(
                f"{where}: a list of {len(doc)} layer counts; expected {num_layers} (one per MoE layer of "
                f"{model.name}) or 3 (OLMoE's layers {list(OLMOE_COUNT_LAYERS)}); name the layers explicitly "
                "with an object {\"<MoE layer ordinal>\": {\"<expert>\": count, ...}}"
            )
        items = list(zip(ordinals, doc))
    elif isinstance(doc, dict):
        items = []
        for key, value in doc.items():
            text = key[len("layer_"):] if isinstance(key, str) and key.startswith("layer_") else key
            try:
                items.append((int(text), value))
            except ValueError:
                raise ValueError(f"{where}: key {key!r} is not a MoE-layer ordinal ('<i>' or 'layer_<i>'); "
                                 "expected per-layer expert counts") from None
    else:
        raise ValueError(f"{where}: expected a JSON list or object of per-layer expert counts, "
                         f"got {type(doc).__name__}")
    parsed: dict[int, dict[int, int]] = {}
    for ordinal, obj in items:
        if not 0 <= ordinal < num_layers:
            raise ValueError(f"{where}: counts for MoE layer {ordinal}, but {model.name} has MoE layers "
                             f"0..{num_layers - 1}")
        parsed[ordinal] = _parse_layer_dict(obj, f"{where}: layer {ordinal}")
    file_experts = 1 + max(max(d) for d in parsed.values())
    if file_experts != model.num_experts:
        raise ValueError(
            f"{where}: counts name {file_experts} experts (ids 0..{file_experts - 1}) but {model.name} has "
            f"{model.num_experts}; these counts are from another model"
        )
    counts = {}
    for ordinal, d in parsed.items():
        c = np.zeros(model.num_experts, dtype=np.int64)
        c[list(d)] = list(d.values())
        if c.sum() == 0:
            raise ValueError(f"{where}: layer {ordinal} has no selections")
        counts[ordinal] = c
    return LayerCounts(counts, model.num_experts, [{"path": str(path), "sha256": file_sha256(path)}], "counts-json")


def load_counts(path: str | Path, model: ModelSpec) -> LayerCounts:
    """Counts from a dali trace (``.parquet``), a counts JSON file, or a folder of counts JSON files (summed)."""
    path = check_input(path, "--popularity-from input", folder_ok=True)
    if path.is_dir():
        files = sorted(check_input(p, "counts file") for p in path.glob("*.json"))
        if not files:
            raise ValueError(f"{path}: folder has no *.json counts files")
        parts = [counts_from_json(f, model) for f in files]
        layers = set(parts[0].counts)
        for f, part in zip(files, parts):
            if set(part.counts) != layers:
                raise ValueError(f"{f}: measures MoE layers {sorted(part.counts)} but {files[0].name} measures "
                                 f"{sorted(layers)}; a folder's files must measure the same layers")
        total = {l: sum(p.counts[l] for p in parts) for l in sorted(layers)}
        return LayerCounts(total, model.num_experts, [s for p in parts for s in p.sources], "counts-json")
    if path.suffix == ".parquet":
        return counts_from_trace(path, model)
    if path.suffix == ".json":
        return counts_from_json(path, model)
    raise ValueError(f"{path}: not a dali trace (.parquet), a counts file (.json) or a folder of counts files")


# ---- counts -> popularity ----------------------------------------------------------------------------
def inclusion_curve(spread: float, grid: np.ndarray) -> np.ndarray:
    """g(x) = E_z[1 - exp(-x e^{spread z})], z ~ N(0, 1): the exponential-race inclusion probability of an
    expert with (threshold-scaled) popularity x whose log popularity carries N(0, spread^2) noise."""
    if spread == 0:
        return -np.expm1(-grid)
    nodes, w = np.polynomial.hermite_e.hermegauss(61)
    w = w / w.sum()
    return (-np.expm1(-grid[:, None] * np.exp(spread * nodes)[None, :]) * w).sum(axis=1)


def popularity_from_frequencies(freq: np.ndarray, spread: float = 0.0) -> np.ndarray:
    """Inclusion frequencies (sum = top_k) -> sampling popularity (sum = 1).

    Without per-token noise (``spread`` = 0) ``p ∝ -log(1 - f)``; with the generator's log-normal topic
    and drift factors (total sigma ``spread``) ``p ∝ g^-1(f)`` for the averaged curve ``g`` of
    :func:`inclusion_curve`, so pooled frequencies still come out as measured.
    """
    f = np.clip(np.asarray(freq, dtype=np.float64), 0.0, _MAX_FREQUENCY)
    if spread == 0:
        p = -np.log1p(-f)
    else:
        grid = np.logspace(-12, 12, 2401)
        g = inclusion_curve(spread, grid)
        p = np.exp(np.interp(f, g, np.log(grid)))  # g is increasing; f beyond the grid clamps to its ends
        p[f == 0] = 0.0
    p = np.maximum(p, p.max() * POPULARITY_FLOOR)
    return p / p.sum()


def calibrate(counts: LayerCounts, model: ModelSpec, rng: np.random.Generator, spread: float = 0.0) -> Calibration:
    """Popularity for every MoE layer of ``model`` from the measured layers in ``counts``; ``spread`` is the
    total sigma of the generator's per-token log-popularity noise (hypot(topic_spread, drift_spread))."""
    num_layers, e, k = model.num_moe_layers, model.num_experts, model.top_k
    measured = sorted(counts.counts)
    pop = np.empty((num_layers, e))
    for ordinal in measured:
        c = counts.counts[ordinal].astype(np.float64)
        tokens = c.sum() / k
        pop[ordinal] = popularity_from_frequencies(c / tokens, spread)
    filled: dict[int, int] = {}
    m = np.asarray(measured)
    for ordinal in range(num_layers):  # in order, so the permutations draw from rng deterministically
        if ordinal in counts.counts:
            continue
        src = int(m[np.argmin(np.abs(m - ordinal))])  # argmin takes the first (lower) on a tie
        profile = np.sort(pop[src])[::-1]
        pop[ordinal, rng.permutation(e)] = profile
        filled[ordinal] = src
    return Calibration(pop, tuple(measured), filled, counts.sources, counts.kind, spread)
