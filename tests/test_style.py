"""The experiments' figures: one colour per system in every panel (experiments/style.py), tick labels on
every panel, empty panels that say so, x labels that do not overlap, legends that cover no bar."""

from __future__ import annotations

import math
import sys

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from conftest import REPO  # noqa: E402
from dali_sim.policies.systems import system_names  # noqa: E402

sys.path.insert(0, str(REPO / "experiments"))
import style as S  # noqa: E402


def test_every_system_preset_has_its_own_colour():
    assert set(system_names()) <= set(S.SYSTEM_COLORS)
    assert len(set(S.SYSTEM_COLORS.values())) == len(S.SYSTEM_COLORS)
    assert S.color("hybrimoe") == S.color("hybrimoe (BOUND)") and S.color("optimal") == S.color("lower-bound")
    assert S.color("oracle") == S.color("oracle-heuristic")  # result files written before the rename
    assert S.color("something-new") == S.color("something-new")  # stable for unknown names too


def _bars_by_label(ax) -> dict[str, list[str]]:
    return {c.get_label(): [to_hex(p.get_facecolor()) for p in c.patches] for c in ax.containers}


def test_fig12_13_colours_by_system_not_by_position_and_empty_panels_say_so():
    import fig12_13_speedups as F

    rows = []
    for model, systems in (("mixtral-8x7b", ("llamacpp", "ktransformers", "moe-lightning", "hybrimoe")),
                           ("gpt-oss-20b", ("llamacpp", "hybrimoe"))):  # fewer baselines: position would shift
        for s in systems:
            for bs in (4, 16):
                rows.append({"model": model, "system": s, "batch_size": bs, "dali_decode_speedup": 1.2 + 0.1 * bs,
                             "dali_prefill_speedup": math.nan if model == "gpt-oss-20b" else 1.5})
    fig = F.plot(pd.DataFrame(rows))
    fig.canvas.draw()
    axes = fig.axes
    for ax in axes:
        for label, colours in _bars_by_label(ax).items():
            system = label.removeprefix("vs ")
            assert set(colours) == {to_hex(S.color(system))}, (ax.get_title(), label)
    empty = next(ax for ax in axes if ax.get_title() == "gpt-oss-20b (prefill)")
    assert not empty.containers and "no prefill" in " ".join(t.get_text() for t in empty.texts)
    for ax in axes:
        if ax.containers:  # every drawn panel labels its y ticks, a narrow log range included
            labels = [t.get_text() for t in ax.get_yticklabels(which="both") if t.get_visible() and t.get_text()]
            assert labels, ax.get_title()


def _overlapping_tick_labels(ax) -> bool:
    """Whether neighbouring x tick labels collide: side by side for horizontal ones, along their slope for
    rotated ones (their baselines are then apart by the tick spacing times the sine of the angle)."""
    labels = [t for t in ax.get_xticklabels() if t.get_text()]
    boxes = [t.get_window_extent() for t in labels]
    if len(boxes) < 2:
        return False
    rotation = labels[0].get_rotation()
    if rotation == 0:
        return any(a.x1 > b.x0 for a, b in zip(boxes, boxes[1:]))
    spacing = np.diff([ax.transData.transform((x, 0))[0] for x in ax.get_xticks()]).min()
    height = labels[0].get_fontsize() * ax.figure.dpi / 72
    return spacing * math.sin(math.radians(rotation)) < height


def test_table4_x_labels_do_not_overlap():
    import table4_greedy_vs_exact as T

    summ = pd.DataFrame([{"model": m, "batch_size": bs, "phase": ph, "greedy_over_optimal": 1.01,
                          "greedy_wall_us": 20.0, "optimal_wall_us": 900.0}
                         for m in ("mixtral-8x7b", "deepseek-v2-lite", "qwen3-30b-a3b", "gpt-oss-20b")
                         for bs in (1, 16, 64) for ph in ("prefill", "decode")])
    fig = T.plot(summ, None)
    fig.canvas.draw()
    for ax in fig.axes:
        assert not _overlapping_tick_labels(ax)


def test_fig14_legend_covers_no_bar():
    import fig14_assignment as F

    rows = [{"model": m, "phase": ph, "batch_size": bs, "placement": p, "ms_per_token": v}
            for m in ("mixtral-8x7b", "gpt-oss-20b") for ph in ("decode", "prefill") for bs in (1, 16)
            for p, v in (("cpu-only", 9.0), ("gpu-only", 5.0), ("hybrimoe", 3.0), ("hybrimoe (as released)", 4.0),
                         ("dali-greedy", 2.0), ("optimal", 1.9))]
    fig = F.plot(pd.DataFrame(rows))
    fig.canvas.draw()
    legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends
    for legend in legends:
        from matplotlib.transforms import Bbox

        box = legend.get_window_extent()
        for ax in fig.axes:
            for patch in ax.patches:  # the visible part of each bar (a log axis sends its foot to -inf)
                seen = Bbox.intersection(patch.get_window_extent(), ax.get_window_extent())
                assert seen is None or not box.overlaps(seen), ax.get_title()
    for ax in fig.axes:  # the bound is named, and coloured as the oracle
        for label, colours in _bars_by_label(ax).items():
            assert set(colours) == {to_hex(S.color(label))}


@pytest.mark.parametrize("name", ["fig17_18_sensitivity", "fig19_breakdown", "presets_vs_oracle", "recorded_trace",
                                  "prefetch_accuracy"])
def test_every_experiment_uses_the_shared_style(name):
    text = (REPO / "experiments" / f"{name}.py").read_text()
    assert "import style as S" in text and "S.color" in text
    assert "tab:" not in text  # no colour picked by hand or by position
