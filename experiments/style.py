"""One look for every figure of the experiments and of ``notebooks/ablation.ipynb``.

* :func:`color`: one colour per system (and per placement, predictor and ablation step named after
  one), the same in every figure, whatever else a panel shows;
* :func:`grouped_bars`: bars of several series per x group, coloured by series name;
* :func:`log_y`: a logarithmic y axis that labels its ticks even when the data span less than a decade;
* :func:`no_data`: a panel with nothing to draw says so;
* :func:`tick_labels`: x labels that do not overlap (rotated, anchored at their end);
* :func:`legend_below`: one legend under the panels, never covering a bar.
"""

from __future__ import annotations

import zlib
from typing import Iterable, Mapping, Sequence

import numpy as np

#: every system preset (dali_sim/policies/systems.toml), and what is named after one
SYSTEM_COLORS: dict[str, str] = {
    "dali": "#1f77b4",  # blue
    "dali-plus": "#2ca02c",  # green
    "link-budget": "#6b8e23",  # olive drab: ours beyond DALI
    "oracle-heuristic": "#555555",  # dark grey: a reference point that reads the future
    "lower-bound": "#000000",  # black: a bound
    "llamacpp": "#ff7f0e",  # orange
    "ktransformers": "#9467bd",  # purple
    "moe-lightning": "#8c564b",  # brown
    "hybrimoe": "#d62728",  # red
    "fiddler": "#e377c2",  # pink
    "mixtral-offloading": "#17becf",  # cyan
    "gpu-lru": "#bcbd22",  # olive
    "gpu-lfu": "#7f7f7f",  # grey
    "gpu-static": "#aec7e8",  # light blue
    "cpu-only": "#c49c94",  # light brown
    # the most favourable readings (NAME-best): the light shade of the paper reading's colour
    "llamacpp-best": "#ffbb78",
    "ktransformers-best": "#c5b0d5",
    "hybrimoe-best": "#ff9896",
    "fiddler-best": "#f7b6d2",
    "mixtral-offloading-best": "#9edae5",
    "moe-lightning-best": "#a6761d",
}
#: other names the figures use, mapped to a system's colour or their own
ALIASES: dict[str, str] = {"dali-greedy": "dali", "all-cpu": "cpu-only", "optimal": "lower-bound",
                           "oracle": "oracle-heuristic"}  # optimal: the exact placement, a bound too
OTHER_COLORS: dict[str, str] = {"residual": "#1f77b4", "next-gate": "#ff7f0e", "gate2": "#9467bd",
                                "gate3": "#8c564b", "decode": "#1f77b4", "prefill": "#ff7f0e"}
_FALLBACK = ("#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#5254a3", "#8ca252", "#bd9e39")


def color(name: str) -> str:
    """The colour of ``name`` (a system, or a placement, predictor or phase); a name without one gets a
    colour derived from the name itself, so it is stable across figures too."""
    name = str(name).removesuffix(" (BOUND)")
    name = ALIASES.get(name, name)
    if name in SYSTEM_COLORS:
        return SYSTEM_COLORS[name]
    if name in OTHER_COLORS:
        return OTHER_COLORS[name]
    return _FALLBACK[zlib.crc32(name.encode()) % len(_FALLBACK)]


def colors(names: Iterable[str]) -> list[str]:
    return [color(n) for n in names]


def is_bound(name: str) -> bool:
    """A bound (the time lower bound, an exact optimum): drawn hatched."""
    return ALIASES.get(str(name).removesuffix(" (BOUND)"), name) == "lower-bound"


def is_reference(name: str) -> bool:
    """A bound or an oracle heuristic: not an achievable system (drawn hatched)."""
    return is_bound(name) or ALIASES.get(name, name) == "oracle-heuristic"


def grouped_bars(ax, groups: Sequence, series: Sequence[str], values: Mapping[str, Sequence[float]],
                 *, labels: Mapping[str, str] | None = None, width: float = 0.8) -> np.ndarray:
    """Bars of ``values[s]`` (one per group) for each series ``s``, side by side per group, coloured by
    series name (bounds hatched). Returns the group positions."""
    x = np.arange(len(groups))
    w = width / max(len(series), 1)
    for k, s in enumerate(series):
        ax.bar(x + (k - (len(series) - 1) / 2) * w, np.asarray(values[s], dtype=float), w, color=color(s),
               label=(labels or {}).get(s, s), hatch="//" if is_reference(s) else None,
               edgecolor="white" if not is_reference(s) else "0.8", linewidth=0.5)
    return x


def log_y(ax) -> None:
    """Logarithmic y axis whose ticks are labelled in plain numbers, minor ones too when the data span
    less than a decade (matplotlib then shows no label at all)."""
    from matplotlib import ticker

    ax.set_yscale("log")
    plain = ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    lo, hi = ax.get_ylim()
    if hi / lo < 10:
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)


def no_data(ax, values, note: str) -> bool:
    """If ``values`` has nothing finite, clear the panel and say ``note`` in it; True when it did."""
    v = np.asarray(values, dtype=float)
    if v.size and np.isfinite(v).any():
        return False
    ax.cla()
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, fontsize=8, color="0.35", wrap=True)
    return True


def tick_labels(ax, x, labels: Sequence[str], *, fontsize: float = 7, rotation: float | None = None) -> None:
    """x tick labels that do not overlap: rotated (by default when there are many or long ones) and
    anchored at their right end under their bar."""
    labels = [str(s) for s in labels]
    if rotation is None:
        rotation = 0 if len(labels) <= 4 and max((len(s) for s in labels), default=0) <= 8 else 40
    ax.set_xticks(x, labels, fontsize=fontsize, rotation=rotation,
                  ha="right" if rotation else "center", rotation_mode="anchor" if rotation else "default")


def legend_below(fig, axes, *, ncol: int | None = None, fontsize: float = 8) -> None:
    """One legend for the whole figure under the panels (labels merged over ``axes``), so it covers no bar."""
    handles, labels = {}, []
    for ax in np.ravel(axes):
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    if not labels:
        return
    fig.legend([handles[lab] for lab in labels], labels, loc="lower center", ncol=ncol or min(len(labels), 6),
               fontsize=fontsize, frameon=False, bbox_to_anchor=(0.5, 0.0))
    rows = -(-len(labels) // (ncol or min(len(labels), 6)))
    fig.tight_layout(rect=(0, 0.04 + 0.045 * rows, 1, 1))


__all__ = ["ALIASES", "OTHER_COLORS", "SYSTEM_COLORS", "color", "colors", "grouped_bars", "is_bound", "is_reference",
           "legend_below", "log_y", "no_data", "tick_labels"]
