"""benchmarks/generate_speed.py times plain generate and a system in turn, per repeat and at their best."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import generate_speed  # noqa: E402


def test_paired_ratios_are_each_repeats_own(tmp_path):
    out = tmp_path / "gen.json"
    assert generate_speed.main(["--prompts", "2", "--batch-size", "2", "--max-new-tokens", "3", "--systems",
                                "cpu-only", "--repeats", "3", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["same_tokens"] == {"cpu-only": True}
    paired = d["paired_ratios"]
    assert paired["plain generate"] == [1.0, 1.0, 1.0] and len(paired["cpu-only"]) == 3
    assert d["paired_ratio_median"]["cpu-only"] == statistics.median(paired["cpu-only"])
    # each repeat's ratio is its own runs' (the system's over the plain run just before it); the best times are the
    # repeats' fastest
    rounds = d["round_seconds"]
    assert paired["cpu-only"] == [t / p for t, p in zip(rounds["cpu-only"], rounds["plain generate"])]
    assert {k: min(v) for k, v in rounds.items()} == d["cpu_seconds"]
    assert d["ratio_to_plain"]["cpu-only"] == d["cpu_seconds"]["cpu-only"] / d["cpu_seconds"]["plain generate"]
