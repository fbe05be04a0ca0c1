"""benchmarks/gil_convoy.py runs every load and form, and its loads ran while the group was timed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gil_convoy  # noqa: E402


def test_every_load_and_form_is_timed(tmp_path):
    out = tmp_path / "gil.json"
    assert gil_convoy.main(["--experts", "3", "--tokens", "2", "--hidden", "32", "--inter", "16", "--rounds", "2",
                            "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["load"], r["form"]) for r in rows} == {(load, form) for load in ("none", "python", "torch")
                                                       for form in ("per_expert", "batched")}
    assert all(r["us"] > 0 for r in rows)
    assert all((r["load_rounds"] > 0) == (r["load"] != "none") for r in rows)
    assert all(r["over_alone"] == 1.0 for r in rows if r["load"] == "none")
