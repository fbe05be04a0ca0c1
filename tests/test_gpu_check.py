"""scripts/gpu_check.sh: its arguments and dry run (fast), one workload on the CPU (a few seconds), and the
whole quick CPU mode with simpy, click and tqdm importable only from the carried wheels (slow)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

#: a sitecustomize that hides simpy, click and tqdm unless they come from the carried wheels (as on a
#: machine whose Python lacks them); BLOCK_PIP hides pip too (the zip-import fallback)
BLOCKER = '''
import importlib.abc, os, sys
BLOCK = {"simpy", "click", "tqdm"} | ({"pip"} if os.environ.get("BLOCK_PIP") else set())
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in BLOCK:
            return None
        for f in sys.meta_path:
            if f is self or not hasattr(f, "find_spec"):
                continue
            spec = f.find_spec(name, path, target)
            if spec is not None:
                where = str(spec.origin or "") + str(list(spec.submodule_search_locations or []))
                if "dali-site" in where or ".whl" in where:
                    return spec
                raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")
        return None
sys.meta_path.insert(0, _Block())
'''


def _run(*args, env=None, timeout=600):
    e = {**os.environ, **(env or {})}
    e.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=e, timeout=timeout,
                          cwd=REPO)


def test_help_and_bad_arguments():
    r = _run("--help")
    assert r.returncode == 0 and "--device cuda|cpu" in r.stdout and "Exit status" in r.stdout
    for args, message in ((["--device", "tpu"], "--device must be cuda or cpu"),
                          (["--bogus"], "unknown argument '--bogus'"),
                          (["--out"], "--out needs a value"),
                          (["--budget", "ten"], "--budget must be a whole number"),
                          (["--max-total-error", "x"], "--max-total-error must be a number"),
                          (["--workloads", "llama"], "unknown workload 'llama'"),
                          (["--python", "/no/such/python"], "no python3 found")):
        r = _run(*args)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)


def test_an_old_torch_is_refused_up_front(tmp_path):
    """A torch older than 2.5 (no enable_gqa in scaled_dot_product_attention) stops the check before anything
    runs, naming the version, exit status 2; so does a torch that cannot be imported."""
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "2.4.1+cu121"\n')
    env = {"PYTHONPATH": str(tmp_path / "site")}
    r = _run("--device", "cpu", "--quick", "--dry-run", "--python", sys.executable, env=env)
    assert r.returncode == 2 and "has torch 2.4.1+cu121; the executor needs torch >= 2.5" in r.stderr, r.stderr
    (fake / "__init__.py").write_text('raise ImportError("broken build")\n')
    r = _run("--device", "cpu", "--quick", "--dry-run", "--python", sys.executable, env=env)
    assert r.returncode == 2 and "cannot import torch: ImportError: broken build" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    r = _run("--device", "cpu", "--quick", "--dry-run", "--out", str(out), "--python", sys.executable)
    assert r.returncode == 0, r.stderr
    cmds = [line for line in r.stderr.splitlines() if line.startswith("+ ")]
    synth = [c for c in cmds if " trace synth " in c]
    validate = [c for c in cmds if " exec validate " in c]
    assert len(synth) == 2 and "--model mixtral-8x7b" in synth[0] and "--model deepseek-v2-lite" in synth[1]
    assert all("residual=0.9" in c and "gate3=0.5@3" in c for c in synth)
    assert len(validate) == 2 and all("--device cpu" in c and "--time-budget" in c and "--replays 3" in c for c in validate)
    assert "--gpu-memory 24" in validate[0] and "--gpu-memory 12" in validate[1]
    assert re.search(r"--systems cpu-only\\?,gpu-lru\\?,dali", validate[0])
    assert any("gpu_check_summary.py" in c for c in cmds)
    assert not any(" -m pytest " in c for c in cmds)  # (only with --tests)
    runtime = [c for c in cmds if "benchmarks/" in c]
    assert [c.split("benchmarks/")[1].split()[0] for c in runtime] == ["cold_host.py", "exec_overhead.py",
                                                                      "generate_speed.py"]
    assert "budget 300 s" in r.stdout and not out.exists()
    full = _run("--dry-run", "--device", "cpu", "--python", sys.executable, "--workloads", "deepseek")
    assert "--scale 1 --layers 6" in full.stderr and "mixtral" not in full.stderr
    cuda = _run("--dry-run", "--python", sys.executable, "--workloads", "deepseek", "--tests")  # (needs no GPU)
    assert re.search(r"^\+ timeout .* -m pytest -m gpu .*tests/test_exec_gpu\.py", cuda.stderr, re.M)
    runtime = [c for c in cuda.stderr.splitlines() if c.startswith("+ ") and "benchmarks/" in c]
    assert [c.split("benchmarks/")[1].split()[0] for c in runtime] == ["cold_host.py", "cuda_host_calls.py",
                                                                      "exec_overhead.py", "exec_overhead.py",
                                                                      "generate_speed.py"]
    assert all("--device cuda" in c for c in runtime[2:])
    assert "--sync-sites" in runtime[2] and "--sync-sites" not in runtime[3]


def _check_outputs(out: Path, workloads: list[str], systems: list[str]):
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files), files
    assert {"summary.md", "summary.csv", "per_step.csv", "log.txt"} <= set(files)
    assert {f"{w}.png" for w in workloads} <= set(files)
    csv = pd.read_csv(out / "summary.csv")
    assert list(csv["workload"].unique()) == workloads and list(csv["system"][:len(systems)]) == systems
    assert csv["exact"].all()
    log = (out / "log.txt").read_text()
    table = log[log.rindex("| workload"):]  # the summary table is the last thing printed
    assert table.count("\n") == len(csv) + 2  # header, rule, one line per system


def test_one_workload_runs_on_the_cpu(tmp_path):
    """A loose threshold passes (tiny quick shapes are not a validation); a zero one fails, printing FAIL."""
    out = tmp_path / "out"
    r = _run("--device", "cpu", "--quick", "--workloads", "mixtral", "--systems", "gpu-lru", "--max-total-error", "100",
             "--out", str(out), "--work", str(tmp_path / "work"), "--python", sys.executable, "--tests")
    assert r.returncode == 0, r.stdout + r.stderr
    _check_outputs(out, ["mixtral"], ["gpu-lru"])
    assert r.stdout.rstrip().splitlines()[-1].startswith("| mixtral  | gpu-lru")
    summary = (out / "summary.md").read_text()
    assert "## Verdict\n\nOK" in summary
    # --tests ran the GPU tests first: without CUDA each skips, which passes
    assert "- tests: `python -m pytest -m gpu` exited 0 after" in summary and " skipped" in r.stdout
    assert "- mixtral: WARNING the expert weights a replay step reads" in summary  # (quick shapes fit the host's cache)
    r = _run("--device", "cpu", "--quick", "--workloads", "mixtral", "--systems", "gpu-lru", "--max-total-error", "0",
             "--out", str(tmp_path / "out0"), "--work", str(tmp_path / "work0"), "--python", sys.executable)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.rstrip().splitlines()[-1].startswith("FAIL mixtral: gpu-lru: total time error")
    failed = (tmp_path / "out0" / "summary.md").read_text()
    assert "## Verdict\n\nFAIL" in failed
    assert "- mixtral: `dali exec validate` exited 1 (the verdict failed: below)" in failed  # (not a time limit)


@pytest.mark.slow
@pytest.mark.parametrize("block_pip", [False, True])
def test_quick_cpu_mode_with_carried_wheels(tmp_path, block_pip):
    """The whole quick mode (about 30 s on 2 cores), with simpy, click and tqdm hidden from the
    interpreter unless they come from scripts/wheels (installed by pip, or imported from the zip files)."""
    (tmp_path / "blocker").mkdir()
    (tmp_path / "blocker" / "sitecustomize.py").write_text(BLOCKER)
    py = tmp_path / "python3"
    py.write_text(f'#!/bin/bash\nexport PYTHONPATH={tmp_path}/blocker${{PYTHONPATH:+:$PYTHONPATH}}\n'
                  f'exec {sys.executable} "$@"\n')
    py.chmod(0o755)
    env = {"DALI_SITE": str(tmp_path / "dali-site"), **({"BLOCK_PIP": "1"} if block_pip else {})}
    assert subprocess.run([str(py), "-c", "import simpy"], capture_output=True, env={**os.environ, **env}).returncode
    out = tmp_path / "out"
    r = _run("--device", "cpu", "--quick", "--max-total-error", "100", "--order-margin", "100", "--out", str(out),
             "--python", str(py), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    systems = ["cpu-only", "gpu-lru", "dali", "llamacpp", "ktransformers", "hybrimoe", "dali-plus"]
    _check_outputs(out, ["mixtral", "deepseek"], systems)
    assert "carried wheels for: simpy click tqdm" in r.stdout
    assert (tmp_path / "dali-site" / "simpy").is_dir() != block_pip
    assert {"mixtral-dali.exec.timeline.json", "mixtral-dali.sim.timeline.json"} <= {p.name for p in out.iterdir()}


@pytest.mark.parametrize("rc,why", [(1, "a test failed"), (124, "stopped by the time limit"),
                                    (137, "killed after the time limit")])
def test_a_failed_tests_step_fails_the_verdict_and_says_why(tmp_path, rc, why):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_summary", REPO / "scripts" / "gpu_check_summary.py")
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    (work / "status.txt").write_text(f"tests {rc} 150\n")
    assert summary.main(["--work", str(work), "--out", str(out), "--workloads", ""]) == 1
    text = (out / "summary.md").read_text()
    assert "## Verdict\n\nFAIL" in text and f"FAIL tests: `python -m pytest -m gpu` exited {rc} ({why}; see log.txt)" in text
