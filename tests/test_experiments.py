"""The experiment scripts (experiments/) run at a tiny size and write sane outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
EXP = ROOT / "experiments"

# each script runs at its --quick size (a few seconds): part of the default suite, so CI shows that
# the experiments run end to end from a clean clone


def _run(script: str, out: Path, *args: str) -> None:
    env = {**os.environ, "DALI_EXP_CACHE": str(out / "cache"), "MPLBACKEND": "Agg"}
    res = subprocess.run([sys.executable, str(EXP / f"{script}.py"), "--quick", "--out", str(out), *args],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


def _outputs(out: Path, name: str) -> pd.DataFrame:
    for ext in ("csv", "png", "md"):
        f = out / f"{name}.{ext}"
        assert f.is_file() and f.stat().st_size > 0, f
    man = json.loads((out / f"{name}.manifest.json").read_text())
    assert man["dali_version"] and man["hardware"] == "rtx3090-epyc7532"
    assert man["script"] == name and "seed" in man["args"]
    md = (out / f"{name}.md").read_text()
    assert "What this shows" in md and "|---|" in md
    return pd.read_csv(out / f"{name}.csv")


def test_fig12_13_speedups(tmp_path):
    _run("fig12_13_speedups", tmp_path, "--models", "mixtral-8x7b")
    df = _outputs(tmp_path, "fig12_13_speedups")
    assert {"model", "batch_size", "system", "prefill_tokens_per_s", "decode_tokens_per_s",
            "dali_prefill_speedup", "dali_decode_speedup"} <= set(df.columns)
    assert set(df.system) == {"dali", "dali-plus", "oracle", "llamacpp", "ktransformers", "moe-lightning", "hybrimoe"}
    self_ = df[df.system == "dali"]
    assert np.allclose(self_.dali_decode_speedup, 1.0) and np.allclose(self_.dali_prefill_speedup, 1.0)
    plus = df[df.system == "dali-plus"]
    assert np.allclose(plus.dali_plus_decode_speedup, 1.0)
    for col in ("prefill_tokens_per_s", "decode_tokens_per_s", "dali_prefill_speedup", "dali_decode_speedup"):
        assert (df[col] > 0).all() and np.isfinite(df[col]).all(), col
    assert "7.62" in (tmp_path / "fig12_13_speedups.md").read_text()  # the paper's numbers sit next to ours


def test_fig14_assignment(tmp_path):
    _run("fig14_assignment", tmp_path)
    df = _outputs(tmp_path, "fig14_assignment")
    assert {"model", "batch_size", "phase", "placement", "moe_ms_per_token", "bound"} <= set(df.columns)
    assert set(df.placement) == {"all-cpu", "hybrimoe", "dali-greedy", "optimal"}
    assert (df.moe_ms_per_token > 0).all()
    assert df.loc[df.placement == "optimal", "bound"].all() and not df.loc[df.placement != "optimal", "bound"].any()
    cpu = df[df.placement == "all-cpu"]
    assert (cpu.gpu_fraction == 0).all() and np.allclose(cpu.speedup_vs_all_cpu, 1.0)


def test_table4_greedy_vs_exact(tmp_path):
    _run("table4_greedy_vs_exact", tmp_path)
    df = _outputs(tmp_path, "table4_greedy_vs_exact")
    assert {"model", "batch_size", "phase", "greedy_ms_per_layer", "optimal_ms_per_layer", "greedy_over_optimal",
            "greedy_wall_us", "optimal_wall_us"} <= set(df.columns)
    assert (df.optimal_ms_per_layer <= df.greedy_ms_per_layer * (1 + 1e-9)).all()
    assert (df.greedy_over_optimal >= 1 - 1e-9).all() and (df.worst_layer_ratio >= 1 - 1e-9).all()
    assert (df.layers > 0).all()


def test_run_all_rejects_unknown_script(tmp_path):
    res = subprocess.run([sys.executable, str(EXP / "run_all.py"), "--only", "nope", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode != 0 and "unknown scripts" in res.stderr
