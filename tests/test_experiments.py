"""The experiment scripts (experiments/) run at a tiny size and write sane outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dali_sim.policies import system_names

ROOT = Path(__file__).resolve().parent.parent
EXP = ROOT / "experiments"

# each script runs at its --quick size (a few seconds): part of the default suite, so CI shows that
# the experiments run end to end from a clean clone


def _run(script: str, out: Path, *args: str) -> None:
    env = {**os.environ, "DALI_EXP_CACHE": str(out / "cache"), "MPLBACKEND": "Agg"}
    res = subprocess.run([sys.executable, str(EXP / f"{script}.py"), "--quick", "--out", str(out), "--workers", "1",
                          *args],
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
    from dali_sim.sim import simulate

    _run("fig12_13_speedups", tmp_path)
    df = _outputs(tmp_path, "fig12_13_speedups")
    assert {"model", "batch_size", "system", "reading", "prefill_tokens_per_s", "decode_tokens_per_s",
            "dali_prefill_speedup", "dali_decode_speedup", "lower_bound_decode_speedup"} <= set(df.columns)
    comps = ("llamacpp", "ktransformers", "moe-lightning", "hybrimoe")
    assert set(df.system) == {"dali", "dali-plus", "lower-bound", *comps, *(f"{c}-best" for c in comps)}
    assert set(df[df.system.isin(comps)].reading) == {"paper"} and set(df[df.system.str.endswith("-best")].reading) == {"best"}
    assert (df.precision == "q4_0").all() and set(df.cache_ratio) == {0.5}  # the paper's setup
    self_ = df[df.system == "dali"]
    assert np.allclose(self_.dali_decode_speedup, 1.0) and np.allclose(self_.dali_prefill_speedup, 1.0)
    for col in ("prefill_tokens_per_s", "decode_tokens_per_s", "dali_prefill_speedup", "dali_decode_speedup"):
        assert (df[col] > 0).all() and np.isfinite(df[col]).all(), col
    assert (df.lower_bound_decode_speedup >= 1 - 1e-9).all()  # nothing beats the time bound
    assert "7.62" in (tmp_path / "fig12_13_speedups.md").read_text()  # the paper's numbers sit next to ours
    # a row of the store is the run simulate() gives on the sweep's trace
    row = df[(df.system == "hybrimoe") & (df.batch_size == 4)].iloc[0]
    trace = tmp_path / "sweeps" / "fig12_13_speedups" / "traces" / f"{row.trace}.parquet"
    r = simulate(trace, "hybrimoe", batch_size=4, overrides={"memory": {"cache_ratio": 0.5}})
    assert np.isclose(r.summary["decode_tokens_per_s"], row.decode_tokens_per_s)


def test_implementation_share(tmp_path):
    _run("implementation_share", tmp_path)
    df = _outputs(tmp_path, "implementation_share")
    assert set(zip(df.system, df.implementation)) == {
        ("dali", "pytorch-eager"), ("dali", "kt-sglang"), ("dali", "bare"), ("llamacpp", "llamacpp"),
        ("llamacpp", "bare"), ("ktransformers-best", "kt-sglang"), ("ktransformers-best", "bare")}
    tps = df.set_index("label").decode_tokens_per_s
    for system, impl in (("dali", "pytorch-eager"), ("llamacpp", "llamacpp"), ("ktransformers-best", "kt-sglang")):
        assert tps[f"{system} @ bare"] >= tps[f"{system} @ {impl}"] * (1 - 1e-9)  # host costs only add time


def test_fig14_assignment(tmp_path):
    _run("fig14_assignment", tmp_path)
    df = _outputs(tmp_path, "fig14_assignment")
    assert {"model", "batch_size", "phase", "placement", "ms_per_token", "bound"} <= set(df.columns)
    assert set(df.placement) == {"cpu-only", "gpu-only", "hybrimoe", "hybrimoe (as released)", "dali-greedy", "optimal"}
    assert (df.ms_per_token > 0).all()
    cpu = df[df.placement == "cpu-only"]
    assert (cpu.gpu_fraction == 0).all()
    assert (df[df.placement == "gpu-only"].gpu_fraction == 1).all()
    # as released = HSS for one-token steps (decode at batch 1), every expert on the GPU otherwise
    key = ["model", "phase", "batch_size"]
    rel = df[df.placement == "hybrimoe (as released)"].set_index(key).ms_per_token
    for placement, pick in (("hybrimoe", lambda i: i[1] == "decode" and i[2] == 1), ("gpu-only", lambda i: not (i[1] == "decode" and i[2] == 1))):
        src = df[df.placement == placement].set_index(key).ms_per_token
        for i in rel.index:
            if pick(i):
                assert rel[i] == src[i], i
    assert "+23%" in (tmp_path / "fig14_assignment.md").read_text()


def test_table4_greedy_vs_exact(tmp_path):
    _run("table4_greedy_vs_exact", tmp_path)
    df = _outputs(tmp_path, "table4_greedy_vs_exact")
    assert {"model", "batch_size", "phase", "greedy_ms_per_layer", "optimal_ms_per_layer", "greedy_over_optimal",
            "greedy_wall_us", "optimal_wall_us"} <= set(df.columns)
    assert (df.optimal_ms_per_layer <= df.greedy_ms_per_layer * (1 + 1e-9)).all()
    assert (df.greedy_over_optimal >= 1 - 1e-9).all() and (df.worst_layer_ratio >= 1 - 1e-9).all()
    assert (df.layers > 0).all()


def test_quick_never_writes_the_committed_results(tmp_path):
    """--quick defaults to experiments/results-quick and refuses the committed experiments/results."""
    C = _common()
    p = C.parser("x")
    assert p.parse_args(["--quick"]).out == C.RESULTS_QUICK != C.RESULTS
    assert p.parse_args([]).out == C.RESULTS
    for script in ("run_all", "fig12_13_speedups", "table4_greedy_vs_exact"):
        res = subprocess.run([sys.executable, str(EXP / f"{script}.py"), "--quick", "--out", str(C.RESULTS)],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert res.returncode == 2 and "would overwrite the committed full results" in res.stderr, script
    assert "/experiments/results-quick/" in (ROOT / ".gitignore").read_text().splitlines()


@pytest.mark.slow
def test_run_all_quick_resumes_into_its_own_folder(tmp_path):
    """run_all --quick into a folder: every script's outputs and the headline table; a rerun resumes the
    sweeps (nothing left to run)."""
    env = {**os.environ, "DALI_EXP_CACHE": str(tmp_path / "cache"), "MPLBACKEND": "Agg"}
    cmd = [sys.executable, str(EXP / "run_all.py"), "--quick", "--out", str(tmp_path), "--workers", "1",
           "--no-notebook", "--only", "fig12_13_speedups,fig14_assignment,table4_greedy_vs_exact,"
           "fig17_18_sensitivity,fig19_breakdown"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    head = (tmp_path / "headline.md").read_text()
    assert "| Fig. 12: DALI decode speedup over hybrimoe, bs 4/16/64 | 1.32x |" in head and "+23%" in head
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert again.returncode == 0 and "to run in" not in again.stderr and "already in" in again.stderr


def test_run_all_rejects_unknown_script(tmp_path):
    res = subprocess.run([sys.executable, str(EXP / "run_all.py"), "--only", "nope", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode != 0 and "unknown scripts" in res.stderr


def _common():
    """experiments/common.py, imported as a module."""
    sys.path.insert(0, str(EXP))
    try:
        import common
    finally:
        sys.path.remove(str(EXP))
    return common


def test_fig19_breakdown(tmp_path):
    from dali_sim.sim import simulate

    _run("fig19_breakdown", tmp_path)
    df = _outputs(tmp_path, "fig19_breakdown")
    assert {"model", "batch_size", "ladder", "step", "decode_tokens_per_s", "prefill_tokens_per_s",
            "decode_speedup_vs_prev", "prefill_speedup_vs_prev", "decode_speedup_vs_greedy", "bound"} <= set(df.columns)
    assert set(zip(df.ladder, df.step)) == {("dali", "greedy"), ("dali", "+prefetch"), ("dali", "+cache"),
                                            ("dali-plus", "greedy"), ("dali-plus", "+prefetch"),
                                            ("dali-plus", "+cache"), ("extra", "greedy+cache (no prefetch)"),
                                            ("reference", "oracle-heuristic"), ("reference", "lower-bound")}
    assert set(df.cache_ratio) == {0.25}  # the paper's Fig. 19 setup
    for col in ("decode_tokens_per_s", "prefill_tokens_per_s", "decode_speedup_vs_greedy"):
        assert (df[col] > 0).all() and np.isfinite(df[col]).all(), col
    assert df.loc[df.step == "oracle-heuristic", "oracle"].all() and df.loc[df.step == "lower-bound", "bound"].all()
    greedy = df[df.step == "greedy"]
    assert greedy.decode_speedup_vs_prev.isna().all() and np.allclose(greedy.decode_speedup_vs_greedy, 1.0)
    assert (greedy.prefetch_issued == 0).all() and (greedy.swaps == 0).all()
    # the ladder's steps chain: each step's speedup over the previous multiplies to its speedup over greedy
    for (_, _, ladder), g in df[df.ladder.isin(["dali", "dali-plus"])].groupby(["model", "batch_size", "ladder"]):
        prod = np.cumprod(g.decode_speedup_vs_prev.fillna(1.0).to_numpy())
        assert np.allclose(prod, g.decode_speedup_vs_greedy.to_numpy()), ladder
    # the last step of each ladder is the full preset: the same numbers as a plain run of that preset
    trace = tmp_path / "sweeps" / "fig19_breakdown" / "traces" / "mixtral-b1.parquet"
    for ladder in ("dali", "dali-plus"):
        r = simulate(trace, ladder, batch_size=1, overrides={"memory": {"cache_ratio": 0.25}})
        row = df[(df.trace == "mixtral-b1") & (df.ladder == ladder) & (df.step == "+cache")]
        assert len(row) == 1
        assert np.isclose(row.decode_tokens_per_s.iloc[0], r.summary["decode_tokens_per_s"]), ladder
        assert np.isclose(row.prefill_tokens_per_s.iloc[0], r.summary["prefill_tokens_per_s"]), ladder


def test_fig17_18_sensitivity(tmp_path):
    _run("fig17_18_sensitivity", tmp_path)
    df = _outputs(tmp_path, "fig17_18_sensitivity")
    assert {"model", "batch_size", "sweep", "value", "system", "decode_tokens_per_s", "cache_ratio", "prefetch.k",
            "cache.w", "cache.u", "decode_rel_first"} <= set(df.columns)
    assert set(df.sweep) == {"cache_ratio", "k", "window"}
    assert set(df[df.sweep == "cache_ratio"].system) == {"dali", "dali-plus", "lower-bound"}
    assert set(df[df.sweep != "cache_ratio"].system) == {"dali", "dali-plus"}
    assert (df.decode_tokens_per_s > 0).all() and np.isfinite(df.decode_tokens_per_s).all()
    assert df.loc[df.system == "lower-bound", "bound"].all() and not df.loc[df.system != "lower-bound", "bound"].any()
    ks = df[df.sweep == "k"]
    assert sorted(set(ks["prefetch.k"])) == [1, 4] and set(ks.cache_ratio) == {0.5}
    win = df[df.sweep == "window"]
    assert set(zip(win["cache.w"], win["cache.u"])) == {(2, 1), (2, 4), (4, 1), (4, 4)}
    # more cache is never less hit rate for the same system; the bound is above every system at each ratio
    cr = df[(df.sweep == "cache_ratio") & (df.system != "lower-bound")].sort_values("cache_ratio")
    for _, g in cr.groupby("system"):
        assert (np.diff(g.hit_rate.to_numpy()) >= -1e-12).all()
    r = df[df.sweep == "cache_ratio"]
    bound = r[r.system == "lower-bound"].set_index("cache_ratio").decode_tokens_per_s
    assert (r.decode_tokens_per_s.to_numpy() <= bound.reindex(r.cache_ratio).to_numpy() * (1 + 1e-9)).all()


def test_presets_vs_oracle(tmp_path):
    from dali_sim.policies import system_names

    _run("presets_vs_oracle", tmp_path)
    df = _outputs(tmp_path, "presets_vs_oracle")
    assert set(df.system) == set(system_names())  # every preset, against the bound
    oracle = df[df.system == "oracle-heuristic"]
    assert np.allclose(oracle.decode_of_oracle, 1.0) and np.allclose(oracle.prefill_of_oracle, 1.0)
    assert (df.decode_tokens_per_s > 0).all() and np.isfinite(df.decode_of_oracle).all()


def test_prefetch_accuracy_on_the_recorded_trace(tmp_path):
    """The shipped trace of the trained model: recall is a share, residual's inputs are closer to the
    true next gate input than next-gate's on average (the paper's finding, here on our model)."""
    _run("prefetch_accuracy", tmp_path)
    df = _outputs(tmp_path, "prefetch_accuracy")
    rec = df[df.metric == "recall"]
    assert set(rec.predictor) == {"next-gate", "residual"} and set(rec.batch_size) == {1, 4}
    assert ((rec.recall > 0) & (rec.recall <= 1)).all()
    cos = df[df.metric == "cosine"]
    mean = cos.groupby("predictor").apply(lambda d: np.average(d.cosine_mean, weights=d.tokens), include_groups=False)
    assert mean["residual"] > mean["next-gate"]


def test_prefetch_accuracy_matches_a_synthetic_predictor(tmp_path):
    """On a synthetic trace whose predictors have known top-k recall, batch-1 top-1 recall is that
    accuracy (within sampling error): the metric measures what it claims."""
    from dali_sim.trace.synth import SynthConfig, synthesize

    trace = tmp_path / "s.parquet"
    synthesize(SynthConfig("mixtral-8x7b", sequences=8, prompt_len=4, gen_len=40, seed=2,
                           lookahead=("residual=0.9", "next-gate=0.5")), trace)
    _run("prefetch_accuracy", tmp_path, "--trace", str(trace), "--hidden-trace", "")
    df = _outputs(tmp_path, "prefetch_accuracy")
    one = df[(df.batch_size == 1) & (df.k == 1)].set_index("predictor").recall
    assert abs(one["residual"] - 0.9) < 0.06 and abs(one["next-gate"] - 0.5) < 0.08


def test_recorded_trace(tmp_path):
    """Every preset on the routing recorded from the trained model, at one budget for all."""
    _run("recorded_trace", tmp_path)
    df = _outputs(tmp_path, "recorded_trace")
    assert set(df.system) == set(system_names()) and df.gpu_memory_gib.nunique() == 1
    ok = df[df.fits]
    assert {"dali", "dali-plus", "oracle-heuristic", "lower-bound"} <= set(ok.system)
    assert np.allclose(ok.loc[ok.system == "oracle-heuristic", "decode_vs_oracle"], 1.0)
    bound = ok.loc[ok.system == "lower-bound"].set_index("batch_size")["decode_tokens_per_s"]
    for _, g in ok.groupby("batch_size"):  # the time bound is never beaten
        assert (g["decode_tokens_per_s"] <= bound[g.batch_size.iloc[0]] * (1 + 1e-9)).all()
    assert (ok.decode_tokens_per_s > 0).all() and ok.loc[ok.system == "dali", "prefetch_precision"].gt(0).all()


def test_published_validation(tmp_path):
    """The published-measurement table: every row resolves (model, weights, machine, system, implementation)
    and the quick run simulates two rows, with their verdict against the band."""
    sys.path.insert(0, str(EXP))
    import published_validation as PV

    rows = PV.Row.load()
    assert len(rows) >= 10 and len({r.id for r in rows}) == len(rows)
    for r in rows:
        assert r.quote and r.url.startswith("https://") and r.published > 0
        r.synth()  # the model and weight format exist
        from dali_sim.hardware import load_profile
        from dali_sim.policies import resolve_system

        load_profile(r.hardware)
        resolve_system(r.system, r.overrides())
        assert r.commands("t.parquet").startswith("dali trace synth --model")
    _run("published_validation", tmp_path)
    df = pd.read_csv(tmp_path / "published_validation.csv")
    assert len(df) == 2 and (df["simulated_tok_s"] > 0).all()
    assert np.allclose(df["ratio"], df["simulated_tok_s"] / df["published_tok_s"])
    assert (df["in_band"] == df["ratio"].between(0.75, 1.33)).all()
    md = (tmp_path / "published_validation.md").read_text()
    assert "What this shows" in md and "dali trace synth" in md


def test_published_request_metric_and_bad_rows(tmp_path, monkeypatch):
    """metric = request (llmfit bench's rate) counts the prompt's time too: below the same row's decode rate;
    an unknown metric, or request without generated tokens, is a one-line error naming the row."""
    import dataclasses

    sys.path.insert(0, str(EXP))
    import published_validation as PV

    monkeypatch.setenv("DALI_EXP_CACHE", str(tmp_path / "cache"))
    row = next(r for r in PV.Row.load() if r.metric == "request")
    request = PV.simulate_row(row)["simulated_tok_s"]
    decode = PV.simulate_row(dataclasses.replace(row, metric="decode"))["simulated_tok_s"]
    assert 0 < request < decode
    text = (EXP / "published" / "rows.toml").read_text()
    start = text.index("\n[[row]]\n")
    first = text[start:text.index("\n[[row]]\n", start + 1)]
    for old, new, message in (('metric = "decode"', 'metric = "e2e"', "metric must be one of"),
                              ('metric = "decode"\n', 'metric = "request"\n', "request needs gen > 0")):
        bad = tmp_path / "rows.toml"
        body = first.replace(old, new).replace("gen = 128", "gen = 0")
        bad.write_text(body)
        with pytest.raises(ValueError, match=message) as err:
            PV.Row.load(bad)
        assert "lcpp16834-4090-gptoss20b-tg128" in str(err.value)


@pytest.mark.slow
def test_cpu_validation_quick(tmp_path):
    """The executor-vs-simulator script on the CPU device (quick: one shape, two layers, one repeat):
    every system validated, counters exact, load averages, the machine's drift and the verdict recorded."""
    _run("cpu_validation", tmp_path, "--shapes", "deepseek-v2-lite")
    df = pd.read_csv(tmp_path / "cpu_validation.csv")
    assert list(df["system"]) == ["cpu-only", "gpu-lru", "llamacpp", "hybrimoe", "dali", "moe-lightning-best"]
    assert df["counters_exact"].all() and (df["exec_s"] > 0).all() and (df["sim_s"] > 0).all()
    assert np.allclose(df["total_err"], df["sim_s"] / df["exec_s"] - 1)
    base = df.iloc[0]
    assert np.allclose(df["speedup_err"], (base.sim_s / df["sim_s"]) / (base.exec_s / df["exec_s"]) - 1)
    assert (df["load_before"] >= 0).all() and "validations pass" in (tmp_path / "cpu_validation.md").read_text()
    # the machine-speed probe: a reading before and after the repeat, the drift against the calibration's
    assert (df["probe_before_ms"] > 0).all() and (df["probe_after_ms"] > 0).all()
    assert np.allclose(df["machine_drift"], df["probe_after_ms"] / df["probe_before_ms"] - 1)  # (one repeat)
    assert np.allclose(df["overlap_drift"], df["overlap_after"] / df["overlap_before"] - 1)
