"""experiments/beyond_dali.py at its --quick size: every system and the bound, the headline and the
ablation tables, and the bound above every system (decode tokens/s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent


def test_beyond_dali_quick(tmp_path):
    env = {**os.environ, "DALI_EXP_CACHE": str(tmp_path / "cache"), "MPLBACKEND": "Agg"}
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "beyond_dali.py"), "--quick", "--out",
                          str(tmp_path)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    for name in ("beyond_dali", "beyond_dali_ablation"):
        for ext in ("csv", "png", "md", "manifest.json"):
            f = tmp_path / f"{name}.{ext}"
            assert f.is_file() and f.stat().st_size > 0, f
    df = pd.read_csv(tmp_path / "beyond_dali.csv")
    systems = set(df.system)
    assert {"link-budget", "dali", "dali-plus", "lower-bound", "ktransformers-best", "hybrimoe-best"} <= systems
    ran = df[df.system != "lower-bound"]
    bound = float(df.loc[df.system == "lower-bound", "decode_tokens_per_s"].iloc[0])
    assert (ran["decode_tokens_per_s"].dropna() <= bound * (1 + 1e-9)).all()
    md = (tmp_path / "beyond_dali.md").read_text()
    assert "ours / best" in md and "The policies alone" in md
    man = json.loads((tmp_path / "beyond_dali.manifest.json").read_text())
    assert man["cache_ratio"] == 0.5 and man["script"] == "beyond_dali"
    abl = pd.read_csv(tmp_path / "beyond_dali_ablation.csv")
    assert abl["step"].iloc[0] == "dali (paper)" and abl["step"].iloc[-1].endswith("= ours")
    assert np.isfinite(abl["decode_tokens_per_s"]).all()
