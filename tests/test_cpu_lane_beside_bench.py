"""benchmarks/cpu_lane_beside.py replays dali in its three modes and times the CPU lane's calls in each."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cpu_lane_beside  # noqa: E402


def test_three_modes_each_time_the_cpu_lanes_calls(tmp_path, monkeypatch):
    monkeypatch.setenv("DALI_EXP_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "beside.json"
    assert cpu_lane_beside.main(["--quick", "--scale", "0.0625", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [r["mode"] for r in d["rows"]] == list(cpu_lane_beside.MODES)
    calls = {r["calls"] for r in d["rows"]}
    assert len(calls) == 1 and calls.pop() > 0  # (the same plans in every mode: the same CPU-lane calls)
    assert all(r["wall_us"] > 0 and r["cpu_us"] > 0 and r["run_s"] > 0 for r in d["rows"])
