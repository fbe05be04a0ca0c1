"""`dali sweep`: spec checks, the result store (resume, failures, interrupts, determinism), the engines
(this process, worker processes, Ray) and the report."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from conftest import REPO
from dali_sim.cli.main import cli
from dali_sim.sim.simulate import simulate
from dali_sim.sweep.engines import LocalEngine, SerialEngine
from dali_sim.sweep.run import run_sweep
from dali_sim.sweep.spec import load_spec

SMOKE = REPO / "tests" / "data" / "sweep_smoke.toml"
RECIPE = ('synth = { model = "switch-base-8", sequences = 4, prompt_len = 8, gen_len = 8, seed = 1, '
          'lookahead = ["residual=0.9"] }')


def write_spec(folder: Path, body: str, name: str = "spec.toml", recipe: str = RECIPE) -> Path:
    path = folder / name
    path.write_text(f"{body.strip()}\n\n[traces.tiny]\n{recipe}\n" if "[traces" not in body else body)
    return path


def run(spec, out, engine=None, **kw):
    return run_sweep(spec, out, lambda: engine or SerialEngine(), progress=False, log=lambda m: None, **kw)


def table(out) -> pd.DataFrame:
    return pd.read_parquet(Path(out) / "results.parquet")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smoke") / "out"
    run(SMOKE, out)
    return out


# ---- the spec ------------------------------------------------------------------------------------
BAD_SPECS = [
    ('systems = ["gpu-lru", "nosuch"]', r"systems: unknown system 'nosuch'"),
    ('systems = ["gpu-lru"]\n[grid]\nbatch_sizes = [1]', r"grid.batch_sizes: unknown grid key"),
    ('systems = ["gpu-lru"]\n[grid]\nbatch_size = [0, 2]', r"grid.batch_size: 0: expected an integer >= 1"),
    ('systems = ["gpu-lru"]\n[grid]\nbatch_size = [2, 2]', r"grid.batch_size: a value is listed twice"),
    ('systems = ["gpu-lru"]\n[grid]\ncache_ratio = [1.5]', r"grid.cache_ratio: 1.5: expected a number in \[0, 1\]"),
    ('systems = ["gpu-lru", "dali"]\n[grid]\n"dali:prefetch.k" = ["many"]',
     r'grid."dali:prefetch.k": prefetch.k: cannot read \'many\' as int'),
    ('systems = ["gpu-lru"]\n[grid]\n"dali:prefetch.k" = [1]', r"system 'dali' is not one of the systems"),
    ('systems = ["gpu-lru", "dali"]\n[grid]\n"prefetch.k" = [1]', r'grid."prefetch.k": unknown parameter prefetch.k'),
    ('systems = ["gpu-lru"]\nset = ["cache.nope=1"]', r"set: unknown parameter cache.nope"),
    ('systems = ["gpu-lru"]\nbatch = 4', r"batch: unknown key"),
    ('systems = ["gpu-lru"]\nhardware = ["no-such-gpu"]', r"hardware\[0\]: unknown hardware profile"),
    ('systems = ["gpu-lru"]\nbaseline = "dali"', r"baseline: 'dali' is not one of the systems"),
    ('systems = ["gpu-lru", "lower-bound"]\ntiming = false', r"timing: system 'lower-bound' is a time bound"),
    ('systems = ["gpu-lru" ', r"not valid TOML"),
    ('systems = ["gpu-lru"]\nprofile_share = 1.0', r"profile_share: profile share must be a number in \[0, 1\)"),
]


@pytest.mark.parametrize("body,message", BAD_SPECS, ids=[m.split(":")[0] for _, m in BAD_SPECS])
def test_spec_errors_are_one_line_naming_the_file_and_key_before_anything_runs(tmp_path, body, message):
    spec = write_spec(tmp_path, body)
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["sweep", str(spec), "-o", str(out), "--workers", "1"])
    assert r.exit_code == 1, r.output
    line = r.output.strip()
    assert "\n" not in line and line.startswith(f"Error: {spec}: ") and re.search(message, line), line
    assert not out.exists()  # nothing synthesised, nothing written


def test_trace_errors_name_the_trace_key(tmp_path):
    cases = [('[traces.t]\npath = "missing.parquet"', "traces.t.path: .*missing.parquet: no such file"),
             ('[traces.t]\nsynth = { model = "switch-base-8", sequence = 4 }',
              "traces.t.synth.sequence: not an argument of dali trace synth"),
             ('[traces.t]\nsynth = { model = "no-model" }', "traces.t.synth: unknown model"),
             ('[traces.t]\npath = "a.parquet"\nsynth = { model = "switch-base-8" }', "traces.t: give exactly one of"),
             (f'[traces.t]\npath = "{REPO}/traces/gpt-oss-20b.parquet"',
              r"traces.t: system 'dali' reads the lookahead column\(s\) \['residual'\], which this trace lacks")]
    for body, message in cases:
        spec = write_spec(tmp_path, 'systems = ["gpu-lru", "dali"]\n' + body)
        with pytest.raises(ValueError, match=f"^{re.escape(str(spec))}: {message}"):
            load_spec(spec)


def test_the_spec_expands_in_its_order_with_per_system_keys(tmp_path):
    spec = load_spec(SMOKE)
    assert len(spec.runs) == 2 * 2 * (1 + 1 + 2)  # batch x ratio x (gpu-lru, llamacpp, dali x its k)
    first = spec.runs[:4]
    assert [r.system for r in first] == ["gpu-lru", "llamacpp", "dali", "dali"]
    assert [r.grid["dali:prefetch.k"] for r in first] == [None, None, 1, 2]
    assert first[3].overrides["prefetch"] == {"k": "2"} and first[0].overrides == {"memory": {"cache_ratio": "0.25"}}
    assert [(r.batch_size, r.grid["cache_ratio"]) for r in spec.runs[::4]] == [(1, 0.25), (1, 0.5), (2, 0.25), (2, 0.5)]
    assert first[2].predictors == ("residual",) and not first[0].predictors


def test_a_trace_can_have_its_own_values_of_a_grid_key(tmp_path):
    """``[traces.NAME] grid = {...}`` replaces a grid key's values for that trace only (each batch size on a
    trace of its own size; a model's own parameter values); a key absent from [grid] is refused."""
    body = ('systems = ["gpu-lru"]\n[grid]\nbatch_size = [1, 2]\ncache_ratio = [0.25, 0.5]\n'
            f'[traces.small]\n{RECIPE}\ngrid = {{ batch_size = [1] }}\n[traces.big]\n{RECIPE}\n')
    spec = load_spec(write_spec(tmp_path, body))
    assert [(r.trace, r.batch_size, r.grid["cache_ratio"]) for r in spec.runs] == [
        ("small", 1, 0.25), ("small", 1, 0.5),
        ("big", 1, 0.25), ("big", 1, 0.5), ("big", 2, 0.25), ("big", 2, 0.5)]
    own = body.replace("[grid]\n", '[grid]\n"gpu-lru:cache.policy" = ["lru"]\n').replace(
        "grid = { batch_size = [1] }", 'grid = { batch_size = [1], "gpu-lru:cache.policy" = ["lfu", "lru"] }')
    runs = load_spec(write_spec(tmp_path, own, name="own.toml")).runs
    assert [(r.trace, r.overrides["cache"]["policy"]) for r in runs if r.grid["cache_ratio"] == 0.25] == [
        ("small", "lfu"), ("small", "lru"), ("big", "lru"), ("big", "lru")]
    for own, message in (("seed = [1]", r"traces.small.grid.seed: not a key of \[grid\]"),
                         ('"gpu-lru:cache.policy" = ["lfu"]', r'traces.small.grid."gpu-lru:cache.policy": not a key'),
                         ("batch_size = [0]", r"traces.small.grid.batch_size: 0: expected an integer >= 1")):
        bad = write_spec(tmp_path, body.replace("grid = { batch_size = [1] }", f"grid = {{ {own} }}"), name="b.toml")
        with pytest.raises(ValueError, match=f"^{re.escape(str(bad))}: {message}"):
            load_spec(bad)


def test_the_profiling_split_is_part_of_a_configuration(tmp_path):
    """``profile_share`` splits every trace as `dali sim --profile-share` does: the stored rows are the runs
    simulate() gives with that split, and another share is another configuration (another hash)."""
    from dali_sim.workload.profiling import ProfileSpec

    spec = write_spec(tmp_path, 'systems = ["gpu-static", "gpu-lru"]\nprofile_share = 0.5\n[grid]\ncache_ratio = [0.25]')
    run(spec, tmp_path / "out")
    df = table(tmp_path / "out")
    assert (df["status"] == "ok").all() and (df["profile_share"] == 0.5).all()
    assert (df["sequences"] == 2).all()  # 4 sequences: the first 2 profile
    trace = tmp_path / "out" / "traces" / "tiny.parquet"
    for _, row in df.iterrows():
        r = simulate(trace, row["system"], overrides=json.loads(row["overrides"]), profiling=ProfileSpec(share=0.5))
        assert row["hit_rate"] == r.summary["hit_rate"] and row["decode_tokens_per_s"] == r.summary["decode_tokens_per_s"]
    default = load_spec(write_spec(tmp_path, 'systems = ["gpu-static"]\n[grid]\ncache_ratio = [0.25]', name="d.toml"))
    halves = load_spec(spec)
    assert default.runs[0].profile_share == 0.25 and default.runs[0].hash != halves.runs[0].hash


# ---- results -------------------------------------------------------------------------------------
def test_every_row_is_the_run_simulate_gives(smoke):
    """Each row equals a direct simulate() of its configuration (the worker shares one workload per trace
    and batching across systems: that must not change anything)."""
    from dali_sim.cli.sim_compare import slots_text

    df = table(smoke)
    assert len(df) == 16 and (df["status"] == "ok").all() and df["config_hash"].is_unique
    trace = smoke / "traces" / "tiny.parquet"
    for _, row in df.iterrows():
        over = json.loads(row["overrides"])
        r = simulate(trace, row["system"], batch_size=int(row["batch_size"]), overrides=over)
        for metric in ("decode_tokens_per_s", "prefill_s", "hit_rate", "prefetch_issued", "bytes_h2d", "busy_pcie"):
            want = r.summary["busy"]["pcie"] if metric == "busy_pcie" else r.summary[metric]
            assert row[metric] == pytest.approx(want, rel=0, abs=0), (row["system"], metric)
        assert row["cache_slots"] == slots_text(r.manifest["memory"]["cache_slots_per_layer"])
    manifest = json.loads((smoke / "manifests" / f"{df['config_hash'][2]}.json").read_text())
    assert manifest["status"] == "ok" and manifest["run"]["system"] == "dali" and manifest["config"]["batch_size"] == 1
    assert manifest["manifest"]["trace_sha256"] == df["trace_sha256"][2]


def test_results_carry_every_metric_and_the_resolved_config(smoke):
    from dali_sim.sweep.store import CONFIG_COLUMNS, METRIC_COLUMNS

    df = table(smoke)
    assert list(df.columns[:len(CONFIG_COLUMNS)]) == list(CONFIG_COLUMNS)
    assert list(df.columns[-len(METRIC_COLUMNS):]) == list(METRIC_COLUMNS)
    assert {"cache_ratio", "dali:prefetch.k", "overrides", "system_config"} <= set(df.columns)
    dali = df[df["system"] == "dali"].iloc[1]
    assert json.loads(dali["system_config"])["prefetch"]["k"] == 2 and dali["dali:prefetch.k"] == 2
    assert df["precision"].eq("bf16").all() and df["model"].eq("switch-base-8").all()


def test_same_spec_same_table_with_any_engine(smoke, tmp_path):
    run(SMOKE, tmp_path / "serial")
    run(SMOKE, tmp_path / "pool", LocalEngine(2))
    pd.testing.assert_frame_equal(table(tmp_path / "serial"), table(smoke))
    pd.testing.assert_frame_equal(table(tmp_path / "pool"), table(smoke))


def test_a_rerun_skips_what_is_stored_and_a_larger_spec_runs_only_the_new(smoke, tmp_path):
    out = tmp_path / "out"
    small = write_spec(tmp_path, SMOKE.read_text().replace("batch_size = [1, 2]", "batch_size = [1]"), "small.toml")
    first = run(small, out)
    assert (first.ran, first.stored) == (8, 0)
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "manifests").iterdir()}
    again = run(small, out)
    assert (again.ran, again.stored) == (0, 8)
    full = run(SMOKE, out)
    assert (full.ran, full.stored) == (8, 8)
    assert all((out / "manifests" / name).stat().st_mtime_ns == t for name, t in stamps.items())  # not rerun
    pd.testing.assert_frame_equal(table(out), table(smoke))  # the same table as one run, in the spec's order
    # a smaller spec again: the rows it no longer names are kept (after its own)
    run(small, out)
    df = table(out)
    assert len(df) == 16 and list(df["batch_size"]) == [1] * 8 + [2] * 8


def test_a_failing_configuration_is_recorded_and_the_sweep_goes_on(tmp_path):
    spec = write_spec(tmp_path, 'systems = ["gpu-lru", "llamacpp"]\n[grid]\ngpu_memory = [0.01, 24]')
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["sweep", str(spec), "-o", str(out), "--workers", "1", "-q"])
    assert r.exit_code == 0, r.output
    assert "2 configurations failed" in r.output
    df = table(out)
    assert list(df["status"]) == ["error", "error", "ok", "ok"]
    assert df["error"][0].startswith("ValueError: GPU memory budget 0.01 GiB cannot hold") and df["error"][2] == ""
    assert np.isnan(df["hit_rate"][0]) and df["hit_rate"][2] > 0
    manifest = json.loads((out / "manifests" / f"{df['config_hash'][0]}.json").read_text())
    assert manifest["status"] == "error" and "Traceback" in manifest["traceback"]
    summary = run(spec, out)
    assert (summary.ran, summary.stored) == (0, 4)  # failures are stored results too
    summary = run(spec, out, retry_failed=True)
    assert (summary.ran, summary.failed, summary.stored) == (2, 2, 2)


def test_a_recipe_trace_is_made_once_and_a_changed_recipe_refused(smoke, tmp_path):
    out = tmp_path / "out"
    spec = write_spec(tmp_path, 'systems = ["gpu-lru"]')
    run(spec, out)
    made = (out / "traces" / "tiny.parquet").stat().st_mtime_ns
    assert (out / "traces" / "tiny.parquet").read_bytes() == (smoke / "traces" / "tiny.parquet").read_bytes()
    run(write_spec(tmp_path, 'systems = ["gpu-lru", "llamacpp"]'), out)
    assert (out / "traces" / "tiny.parquet").stat().st_mtime_ns == made
    changed = write_spec(tmp_path, 'systems = ["gpu-lru"]', recipe=RECIPE.replace("seed = 1", "seed = 2"))
    with pytest.raises(ValueError, match=r"traces.tiny.synth: .*tiny.parquet was synthesised from another recipe"):
        run(changed, out)


class InterruptedEngine(SerialEngine):
    """Ctrl-C after ``after`` configurations (as the user would press it mid-sweep)."""

    def __init__(self, after: int):
        self.after = after

    def run(self, tasks):
        for i, outcome in enumerate(super().run(tasks)):
            if i == self.after:
                raise KeyboardInterrupt
            yield outcome


def test_ctrl_c_keeps_what_finished_and_a_rerun_runs_only_the_rest(smoke, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run(SMOKE, out, InterruptedEngine(after=5), save_every=1e9)  # never saved before the interrupt
    done = table(out)
    assert len(done) == 5 and (done["status"] == "ok").all() and not list(out.rglob("*.partial"))
    rest = run(SMOKE, out)
    assert (rest.stored, rest.ran) == (5, 11)
    pd.testing.assert_frame_equal(table(out), table(smoke))


@pytest.mark.slow
def test_sigterm_keeps_what_finished_and_a_rerun_finishes_the_rest(tmp_path):
    """A sweep on worker processes killed mid-way: a complete results file of finished configurations, no
    temporary files, exit code 143; rerun, only the missing configurations run."""
    out = tmp_path / "out"
    recipe = RECIPE.replace("gen_len = 8", "gen_len = 96").replace("sequences = 4", "sequences = 8")  # 6 evaluated
    spec = write_spec(tmp_path, SMOKE.read_text().replace("batch_size = [1, 2]", "batch_size = [1, 2, 3, 4, 5, 6]")
                      .replace(RECIPE, recipe), "long.toml")
    proc = subprocess.Popen([sys.executable, "-m", "dali_sim", "sweep", str(spec), "-o", str(out), "--workers", "2",
                             "--save-every", "0", "-q"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (out / "results.parquet").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 143, output
    assert "interrupted:" in output and "rerun the same command" in output
    done = table(out)
    assert 0 < len(done) < 48 and (done["status"] == "ok").all()
    assert not list(out.rglob("*.partial"))
    rest = run(spec, out)
    assert (rest.stored, rest.ran) == (len(done), 48 - len(done))
    fresh = tmp_path / "fresh"
    shutil.copytree(out / "traces", fresh / "traces")
    run(spec, fresh)
    pd.testing.assert_frame_equal(table(out), table(fresh))


# ---- engines -------------------------------------------------------------------------------------
def test_ray_is_optional(tmp_path):
    """dali imports and sweeps without ray; --ray without it is a one-line error."""
    code = ("import sys, importlib.abc\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'ray' or name.startswith('ray.'): raise ImportError('no ray here')\n"
            "sys.meta_path.insert(0, Block())\n"
            "from dali_sim.cli.main import cli\n"
            "import dali_sim.sweep.engines, dali_sim.sweep.run\n"
            "cli(sys.argv[1:])\n")
    spec = write_spec(tmp_path, 'systems = ["gpu-lru"]')
    r = subprocess.run([sys.executable, "-c", code, "sweep", str(spec), "-o", str(tmp_path / "out"), "--ray", "auto"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.strip() == (
        "Error: --ray needs Ray, which is not installed; install the ray extra: pip install -e '.[ray]'"), r.stderr
    r = subprocess.run([sys.executable, "-c", code, "sweep", str(spec), "-o", str(tmp_path / "out2"), "--workers", "1",
                        "-q"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and "done: 1 configurations run" in r.stderr, r.stderr


@pytest.mark.slow
def test_local_ray_gives_the_same_table(smoke, tmp_path):
    ray = pytest.importorskip("ray")
    from dali_sim.sweep.engines import RayEngine

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        run(SMOKE, tmp_path / "ray", RayEngine())
        assert ray.is_initialized()  # a Ray the caller started is left running
    finally:
        ray.shutdown()
    pd.testing.assert_frame_equal(table(tmp_path / "ray"), table(smoke))


def test_default_workers_is_every_usable_core():
    from dali_sim.sweep.engines import default_workers, make_engine

    assert default_workers() == len(os.sched_getaffinity(0))
    assert isinstance(make_engine(1), SerialEngine) and make_engine(3).slots == 3


def test_make_tasks(smoke):
    import dataclasses

    from dali_sim.sweep.run import make_tasks

    spec = load_spec(SMOKE)
    path = str(smoke / "traces" / "tiny.parquet")
    runs = [dataclasses.replace(r, trace_path=path) for r in spec.runs]
    tasks = make_tasks(runs, runs, slots=1)
    assert [len(t.runs) for t in tasks] == [4, 4, 4, 4]
    assert all(len({(r.batch_size, r.prefill_chunk) for r in t.runs}) == 1 for t in tasks)
    assert [t.batch_size for t in tasks] == [1, 1, 2, 2]  # batch 1 has more steps: first
    assert all(t.needs.predictors == ("residual",) for t in tasks)
    assert sorted(r.index for t in tasks for r in t.runs) == list(range(16))
    assert len(make_tasks(runs, runs, slots=8)) == 16


# ---- report --------------------------------------------------------------------------------------
def test_report_tables_figures_and_page(smoke, tmp_path):
    report = tmp_path / "report"
    r = CliRunner().invoke(cli, ["sweep", "report", str(smoke), "-o", str(report)])
    assert r.exit_code == 0, r.output
    df = table(smoke)
    tab = pd.read_csv(report / "tables" / "decode_tokens_per_s.csv", index_col=[0, 1])
    assert tab.index.names == ["cache_ratio", "batch_size"]
    assert list(tab.columns) == ["dali (prefetch.k=1)", "dali (prefetch.k=2)", "gpu-lru", "llamacpp"]
    cell = df[(df.system == "dali") & (df.batch_size == 2) & (df.cache_ratio == 0.5) & (df["dali:prefetch.k"] == 2)]
    assert tab.loc[(0.5, 2), "dali (prefetch.k=2)"] == pytest.approx(cell["decode_tokens_per_s"].item())
    speed = pd.read_csv(report / "tables" / "decode_tokens_per_s_speedup_over_llamacpp.csv", index_col=[0, 1])
    base = df[(df.system == "llamacpp") & (df.batch_size == 2) & (df.cache_ratio == 0.5)]["decode_tokens_per_s"].item()
    assert speed.loc[(0.5, 2), "dali (prefetch.k=2)"] == pytest.approx(cell["decode_tokens_per_s"].item() / base)
    assert (speed["llamacpp"] == 1).all()
    makespan = pd.read_csv(report / "tables" / "makespan_s_speedup_over_llamacpp.csv", index_col=[0, 1])
    gpu_lru = df[(df.system == "gpu-lru") & (df.batch_size == 1) & (df.cache_ratio == 0.25)]["makespan_s"].item()
    lcpp = df[(df.system == "llamacpp") & (df.batch_size == 1) & (df.cache_ratio == 0.25)]["makespan_s"].item()
    assert makespan.loc[(0.25, 1), "gpu-lru"] == pytest.approx(lcpp / gpu_lru)  # times: baseline / system
    pngs = sorted(p.name for p in (report / "figures").iterdir())
    assert "decode_tokens_per_s.png" in pngs and all((report / "figures" / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)
    page = (report / "index.html").read_text()
    assert page.count('src="data:image/png;base64,') == len(pngs) and "speedup over llamacpp" in page
    assert f"{tab.loc[(0.5, 2), 'gpu-lru']:,.4g}" in page


def test_report_pivots_by_any_two_keys(smoke, tmp_path):
    r = CliRunner().invoke(cli, ["sweep", "report", str(smoke), "-o", str(tmp_path / "r"), "--index", "cache_ratio",
                                 "--columns", "batch_size", "--metric", "hit_rate", "--baseline", "gpu-lru"])
    assert r.exit_code == 0, r.output
    tab = pd.read_csv(tmp_path / "r" / "tables" / "hit_rate.csv", index_col=[0, 1, 2], dtype={"dali:prefetch.k": str})
    assert tab.index.names == ["system", "dali:prefetch.k", "cache_ratio"] and list(tab.columns) == ["1", "2"]
    df = table(smoke)
    for system, k, ratio, batch in (("gpu-lru", "-", 0.25, 2), ("dali", "2", 0.5, 1), ("dali", "1", 0.25, 2)):
        rows = df[(df.system == system) & (df.cache_ratio == ratio) & (df.batch_size == batch)]
        if k != "-":
            rows = rows[rows["dali:prefetch.k"] == int(k)]
        assert tab.loc[(system, k, ratio), str(batch)] == pytest.approx(rows["hit_rate"].item())
    bad = CliRunner().invoke(cli, ["sweep", "report", str(smoke), "--index", "nokey"])
    assert bad.exit_code == 1 and "--index 'nokey': not a grid key" in bad.output


def test_future_readers_and_the_time_bound(tmp_path):
    """Policies that read next-use times get them from the task's workload (no enrich file needed), with
    the results of a run on the `dali trace enrich` file; the time bound's counters are null."""
    from dali_sim.runtime.future import write_future
    from dali_sim.trace import read_trace
    from dali_sim.workload.builder import WorkloadConfig

    spec = write_spec(tmp_path, 'systems = ["gpu-lru", "oracle-heuristic", "lower-bound"]\n'
                                'set = ["gpu-lru:cache.policy=belady"]\n[grid]\nbatch_size = [2]')
    out = tmp_path / "out"
    run(spec, out)
    df = table(out).set_index("system")
    assert (df["status"] == "ok").all() and df.loc["gpu-lru", "oracles"] == "cache=belady"
    trace = out / "traces" / "tiny.parquet"
    write_future(read_trace(trace), WorkloadConfig(2), tmp_path / "f.parquet")
    for system, over in (("gpu-lru", {"cache": {"policy": "belady"}}), ("oracle-heuristic", None)):
        r = simulate(trace, system, batch_size=2, overrides=over, future=tmp_path / "f.parquet")
        assert df.loc[system, "hit_rate"] == r.summary["hit_rate"] and df.loc[system, "makespan_s"] == r.summary["makespan_s"]
    bound = df.loc["lower-bound"]
    assert bound["bounds"] == "time=lower-bound" and pd.isna(bound["hits"]) and bound["makespan_s"] > 0


def test_workers_run_this_dali_wherever_the_sweep_starts(smoke, tmp_path):
    """Worker processes import the dali the command runs, even from a folder holding another dali_sim (a
    checkout): they are spawned with this process's import path."""
    (tmp_path / "dali_sim").mkdir()
    (tmp_path / "dali_sim" / "__init__.py").write_text('"""Another dali_sim, without the sweep."""\n')
    dali = Path(sys.executable).with_name("dali")
    r = subprocess.run([str(dali), "sweep", str(SMOKE), "-o", str(tmp_path / "out"), "--workers", "2", "-q"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and "(0 failed)" in r.stderr, r.stderr[-2000:]
    pd.testing.assert_frame_equal(table(tmp_path / "out"), table(smoke))
