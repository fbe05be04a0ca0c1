"""notebooks/ablation.ipynb runs end to end (nbclient) on a tiny results folder and draws every present figure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent
EXP = ROOT / "experiments"
NOTEBOOK = ROOT / "notebooks" / "ablation.ipynb"

# four experiment scripts at their tiniest size (a few seconds each, run in parallel)
SCRIPTS = {
    "fig12_13_speedups": ["--workers", "1"],
    "fig14_assignment": ["--workers", "1"],
    "table4_greedy_vs_exact": [],
    "prefetch_accuracy": [],
}
# CSVs the notebook draws if present; they are not produced here, so their cells must skip them
OPTIONAL = ("fig19_breakdown", "fig17_18_sensitivity", "recorded_trace")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("results")
    # one trace cache per script: the scripts run at once and the cache is not safe to share between processes
    procs = {name: subprocess.Popen([sys.executable, str(EXP / f"{name}.py"), "--quick", "--out", str(out), *args],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                    env={**os.environ, "DALI_EXP_CACHE": str(out / f"cache-{name}"), "MPLBACKEND": "Agg"})
             for name, args in SCRIPTS.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: {err[-3000:]}"
        assert (out / f"{name}.csv").is_file(), name
    return out


def _execute(results: Path, monkeypatch) -> nbformat.NotebookNode:
    monkeypatch.setenv("DALI_RESULTS", str(results))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the notebook asks for the inline backend itself
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError on any failing cell
    return nb


def _cells_by_tag(nb) -> dict:
    return {tag: c for c in nb.cells if c.cell_type == "code" for tag in c.metadata.get("tags", [])}


def _images(cell) -> int:
    return sum("image/png" in out.get("data", {}) for out in cell.outputs)


def _text(cell) -> str:
    return "".join(out.get("text", "") for out in cell.outputs if out.output_type == "stream")


def test_notebook_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, "clear the notebook's outputs before committing"


def test_ablation_notebook_runs(results, monkeypatch):
    nb = _execute(results, monkeypatch)
    cells = _cells_by_tag(nb)
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert str(results.resolve()) in _text(cells["setup"])
    for name in SCRIPTS:  # one section per present CSV, each with a figure
        assert _images(cells[name]) >= 1, f"{name}: no figure drawn"
    for name in OPTIONAL:  # not produced here: skipped with a note, no figure
        assert f"{name}.csv not found" in _text(cells[name]) and _images(cells[name]) == 0


def test_ablation_notebook_skips_missing_csv(results, tmp_path, monkeypatch):
    # only one of the CSVs present: the others are skipped with a note, the present one is still drawn
    (tmp_path / "fig14_assignment.csv").write_bytes((results / "fig14_assignment.csv").read_bytes())
    nb = _execute(tmp_path, monkeypatch)
    cells = _cells_by_tag(nb)
    assert _images(cells["fig14_assignment"]) >= 1
    for name in ("fig12_13_speedups", "table4_greedy_vs_exact"):
        assert _images(cells[name]) == 0 and "skipping" in _text(cells[name])


def test_run_all_saves_the_notebook_with_its_figures(results, tmp_path):
    """`experiments/run_all.py` executes the notebook on its results and keeps the outputs, so a reader of
    `experiments/results/ablation.ipynb` sees the figures; the source notebook stays clean."""
    sys.path.insert(0, str(EXP))
    import run_all

    out = tmp_path / "results"
    out.mkdir()
    for f in results.glob("*.csv"):
        (out / f.name).write_bytes(f.read_bytes())
    saved = run_all.render_notebook(out, timeout=120)
    assert saved == out / "ablation.ipynb"
    cells = _cells_by_tag(nbformat.read(saved, as_version=4))
    for name in SCRIPTS:
        assert _images(cells[name]) >= 1, name
    assert str(out.resolve()) in _text(cells["setup"])
    test_notebook_committed_without_outputs()
