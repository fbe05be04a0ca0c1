"""Synthetic routing traces: seeded, calibratable, with lookahead predictions of chosen accuracy.

The model (every parameter and its measured effect in ``docs/synthetic-traces.md``):

* every MoE layer ``l`` has a popularity vector ``p_l``: a log-normal-quantile (or Zipf) profile of
  inequality ``skew`` over a seeded random permutation of the expert ids, or one calibrated from real
  counts (:mod:`dali_sim.trace.calibrate`);
* each sequence multiplies it by ``exp(topic_spread * z)`` (z per sequence, layer and expert, coherent
  along successor chains) and each token by ``exp(drift_spread * a)`` (a an AR(1) process over positions
  with half-life ``drift_halflife``): sequences have favourite experts, and favourites drift;
* the top-k of token ``t`` at layer ``l`` is drawn without replacement from that popularity (exponential
  race = Gumbel-top-k), after forcing in, by tier: (1) each expert of token ``t-1`` at layer ``l`` (same
  sequence) independently with probability ``reuse`` (``prefill_reuse`` for prompt tokens), then (2) the
  *successor* of each of token ``t``'s experts at layer ``l-1`` with probability ``crosslayer``. The
  successor map of a layer pair is the popularity-rank-aligned bijection, so it keeps each layer's
  popularity; forced experts keep the rank of the expert that forced them;
* gate weights: a sorted Dirichlet(``weight_alpha``) draw over the k ranks, times a Beta-distributed
  total with mean ``weight_total`` when the model does not renormalise its top-k (``norm_topk_prob``);
* lookahead column ``NAME`` with accuracy ``a``: logits for the target layer whose top-k holds each true
  target expert with probability ``a`` (else a distinct decoy drawn by popularity).

Routing, weights, lengths, popularity factors and each lookahead column draw from separate seeded
streams: adding a lookahead column or changing the weight model does not change the routing.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from dali_sim.files import check_output, files_of
from dali_sim.models.presets import get_model
from dali_sim.models.spec import ModelSpec
from dali_sim.registry import UnknownNameError
from dali_sim.trace.provenance import default_provenance
from dali_sim.trace.schema import PredictorInfo, SequenceInfo

if TYPE_CHECKING:
    from dali_sim.trace.calibrate import Calibration

# Defaults, tuned so a gpt-oss-20b trace matches the real GPT-OSS-20B decode statistics (see the doc).
DEFAULT_SKEW = 1.4
DEFAULT_TOPIC_SPREAD = 2.0
DEFAULT_DRIFT_SPREAD = 1.5
DEFAULT_DRIFT_HALFLIFE = 16.0
DEFAULT_REUSE = 0.08
DEFAULT_CROSSLAYER = 0.7
DEFAULT_SHAPE = "lognormal"
POPULARITY_SHAPES = ("lognormal", "zipf")
DEFAULT_WEIGHT_ALPHA = 6.0
DEFAULT_WEIGHT_TOTAL = 0.6
WEIGHT_TOTAL_CONCENTRATION = 20.0  # Beta(m c, (1-m) c) total gate mass for models without renormalisation

MAX_SEQUENCES = 1 << 20  # every sequence is described in the footer's metadata
MAX_POSITIONS = (1 << 31) - 1  # positions are int32
#: the least a row takes on disk (measured: 6 B for switch-base-8, top-1; 12 B for mixtral-8x7b, top-2), for the
#: free-space check before writing; an estimate that errs low, never refusing what would fit
MIN_BYTES_PER_ROW = 4

ROWS_PER_CHUNK = 1 << 18  # routing state kept in memory: (sequences x positions x layers) cells
MAX_BATCH = 256  # sequences generated side by side (bounds the per-sequence popularity arrays)
ROWS_PER_WRITE = 1 << 15  # rows whose weights / lookahead logits are built and written at once

_STREAM_LENGTHS, _STREAM_POPULARITY, _STREAM_ROUTING, _STREAM_WEIGHTS, _STREAM_LOOKAHEAD, _STREAM_TOPIC = range(6)


@dataclass(frozen=True)
class LookaheadSpec:
    """A synthetic lookahead column: top-k recall ``accuracy`` for the layer ``target_offset`` MoE layers on."""

    name: str
    accuracy: float
    target_offset: int = 1

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise ValueError(f"lookahead name {self.name!r} must be non-empty letters, digits, '-', '_' or '.'")
        if isinstance(self.accuracy, bool) or not (0.0 <= float(self.accuracy) <= 1.0):
            raise ValueError(f"lookahead {self.name!r}: accuracy must lie in [0, 1], got {self.accuracy!r}")
        if isinstance(self.target_offset, bool) or int(self.target_offset) != self.target_offset \
                or self.target_offset < 1:
            raise ValueError(f"lookahead {self.name!r}: target offset must be an integer >= 1, "
                             f"got {self.target_offset!r}")
        object.__setattr__(self, "accuracy", float(self.accuracy))
        object.__setattr__(self, "target_offset", int(self.target_offset))

    @classmethod
    def parse(cls, text: str) -> "LookaheadSpec":
        """``NAME=ACCURACY`` or ``NAME=ACCURACY@OFFSET`` (e.g. ``oracle80=0.8``, ``far=0.6@2``)."""
        name, sep, rest = text.partition("=")
        if not sep:
            raise ValueError(f"--lookahead {text!r}: expected NAME=ACCURACY or NAME=ACCURACY@OFFSET")
        acc_text, at, off_text = rest.partition("@")
        try:
            acc = float(acc_text)
        except ValueError:
            raise ValueError(f"--lookahead {text!r}: accuracy {acc_text!r} is not a number") from None
        try:
            off = int(off_text) if at else 1
        except ValueError:
            raise ValueError(f"--lookahead {text!r}: offset {off_text!r} is not an integer") from None
        return cls(name.strip(), acc, off)


def _probability(name: str, value: Any, length: int, what: str) -> tuple[float, ...]:
    """A probability or one per layer -> tuple of ``length`` floats in [0, 1]."""
    if isinstance(value, str) or np.ndim(value) not in (0, 1):
        raise ValueError(f"{name} must be a number in [0, 1] or one per {what}, got {value!r}")
    values = [value] if np.ndim(value) == 0 else list(value)
    try:
        floats = [float(v) for v in values if not isinstance(v, bool)]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in [0, 1] or one per {what}, got {value!r}") from None
    if len(floats) != len(values):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if len(floats) == 1:
        floats = floats * length
    if len(floats) != length:
        raise ValueError(f"{name} has {len(values)} values; give one, or one per {what} ({length})")
    bad = [v for v in floats if not (0.0 <= v <= 1.0)]  # also catches NaN
    if bad:
        raise ValueError(f"{name} must lie in [0, 1], got {bad[0]!r}")
    return tuple(floats)


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _fraction(name: str, value: Any, low: float, high: float, high_open: bool = False) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not (low <= v <= high) or (high_open and v == high):
        interval = f"[{low}, {high})" if high_open else f"[{low}, {high}]"
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")
    return v


@dataclass(frozen=True)
class SynthConfig:
    """Everything that determines a synthetic trace (stored in its provenance under ``synth``).

    Probabilities ``reuse``, ``prefill_reuse`` take one value or one per MoE layer; ``crosslayer`` one
    value or one per adjacent MoE-layer pair (num_moe_layers - 1).
    """

    model: str
    sequences: int = 1
    prompt_len: int = 128
    gen_len: int = 128
    seed: int = 0
    precision: str | None = None
    prompt_len_jitter: float = 0.0  # each sequence's length uniform in round(L (1 -+ jitter)), >= 1 if L >= 1
    gen_len_jitter: float = 0.0
    skew: float = DEFAULT_SKEW  # how unequal expert popularity is (0 = uniform); see popularity_shape
    popularity_shape: str = DEFAULT_SHAPE  # "lognormal": p = exp(-skew * normal quantile); "zipf": rank^-skew
    topic_spread: float = DEFAULT_TOPIC_SPREAD  # sigma of a per-sequence log-normal factor on popularity
    drift_spread: float = DEFAULT_DRIFT_SPREAD  # sigma of a drifting (AR(1) over positions) log factor
    drift_halflife: float = DEFAULT_DRIFT_HALFLIFE  # positions after which the drifting factor is half forgotten
    reuse: float | tuple[float, ...] = DEFAULT_REUSE  # decode tokens: keep each previous-token expert
    prefill_reuse: float | tuple[float, ...] | None = None  # prompt tokens (None = same as reuse)
    crosslayer: float | tuple[float, ...] = DEFAULT_CROSSLAYER  # force the successor of each previous-layer expert
    weight_alpha: float = DEFAULT_WEIGHT_ALPHA  # Dirichlet concentration of the top-k gate weights
    weight_total: float = DEFAULT_WEIGHT_TOTAL  # mean top-k weight mass if the model does not renormalise
    popularity_from: str | None = None  # dali trace, counts JSON or folder of them; replaces skew
    lookahead: tuple[LookaheadSpec, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        spec = self.spec()  # validates model and precision
        num_layers = spec.num_moe_layers
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("sequences", _int("sequences", self.sequences, 1))
        if self.sequences > MAX_SEQUENCES:
            raise ValueError(f"sequences = {self.sequences:,} exceeds {MAX_SEQUENCES:,} (each one is described in the "
                             "trace's metadata); write several traces")
        set_("prompt_len", _int("prompt_len", self.prompt_len, 0))
        set_("gen_len", _int("gen_len", self.gen_len, 0))
        if self.prompt_len + self.gen_len == 0:
            raise ValueError("prompt_len + gen_len must be at least 1 (every sequence needs a token)")
        set_("seed", _int("seed", self.seed, 0))
        set_("prompt_len_jitter", _fraction("prompt_len_jitter", self.prompt_len_jitter, 0.0, 1.0))
        set_("gen_len_jitter", _fraction("gen_len_jitter", self.gen_len_jitter, 0.0, 1.0))
        longest = (round(self.prompt_len * (1 + self.prompt_len_jitter))
                   + round(self.gen_len * (1 + self.gen_len_jitter)))
        if longest > MAX_POSITIONS:
            raise ValueError(f"a sequence of up to {longest:,} tokens exceeds {MAX_POSITIONS:,} positions (int32)")
        skew = _fraction("skew", self.skew, 0.0, math.inf)
        if not math.isfinite(skew) or skew > 10:
            raise ValueError(f"skew must lie in [0, 10], got {self.skew!r}")
        set_("skew", skew)
        if self.popularity_shape not in POPULARITY_SHAPES:
            raise ValueError(f"popularity_shape must be one of {list(POPULARITY_SHAPES)}, got {self.popularity_shape!r}")
        spread = _fraction("topic_spread", self.topic_spread, 0.0, 5.0)
        set_("topic_spread", spread)
        set_("drift_spread", _fraction("drift_spread", self.drift_spread, 0.0, 5.0))
        halflife = _fraction("drift_halflife", self.drift_halflife, 0.0, 1e9)
        if halflife <= 0:
            raise ValueError(f"drift_halflife must be > 0 positions, got {self.drift_halflife!r}")
        set_("drift_halflife", halflife)
        reuse = _probability("reuse", self.reuse, num_layers, "MoE layer")
        set_("reuse", reuse[0] if len(set(reuse)) == 1 else reuse)
        if self.prefill_reuse is not None:
            pre = _probability("prefill_reuse", self.prefill_reuse, num_layers, "MoE layer")
            set_("prefill_reuse", pre[0] if len(set(pre)) == 1 else pre)
        cross = _probability("crosslayer", self.crosslayer, max(num_layers - 1, 1), "adjacent MoE-layer pair")
        set_("crosslayer", cross[0] if len(set(cross)) == 1 else cross)
        alpha = _fraction("weight_alpha", self.weight_alpha, 0.0, 1e6)
        if alpha <= 0:
            raise ValueError(f"weight_alpha must be > 0, got {self.weight_alpha!r}")
        set_("weight_alpha", alpha)
        total = _fraction("weight_total", self.weight_total, 0.0, 1.0)
        if not 0.0 < total < 1.0:
            raise ValueError(f"weight_total must lie in (0, 1), got {self.weight_total!r}")
        set_("weight_total", total)
        if self.popularity_from is not None:
            set_("popularity_from", str(self.popularity_from))
        looks = tuple(x if isinstance(x, LookaheadSpec) else LookaheadSpec.parse(str(x)) for x in self.lookahead)
        names = [x.name for x in looks]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"lookahead name(s) {dup} given more than once")
        for x in looks:
            if x.target_offset >= num_layers:
                raise ValueError(f"lookahead {x.name!r}: target offset {x.target_offset} leaves no target layer "
                                 f"({spec.name} has {num_layers} MoE layers)")
        set_("lookahead", looks)

    # ---- derived ----------------------------------------------------------------------------------
    def spec(self) -> ModelSpec:
        try:
            return get_model(self.model, self.precision)
        except UnknownNameError as exc:
            raise ValueError(str(exc)) from None

    def reuse_per_layer(self, prefill: bool = False) -> np.ndarray:
        value = self.prefill_reuse if (prefill and self.prefill_reuse is not None) else self.reuse
        return np.asarray(_probability("reuse", value, self.spec().num_moe_layers, "MoE layer"))

    def crosslayer_per_layer(self) -> np.ndarray:
        """Probability per MoE layer ordinal (entry 0 = 0: the first MoE layer has no previous layer)."""
        n = self.spec().num_moe_layers
        pairs = _probability("crosslayer", self.crosslayer, max(n - 1, 1), "adjacent MoE-layer pair")
        return np.asarray((0.0,) + pairs[: n - 1])

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["lookahead"] = [dataclasses.asdict(x) for x in self.lookahead]
        for key in ("reuse", "prefill_reuse", "crosslayer"):
            if isinstance(d[key], tuple):
                d[key] = list(d[key])
        return d


# ---- the generator -----------------------------------------------------------------------------------
def _stream(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *key]))


def sequence_lengths(config: SynthConfig) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, generated lengths) per sequence."""
    rng = _stream(config.seed, _STREAM_LENGTHS)

    def draw(base: int, jitter: float) -> np.ndarray:
        if base == 0 or jitter == 0:
            return np.full(config.sequences, base, dtype=np.int64)
        lo, hi = max(1, round(base * (1 - jitter))), max(1, round(base * (1 + jitter)))
        return rng.integers(lo, hi + 1, size=config.sequences)

    return draw(config.prompt_len, config.prompt_len_jitter), draw(config.gen_len, config.gen_len_jitter)


def shaped_popularity(num_layers: int, num_experts: int, skew: float, shape: str,
                      rng: np.random.Generator) -> np.ndarray:
    """(layers, experts) popularity, rows sum to 1, the profile laid on a seeded random permutation per layer.

    ``zipf``: rank r (1-based) gets r^-skew. ``lognormal``: rank r gets exp(-skew * Phi^-1((r - 0.5) / E)),
    the quantiles of a log-normal with sigma ``skew`` (a thinner head and a longer thin tail than Zipf).
    """
    ranks = np.arange(1, num_experts + 1, dtype=np.float64)
    if shape == "zipf":
        base = ranks ** -skew
    elif shape == "lognormal":
        from scipy.special import ndtri

        base = np.exp(-skew * ndtri((ranks - 0.5) / num_experts))
    else:
        raise ValueError(f"popularity_shape must be one of {list(POPULARITY_SHAPES)}, got {shape!r}")
    base /= base.sum()
    pop = np.empty((num_layers, num_experts))
    for l in range(num_layers):
        pop[l, rng.permutation(num_experts)] = base
    return pop


def successor_maps(popularity: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(layers, experts): ``succ[l, a]`` = expert of layer l that follows expert a of layer l-1 (row 0 unused).

    Rank-aligned: the i-th most popular expert of layer l-1 maps to the i-th most popular of layer l; ties
    (e.g. uniform popularity) are broken by a seeded random order, so the map is never the identity by accident.
    """
    num_layers, e = popularity.shape
    tiebreak = rng.random((num_layers, e))
    order = np.stack([np.lexsort((tiebreak[l], -popularity[l])) for l in range(num_layers)])
    succ = np.zeros((num_layers, e), dtype=np.int64)
    for l in range(1, num_layers):
        succ[l, order[l - 1]] = order[l]
    succ[0] = np.arange(e)
    return succ


class _Routing:
    """Draws expert ids cell by cell along anti-diagonals (t + l = const) of the (position, layer) grid:
    cell (t, l) needs (t-1, l) and (t, l-1), both on the previous diagonal, so one NumPy step handles a
    whole diagonal of every sequence in the batch."""

    def __init__(self, config: SynthConfig, spec: ModelSpec, popularity: np.ndarray, succ: np.ndarray):
        self.k, self.e, self.num_layers = spec.top_k, spec.num_experts, spec.num_moe_layers
        self.popularity = popularity  # (L, E)
        self.spread = config.topic_spread
        self.drift = config.drift_spread
        self.rho = 0.5 ** (1.0 / config.drift_halflife)
        self.topic_rng = _stream(config.seed, _STREAM_TOPIC)
        self.inv_pop = 1.0 / popularity[None]  # (B, L, E) of the current batch, static part
        self.state = np.zeros((1,) + popularity.shape)  # (B, L, E) drifting N(0, 1) log factors
        self.succ = succ
        self.reuse_decode = config.reuse_per_layer(prefill=False)
        self.reuse_prefill = config.reuse_per_layer(prefill=True)
        self.cross = config.crosslayer_per_layer()
        self.rng = _stream(config.seed, _STREAM_ROUTING)
        self.ranks = np.arange(self.k, dtype=np.float64)

    def start_batch(self, nb: int) -> None:
        """Per-sequence popularity: the layer's popularity times exp(topic_spread * N(0, 1)) per expert."""
        shape = (nb,) + self.popularity.shape
        if self.spread == 0:
            self.inv_pop = np.broadcast_to(1.0 / self.popularity[None], shape)
        else:  # only ratios within a row matter to the race, so no renormalisation
            z = self.topic_rng.standard_normal(shape)
            # coherent along successor chains: an expert's factor is correlated (by the pair's
            # crosslayer probability) with that of its predecessor at the previous layer
            for l in range(1, self.num_layers):
                c = self.cross[l]
                z[:, l, self.succ[l]] = c * z[:, l - 1, :] + math.sqrt(1.0 - c * c) * z[:, l, self.succ[l]]
            self.inv_pop = np.exp(-self.spread * z) / self.popularity[None]
        if self.drift > 0:
            self.state = self.topic_rng.standard_normal(shape)

    def chunk(self, carry: np.ndarray, start: int, length: int, prompt: np.ndarray) -> np.ndarray:
        """Experts of positions start..start+length-1 of a batch: (B, length, L, k); ``carry`` = (B, L, k)
        experts of position start-1 (-1 where there is none)."""
        nb, num_layers, k, e = carry.shape[0], self.num_layers, self.k, self.e
        buf = np.empty((nb, length + 1, num_layers, k), dtype=np.int64)
        buf[:, 0] = carry
        rng = self.rng
        for d in range(length + num_layers - 1):
            l_lo, l_hi = max(0, d - (length - 1)), min(num_layers - 1, d)
            ls = np.arange(l_lo, l_hi + 1)
            ts = d - ls  # chunk-local positions; buffer index ts + 1
            nl = ls.size
            m = nb * nl
            # exponential race: the k smallest Exp/p win, i.e. sampling without replacement by p.
            # Keys: free experts 2 + u, successors 1 + (r + u) / k, reused experts (r + u) / k, where
            # u = K / (1 + K) in [0, 1) is the race value and r the rank of the expert that forced it in
            keys = np.empty((nb, nl, e + 1))
            keys[..., e] = 3.0  # the sink column: index -1 = "nothing forced"
            race = rng.standard_exponential((nb, nl, e)) * self.inv_pop[:, ls]
            if self.drift > 0:  # each layer on the diagonal advances its drifting factor by one position
                a = self.rho * self.state[:, ls] + math.sqrt(1 - self.rho ** 2) * \
                    self.topic_rng.standard_normal((nb, nl, e))
                self.state[:, ls] = a
                race *= np.exp(-self.drift * a)
            np.divide(race, race + 1.0, out=keys[..., :e])
            keys = keys.reshape(m, e + 1)
            rows = np.arange(m)[:, None]
            # successors of this token's experts at the previous layer, rank-aligned
            coin = rng.random((nb, nl, k))
            if l_lo == 0:
                prev_layer = np.full((nb, nl, k), -1, dtype=np.int64)
                if nl > 1:
                    prev_layer[:, 1:] = self.succ[ls[1:, None], buf[:, ts[1:] + 1, ls[1:] - 1]]
            else:
                prev_layer = self.succ[ls[:, None], buf[:, ts + 1, ls - 1]]
            forced = np.where(coin < self.cross[ls][None, :, None], prev_layer, -1).reshape(m, k)
            # experts of the previous token at this layer (-1 at a sequence's first position), rank kept
            absolute = start + ts
            p_reuse = np.where(absolute[None, :] < prompt[:, None], self.reuse_prefill[ls], self.reuse_decode[ls])
            coin = rng.random((nb, nl, k))
            kept = np.where(coin < p_reuse[:, :, None], buf[:, ts, ls], -1).reshape(m, k)
            u_forced = np.take_along_axis(keys, forced, axis=1)
            u_kept = np.take_along_axis(keys, kept, axis=1)
            keys[:, :e] += 2.0
            keys[rows, forced] = 1.0 + (self.ranks + u_forced) / k
            keys[rows, kept] = (self.ranks + u_kept) / k
            live = keys[:, :e]
            if k < e:
                idx = np.argpartition(live, k - 1, axis=1)[:, :k]
            else:
                idx = np.broadcast_to(np.arange(e), (m, e))
            order = np.argsort(np.take_along_axis(live, idx, axis=1), axis=1)
            chosen = np.take_along_axis(idx, order, axis=1)
            buf[:, ts + 1, ls] = chosen.reshape(nb, nl, k)
        return buf[:, 1:]


def _weights(rng: np.random.Generator, n: int, spec: ModelSpec, config: SynthConfig) -> np.ndarray:
    g = rng.standard_gamma(config.weight_alpha, size=(n, spec.top_k))
    g = -np.sort(-g, axis=1)
    w = g / g.sum(axis=1, keepdims=True)
    if not spec.norm_topk_prob:
        c = WEIGHT_TOTAL_CONCENTRATION
        w *= rng.beta(config.weight_total * c, (1 - config.weight_total) * c, size=(n, 1))
    return w.astype(np.float32)


def _lookahead_logits(rng: np.random.Generator, target: np.ndarray, accuracy: float,
                      popularity: np.ndarray, target_layer: np.ndarray) -> np.ndarray:
    """(n, E) float32 logits whose top-k holds each true target expert with probability ``accuracy``.

    ``target``: (n, k) true experts of the target layer (rows of -1 = no target: all-NaN output);
    ``target_layer``: (n,) MoE ordinal of the target (any value on no-target rows). Missed experts are
    replaced by distinct decoys drawn by the target layer's popularity; the predicted top-k keeps the
    true rank order with decoys in the missed ranks; the other experts get lower logits that follow
    popularity with noise.
    """
    n, k = target.shape
    e = popularity.shape[1]
    out = np.full((n, e), np.nan, dtype=np.float32)
    has = target[:, 0] >= 0
    m = int(has.sum())
    if m == 0:
        return out
    tgt = target[has]
    lay = target_layer[has]
    logp = np.log(popularity[lay])  # (m, E)
    rows = np.arange(m)[:, None]
    miss = rng.random((m, k)) >= accuracy
    race = rng.standard_exponential((m, e)) / popularity[lay]
    race[rows, tgt] = np.inf  # decoys are never true targets
    n_decoys = min(k, e - k)
    if n_decoys:
        decoys = np.argpartition(race, n_decoys - 1, axis=1)[:, :n_decoys]
        decoys = np.take_along_axis(decoys, np.argsort(np.take_along_axis(race, decoys, axis=1), axis=1), axis=1)
    slot = np.cumsum(miss, axis=1) - 1
    miss &= slot < n_decoys  # with fewer than k non-target experts, some misses are impossible
    if n_decoys:
        pred = np.where(miss, np.take_along_axis(decoys, np.clip(slot, 0, n_decoys - 1), axis=1), tgt)
    else:
        pred = tgt
    noise = rng.standard_normal((m, e))
    values = logp - logp.max(axis=1, keepdims=True) - 1.0 + 0.3 * noise
    np.minimum(values, -0.5, out=values)
    ranks = np.arange(k, 0, -1) * 0.5 + 1.0  # rank 0 highest; gaps 0.5 > the 0.2 jitter below
    values[rows, pred] = ranks + 0.2 * rng.random((m, k))
    # logits on a 1/32 grid: the ordering is what matters, and the column compresses ~4x better
    out[has] = (np.round(values * 32.0) / 32.0).astype(np.float32)
    return out


def _batches(lengths: np.ndarray, num_layers: int) -> Iterator[tuple[int, int, int]]:
    """(first sequence, batch size, positions per chunk): a batch of several sequences is one chunk,
    so rows come out ordered by (seq_id, pos, layer)."""
    n = len(lengths)
    start = 0
    while start < n:
        t_max = int(lengths[start])
        nb = 1
        # grow the batch while the padded grid fits the chunk budget
        while start + nb < n and nb < MAX_BATCH:
            grown = max(t_max, int(lengths[start + nb]))
            if (nb + 1) * grown * num_layers > ROWS_PER_CHUNK:
                break
            t_max = grown
            nb += 1
        chunk = t_max if nb > 1 else max(1, min(t_max, ROWS_PER_CHUNK // num_layers))
        yield start, nb, chunk
        start += nb


def total_rows(config: SynthConfig) -> int:
    """Rows the trace of ``config`` will have (every token of every sequence at every MoE layer)."""
    prompt, gen = sequence_lengths(config)
    return int(prompt.sum() + gen.sum()) * config.spec().num_moe_layers


def check_fits_disk(config: SynthConfig, out_path: str | Path) -> None:
    """Refuse a request whose trace cannot fit the free space where it is written (before any work)."""
    import shutil

    need = total_rows(config) * MIN_BYTES_PER_ROW
    folder = Path(out_path).absolute().parent
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if need > free:
        raise ValueError(f"{out_path}: {total_rows(config):,} rows need at least {need / 2**30:,.1f} GiB, but only "
                         f"{free / 2**30:,.1f} GiB are free in {folder}; ask for fewer or shorter sequences")


def synthesize(config: SynthConfig, out_path: str | Path, command: str | None = None,
               progress: bool | None = None) -> Path:
    """Write the trace described by ``config`` to ``out_path`` and return its path.

    ``progress``: a tqdm bar on stderr (None = only when stderr is a terminal).
    """
    from dali_sim.trace.calibrate import calibrate, load_counts  # here: pyarrow and pandas are slow to import
    from dali_sim.trace.writer import TraceWriter

    check_output(out_path, files_of(config.popularity_from), "trace")
    spec = config.spec()
    check_fits_disk(config, out_path)
    num_layers, k, e = spec.num_moe_layers, spec.top_k, spec.num_experts
    pop_rng = _stream(config.seed, _STREAM_POPULARITY)
    calibration: Calibration | None = None
    if config.popularity_from is not None:
        calibration = calibrate(load_counts(config.popularity_from, spec), spec, pop_rng,
                                math.hypot(config.topic_spread, config.drift_spread))
        popularity = calibration.popularity
    else:
        popularity = shaped_popularity(num_layers, e, config.skew, config.popularity_shape, pop_rng)
    succ = successor_maps(popularity, pop_rng)
    prompt, gen = sequence_lengths(config)
    lengths = prompt + gen
    total_rows = int(lengths.sum()) * num_layers

    details: dict[str, Any] = {"synth": config.to_dict(), "generator": "dali_sim.trace.synth v1"}
    if calibration is not None:
        details["calibration"] = calibration.describe()
    provenance = default_provenance("synth", command, **details)
    predictors = [PredictorInfo(x.name, x.target_offset,
                                f"synthetic: each true target expert in the predicted top-{k} with probability "
                                f"{x.accuracy:g}, else a popularity-drawn decoy")
                  for x in config.lookahead]
    sequences = [SequenceInfo(i, f"synth-{i}", int(prompt[i]), int(gen[i])) for i in range(config.sequences)]

    routing = _Routing(config, spec, popularity, succ)
    weight_rng = _stream(config.seed, _STREAM_WEIGHTS)
    look_rngs = [_stream(config.seed, _STREAM_LOOKAHEAD, zlib.crc32(x.name.encode())) for x in config.lookahead]
    block_ids = np.asarray(spec.moe_layers, dtype=np.int64)
    ordinals = np.arange(num_layers)

    bar = None
    if progress is None:
        progress = sys.stderr.isatty()
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total_rows, unit="row", unit_scale=True, desc=f"synth {spec.name}", file=sys.stderr)
    try:
        with TraceWriter(out_path, spec, provenance=provenance, predictors=predictors,
                         sequences=sequences) as writer:
            for first, nb, chunk in _batches(lengths, num_layers):
                seqs = np.arange(first, first + nb)
                lens, prom = lengths[seqs], prompt[seqs]
                carry = np.full((nb, num_layers, k), -1, dtype=np.int64)
                routing.start_batch(nb)
                for start in range(0, int(lens.max()), chunk):
                    length = min(chunk, int(lens.max()) - start)
                    ex = routing.chunk(carry, start, length, prom)  # (nb, length, L, k)
                    carry = ex[:, -1]
                    pos = start + np.arange(length)
                    valid = np.repeat((pos[None, :] < lens[:, None]).reshape(-1), num_layers)
                    grid = (nb, length, num_layers)
                    seq_col = np.broadcast_to(seqs[:, None, None], grid).reshape(-1)[valid]
                    pos_col = np.broadcast_to(pos[None, :, None], grid).reshape(-1)[valid]
                    ord_col = np.broadcast_to(ordinals[None, None, :], grid).reshape(-1)[valid]
                    experts = ex.reshape(-1, k)[valid]
                    phase = (pos_col >= prom[seq_col - first]).astype(np.int8)
                    targets = []
                    for x in config.lookahead:
                        t = np.full((nb, length, num_layers, k), -1, dtype=np.int64)
                        t[:, :, : num_layers - x.target_offset] = ex[:, :, x.target_offset:]
                        targets.append(t.reshape(-1, k)[valid])
                    for a in range(0, len(seq_col), ROWS_PER_WRITE):
                        b = min(a + ROWS_PER_WRITE, len(seq_col))
                        look = {x.name: _lookahead_logits(r, tg[a:b], x.accuracy, popularity,
                                                          ord_col[a:b] + x.target_offset)
                                for x, r, tg in zip(config.lookahead, look_rngs, targets)}
                        writer.write(seq_id=seq_col[a:b], phase=phase[a:b], pos=pos_col[a:b],
                                     layer=block_ids[ord_col[a:b]], experts=experts[a:b],
                                     weights=_weights(weight_rng, b - a, spec, config), lookahead=look)
                        if bar is not None:
                            bar.update(b - a)
            path = writer.path
    finally:
        if bar is not None:
            bar.close()
    return path


__all__: Sequence[str] = (
    "DEFAULT_CROSSLAYER", "DEFAULT_DRIFT_HALFLIFE", "DEFAULT_DRIFT_SPREAD", "DEFAULT_REUSE", "DEFAULT_SHAPE",
    "DEFAULT_SKEW", "DEFAULT_TOPIC_SPREAD", "DEFAULT_WEIGHT_ALPHA", "DEFAULT_WEIGHT_TOTAL", "POPULARITY_SHAPES",
    "LookaheadSpec", "SynthConfig", "sequence_lengths", "shaped_popularity", "successor_maps", "synthesize",
)
