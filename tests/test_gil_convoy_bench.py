"""benchmarks/gil_convoy.py runs every load and form, and its loads ran while the group was timed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gil_convoy  # noqa: E402


def test_every_load_and_form_is_timed(tmp_path):
    out = tmp_path / "gil.json"
    assert gil_convoy.main(["--rows", "8", "--experts", "3", "--tokens", "2", "--hidden", "32", "--inter", "16",
                            "--rounds", "2", "--calls", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    forms = ("per_expert", "grouped") if gil_convoy._GROUPED_MM is not None else ("per_expert",)
    assert {(r["load"], r["form"]) for r in rows} == {(load, form) for load in gil_convoy.LOADS for form in forms}
    assert all(r["wall_us"] > 0 and r["cpu_us"] > 0 for r in rows)
    assert all((r["load_rounds"] > 0) == (r["load"] != "none") for r in rows)
    assert all(r["wall_over_alone"] == r["cpu_over_alone"] == 1.0 for r in rows if r["load"] == "none")


def test_the_two_forms_compute_the_same_products():
    group = gil_convoy.Group(rows=10, experts=4, tokens=3, hidden=16, inter=8, dtype=torch.float32)
    if gil_convoy._GROUPED_MM is None:
        pytest.skip("this torch has no grouped product")
    assert torch.equal(group.per_expert(), group.grouped())
