"""The engine's compiled direct lanes (dali_sim/sim/lanes.py) against its reference methods: identical
summaries, per-layer frames and per-sequence frames, bit for bit, over the systems and the shipped traces."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import dali_sim.sim.lanes as lanes
from dali_sim.sim import simulate
from dali_sim.trace import read_trace
from dali_sim.trace.synth import SynthConfig, synthesize
from conftest import WHOLE

REPO = Path(__file__).resolve().parents[1]
LOOKAHEAD = ("residual=0.9", "next-gate=0.7", "gate2=0.6@2", "gate3=0.5@3")
SYSTEMS = ("gpu-lru", "cpu-only", "dali", "hybrimoe", "fiddler", "llamacpp", "ktransformers", "mixtral-offloading",
           "moe-lightning")

pytestmark = pytest.mark.skipif(lanes.compiled() is None, reason="numba not installed (the reference runs anyway)")


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def both(monkeypatch, trace, system: str, batch: int):
    runs = []
    for use in (True, False):
        monkeypatch.setattr(lanes, "compiled", lanes.compiled if use else (lambda: None))
        runs.append(simulate(trace, system, batch_size=batch, profiling=WHOLE))
    monkeypatch.undo()
    return runs


@pytest.fixture(scope="module")
def qwen_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("lanes") / "qwen3.parquet"
    synthesize(SynthConfig(model="qwen3-30b-a3b", sequences=8, prompt_len=16, gen_len=8, seed=3, lookahead=LOOKAHEAD),
               path, progress=False)
    return read_trace(path)


@pytest.mark.parametrize("system", SYSTEMS)
def test_compiled_lanes_match_the_reference_on_qwen3(monkeypatch, qwen_trace, system):
    fast, ref = both(monkeypatch, qwen_trace, system, 4)
    assert same(fast.summary, ref.summary)
    assert fast.per_layer.equals(ref.per_layer) and fast.per_sequence.equals(ref.per_sequence)
    assert fast.summary["events"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("trace,batch,systems", [
    ("dali-tiny-moe", 8, ("gpu-lru", "dali", "llamacpp", "moe-lightning", "fiddler-best")),
    ("gpt-oss-20b", 2, ("gpu-lru", "cpu-only", "ktransformers-best", "mixtral-offloading")),
])
def test_compiled_lanes_match_the_reference_on_shipped_traces(monkeypatch, trace, batch, systems):
    t = read_trace(REPO / "traces" / f"{trace}.parquet")
    for system in systems:
        fast, ref = both(monkeypatch, t, system, batch)
        assert same(fast.summary, ref.summary), system
        assert fast.per_layer.equals(ref.per_layer), system


def test_a_recorded_timeline_uses_the_reference(qwen_trace):
    # with a timeline the engine logs every activity itself: the same numbers as without one
    plain = simulate(qwen_trace, "gpu-lru", batch_size=4, profiling=WHOLE)
    timed = simulate(qwen_trace, "gpu-lru", batch_size=4, profiling=WHOLE, timeline=True)
    assert same({k: v for k, v in plain.summary.items() if k != "manifest"},
                {k: v for k, v in timed.summary.items() if k != "manifest"})
