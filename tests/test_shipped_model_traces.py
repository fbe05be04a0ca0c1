"""The shipped trained model, its residual vectors and the traces recorded from it work together:
`dali trace record` on the model gives a trace that `dali sim run` accepts, and the shipped traces
carry what the prefetching systems read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dali_sim.cli.main import cli
from dali_sim.trace import read_trace

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "dali-tiny-moe"
RESIDUAL = MODEL / "residual.safetensors"


def invoke(*args):
    r = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def test_record_on_the_shipped_model_then_simulate(tmp_path):
    prompts = tmp_path / "p.jsonl"
    lines = (ROOT / "prompts" / "hidden10.jsonl").read_text().splitlines()[:3]
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "t.parquet"
    invoke("trace", "record", "--model", MODEL, "--prompts", prompts, "--batch-size", 3, "--max-new-tokens", 6,
           "--residual", RESIDUAL, "-o", out, "-q")
    t = read_trace(out)
    assert t.num_sequences == 3 and set(t.meta.predictors) == {"next-gate", "residual"}
    # hidden10 holds two prompts per domain in domain order; their attributes travel into the trace
    assert [s.attrs["domain"] for s in t.meta.sequences] == ["arxiv", "arxiv", "book"]
    res = json.loads(invoke("sim", "run", "--trace", out, "--system", "dali", "--batch-size", 2, "--cache-experts", 8,
                            "--json"))
    # the default split profiles the first of the 3 sequences; the other 2 run in one batch
    assert res["sequences"] == 2 and res["manifest"]["profiling"]["profile_sequences"]["count"] == 1
    assert res["decode_steps"] == 5 and res["prefill_steps"] == 1 and res["prefetch_issued"] > 0


@pytest.mark.parametrize("name", ["dali-tiny-moe.parquet", "dali-tiny-moe-hidden.parquet"])
def test_shipped_recorded_traces(name):
    t = read_trace(ROOT / "traces" / name)  # full validation
    assert t.model.name == "dali-tiny-moe" and t.model.num_experts == 32 and t.model.top_k == 4
    assert set(t.meta.predictors) == {"next-gate", "residual"}
    assert t.meta.provenance["source"] == "record"
    phases = set(t.to_pandas()["phase"].unique())
    assert len(phases) == 2  # prefill and decode
    if "hidden" in name:
        keys, hidden = t.hidden_states()
        assert hidden.shape == (len(t), 128) and t.router_logits is not None
