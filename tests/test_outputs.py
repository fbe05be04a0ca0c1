"""Nothing lost: outputs that would destroy an input or cannot be written are refused before any work,
writers never share a temporary file, and SIGTERM, a full disk or a crash leave nothing half-written."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_rows, tiny_model
from dali_sim.cli.main import cli
from dali_sim.files import PathError, atomic_output, check_output
from dali_sim.trace import TraceWriter, read_trace
from dali_sim.trace.synth import SynthConfig, synthesize

SMALL_SYNTH = ["--model", "mixtral-8x7b", "--sequences", "2", "--prompt-len", "4", "--gen-len", "4", "-q"]


def dali(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def refused(result, path, code: int = 1) -> str:
    """A one-line error naming ``path``, exit code 1 (2: refused by click's own path checks)."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("Error: ") and str(path) in lines[-1], result.output
    return lines[-1]


@pytest.fixture
def trace(tmp_path) -> Path:
    path = tmp_path / "t.parquet"
    # 3 sequences: the default profiling split leaves 2 evaluated, a batch of 2
    synthesize(SynthConfig("mixtral-8x7b", sequences=3, prompt_len=4, gen_len=4), path, progress=False)
    return path


def gpt_oss_json(path: Path, tokens: int = 3, prompt: int = 2) -> Path:
    """A minimal GPT-OSS-MoE-ExpertFingerprinting generation: 24 layers, top-4 of 32 experts."""
    layers = {f"layer_{i}": {"selected_experts": [i % 32, (i + 1) % 32, (i + 2) % 32, (i + 3) % 32],
                             "selected_probs": [0.4, 0.3, 0.2, 0.1]} for i in range(24)}
    doc = {"full_text": ["x"] * (prompt + tokens), "generated_only": ["x"] * tokens,
           "router_data": [{f"token_{prompt + i}": layers} for i in range(tokens - 1)]}
    path.write_text(json.dumps(doc))
    return path


# ---- 1. an output that is an input, a device or a FIFO --------------------------------------------
def test_enrich_output_equal_to_input_is_refused(trace):
    before = trace.read_bytes()
    refused(dali("trace", "enrich", trace, "-o", trace), trace)
    assert trace.read_bytes() == before


def test_sim_run_timeline_equal_to_trace_is_refused(trace):
    before = trace.read_bytes()
    refused(dali("sim", "run", "--trace", trace, "--system", "gpu-lru", "--timeline", trace), trace)
    assert trace.read_bytes() == before


def test_sim_compare_csv_equal_to_trace_is_refused(trace):
    before = trace.read_bytes()
    refused(dali("sim", "compare", "--trace", trace, "--systems", "gpu-lru,cpu-only", "--csv", trace), trace)
    assert trace.read_bytes() == before


def test_trace_import_output_equal_to_input_is_refused(tmp_path):
    src = gpt_oss_json(tmp_path / "a.json")
    before = src.read_bytes()
    refused(dali("trace", "import", "--format", "gpt-oss-fingerprint", src, "-o", src), src)
    assert src.read_bytes() == before
    # a file inside an input folder is an input too
    refused(dali("trace", "import", "--format", "gpt-oss-fingerprint", tmp_path, "-o", src), src)
    assert src.read_bytes() == before


def test_synth_output_equal_to_popularity_from_is_refused(trace):
    before = trace.read_bytes()
    refused(dali("trace", "synth", *SMALL_SYNTH, "--popularity-from", trace, "-o", trace), trace)
    assert trace.read_bytes() == before


def test_output_that_is_a_fifo_is_refused(tmp_path, trace):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    msg = refused(dali("sim", "run", "--trace", trace, "--system", "gpu-lru", "--timeline", fifo), fifo)
    assert "FIFO" in msg
    assert Path(fifo).is_fifo()


def test_output_that_is_a_device_is_refused():
    # the check itself: running a writer on /dev/null would, if it regressed, replace the machine's /dev/null
    with pytest.raises(PathError, match="/dev/null: the trace is a character device"):
        check_output("/dev/null", what="trace")
    with pytest.raises(PathError, match="character device"):
        TraceWriter("/dev/null", tiny_model())
    assert Path("/dev/null").is_char_device()


def test_timeline_and_csv_on_one_path_are_refused(tmp_path, trace):
    out = tmp_path / "both"
    refused(dali("exec", "run", "--trace", trace, "--system", "gpu-lru", "--timeline", out, "--csv", out), out)


# ---- 2. two writers to one output -----------------------------------------------------------------
def test_two_trace_writers_to_one_output_leave_one_complete_trace(tmp_path):
    model = tiny_model()
    path = tmp_path / "out.parquet"
    a, b = random_rows(model, 2, 4, seed=1), random_rows(model, 2, 4, seed=2)
    wa, wb = TraceWriter(path, model, row_group_size=4), TraceWriter(path, model, row_group_size=4)
    wa.write(**a)
    wb.write(**b)
    wa.close()
    np.testing.assert_array_equal(read_trace(path).experts, a["experts"])
    wb.close()  # the later rename wins; each file is whole
    np.testing.assert_array_equal(read_trace(path).experts, b["experts"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.parquet"]


def test_two_synth_processes_to_one_output_leave_one_of_their_traces(tmp_path):
    out = tmp_path / "same.parquet"
    args = ["--model", "mixtral-8x7b", "--sequences", "16", "--prompt-len", "64", "--gen-len", "64", "-q"]
    refs = {}
    for seed in (1, 2):
        refs[seed] = tmp_path / f"ref{seed}.parquet"
        assert dali("trace", "synth", *args, "--seed", seed, "-o", refs[seed]).exit_code == 0
    procs = [subprocess.Popen([sys.executable, "-m", "dali_sim", "trace", "synth", *args, "--seed", str(seed),
                               "-o", str(out)], stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    got = read_trace(out)  # whole and valid, and the rows of one run (the command lines differ)
    assert any(np.array_equal(got.experts, read_trace(r).experts) and np.array_equal(got.weights, read_trace(r).weights)
               for r in refs.values())
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_enrich_and_timeline_ignore_another_writers_partial_name(tmp_path, trace):
    """The old fixed temporary names (OUT.partial) were shared by every writer: a folder there made the
    write fail; unique names do not care."""
    future = tmp_path / "f.parquet"
    (tmp_path / "f.parquet.partial").mkdir()
    assert dali("trace", "enrich", trace, "--batch-size", "2", "-o", future).exit_code == 0
    assert future.is_file()
    timeline = tmp_path / "tl.json"
    (tmp_path / "tl.json.partial").mkdir()
    r = dali("sim", "run", "--trace", trace, "--system", "gpu-lru", "--timeline", timeline)
    assert r.exit_code == 0, r.output
    assert json.loads(timeline.read_text())["traceEvents"]


def test_atomic_output_uses_unique_temporary_names_and_cleans_up(tmp_path):
    out = tmp_path / "x.txt"
    with atomic_output(out) as t1, atomic_output(out) as t2:
        assert t1 != t2 and t1.parent == t2.parent == tmp_path
        t1.write_text("one")
        t2.write_text("two")
    assert out.read_text() == "one"  # the outer block finished last
    with pytest.raises(RuntimeError), atomic_output(out) as t3:
        t3.write_text("half")
        raise RuntimeError("crash")
    assert out.read_text() == "one" and sorted(p.name for p in tmp_path.iterdir()) == ["x.txt"]


# ---- 7. SIGTERM -----------------------------------------------------------------------------------
def _wait_for_rows(folder: Path, pattern: str, proc, timeout: float = 120) -> None:
    """Until the writer's temporary file holds a row group (more than the Parquet magic)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if any(p.stat().st_size > 4096 for p in folder.glob(pattern)):
            return
        time.sleep(0.05)
    raise AssertionError("the writer wrote no row group in time")


def test_sigterm_keeps_a_readable_partial_trace(tmp_path):
    out = tmp_path / "big.parquet"
    proc = subprocess.Popen([sys.executable, "-m", "dali_sim", "trace", "synth", "--model", "mixtral-8x7b",
                             "--sequences", "256", "--prompt-len", "1024", "--gen-len", "1024", "-q", "-o", str(out)],
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_rows(tmp_path, ".big.parquet.*.partial", proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM" in err
    assert not out.exists()
    partial = read_trace(tmp_path / "big.parquet.partial", allow_partial=True)
    assert len(partial) > 0 and partial.meta.status == "partial" and "Terminated" in partial.meta.partial_reason
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.parquet.partial"]


# ---- 8. unwritable outputs, checked before the work; a full disk ---------------------------------
@pytest.fixture
def readonly_dir(tmp_path) -> Path:
    """A folder this process cannot write (chmod; as root, which ignores modes, a read-only system folder)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    for candidate in (ro, Path("/sys"), Path("/proc")):
        try:
            check_output(candidate / "probe.json")
        except PathError:
            yield candidate
            ro.chmod(0o755)
            return
    ro.chmod(0o755)
    pytest.skip("no unwritable folder available")


def test_calibrate_output_in_read_only_folder_is_refused_before_calibrating(readonly_dir):
    out = readonly_dir / "my-box.json"
    start = time.monotonic()
    msg = refused(dali("exec", "calibrate", "--model-shape", "mixtral-8x7b", "--device", "cpu", "-o", out), out)
    assert "not writable" in msg
    assert time.monotonic() - start < 60  # a calibration of the full mixtral shape takes far longer


def test_timeline_in_read_only_folder_is_refused(readonly_dir, trace):
    out = readonly_dir / "tl.json"
    refused(dali("sim", "run", "--trace", trace, "--system", "gpu-lru", "--timeline", out), out)


def test_csv_under_an_existing_file_is_refused(tmp_path, trace):
    out = tmp_path / "t.parquet" / "table.csv"
    assert "is a file, not a folder" in refused(
        dali("sim", "compare", "--trace", trace, "--systems", "gpu-lru,cpu-only", "--csv", out), out)


def test_output_that_is_an_existing_folder_is_refused(tmp_path, trace):
    (tmp_path / "x.parquet").mkdir()
    assert "directory" in refused(dali("trace", "synth", *SMALL_SYNTH, "-o", tmp_path / "x.parquet"),
                                  tmp_path / "x.parquet", code=2)
    assert "folder" in refused(dali("trace", "enrich", tmp_path / "t.parquet", "-o", tmp_path / "x.parquet"),
                               tmp_path / "x.parquet")


def test_validate_report_folder_that_is_a_file_is_refused(tmp_path, trace):
    refused(dali("exec", "validate", "--trace", trace, "--systems", "gpu-lru", "-o", trace), trace, code=2)


def _limit_file_size():  # runs in the child: writes past 200 kB fail with EFBIG, like a full disk
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))


def test_full_disk_gives_one_line_and_leaves_no_partial(tmp_path):
    out = tmp_path / "full.parquet"
    r = subprocess.run([sys.executable, "-m", "dali_sim", "trace", "synth", "--model", "mixtral-8x7b", "--sequences",
                        "32", "--prompt-len", "256", "--gen-len", "256", "-q", "-o", str(out)],
                       capture_output=True, text=True, preexec_fn=_limit_file_size, timeout=300)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and str(out) in lines[0], r.stderr
    assert "cannot write" in lines[0]
    assert list(tmp_path.iterdir()) == []
