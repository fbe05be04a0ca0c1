"""``dali exec generate``: a real transformers MoE model generating with its experts offloaded.

For every system preset but the bounds (refused): the generated tokens equal plain transformers greedy
generation (the recorder's loop and ``model.generate``), and on this CPU device every forward pass's
logits are bit for bit the plain model's (GPT-OSS: within 1e-5, see docs/executor.md), on tiny random
models of several families, fp32, batch 3 with left padding and a sequence that stops early at EOS,
with caches smaller than a layer so that CPU experts, on-demand copies and prefetches all happen.
The counts equal a no-timing simulation of a trace recorded from the same prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dali_exec.generate import GenerateOptions, generate  # noqa: E402
from dali_exec.generate.run import _max_kv_tokens  # noqa: E402
from dali_exec.models import get_adapter  # noqa: E402
from dali_exec.models.tiny import char_tokenizer, save_tiny, tiny_model  # noqa: E402
from dali_exec.recorder import (  # noqa: E402
    Prompt,
    RecordOptions,
    calibrate_residuals,
    greedy_generate,
    record_trace,
)
from dali_exec.recorder.generation import left_pad  # noqa: E402
from dali_exec.recorder.record import special_ids  # noqa: E402
from dali_sim.cli.main import cli  # noqa: E402
from dali_sim.models.hf_config import spec_from_hf_config  # noqa: E402
from dali_sim.policies import resolve_system, system_names  # noqa: E402
from dali_sim.runtime.memory import GIB, plan_memory  # noqa: E402
from dali_sim.sim import simulate  # noqa: E402
from dali_sim.sim.counters import COUNTERS  # noqa: E402
from dali_sim.workload.profiling import ProfileSpec  # noqa: E402

from conftest import REPO, round_number_profile  # noqa: E402

PROMPTS = ["Hello world, this is", "abc", "The quick brown fox jumps"]
CALIBRATION = ["calibration text for the residual vectors", "more text, of another kind: 1 2 3 4 5", "zzz yyy"]
BATCH, NEW = 3, 8
BOUNDS = ("oracle-heuristic", "lower-bound")
SYSTEMS = [s for s in system_names() if s not in BOUNDS]
FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v2", "gpt_oss", "olmoe")
MORE_FAMILIES = ("qwen2_moe", "deepseek_v3", "glm4_moe", "flex_olmo")
#: families whose expert activation is not bit-for-bit reproducible expert by expert (docs/executor.md)
NOT_BITWISE = {"gpt_oss"}
SHIPPED = REPO / "models" / "dali-tiny-moe"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread is fastest, and the plain run and both lanes use the same count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Logits:
    """Every forward pass's LM-head output while active."""

    def __init__(self, model):
        self.out: list[torch.Tensor] = []
        self._h = model.lm_head.register_forward_hook(lambda m, a, o: self.out.append(o.detach().clone()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._h.remove()


def plain_greedy(model, ids, batch, new, chunk=0):
    eos, pad = special_ids(model, None)
    with Logits(model) as cap:
        gen = []
        for start in range(0, len(ids), batch):
            gen += greedy_generate(model, ids[start:start + batch], max_new_tokens=new, eos_ids=eos, pad_id=pad,
                                   prefill_chunk=chunk).generated
    return gen, cap.out


def hf_generate(model, ids, batch, new):
    eos, pad = special_ids(model, None)
    out = []
    for start in range(0, len(ids), batch):
        x, mask = left_pad(ids[start:start + batch], pad, "cpu")
        with torch.no_grad():
            y = model.generate(x, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=pad)
        for row in y[:, x.shape[1]:].tolist():
            keep = []
            for t in row:
                keep.append(t)
                if t in eos:
                    break
            out.append(keep)
    return out


def whole_layers_budget(model, lengths, batch, new, layers_on_gpu=1, precision="fp32") -> str:
    """A GPU budget (GiB) in which llama.cpp's whole-layers layout holds ``layers_on_gpu`` MoE layers (of
    experts in ``precision``: the model's dtype, as `dali exec generate` plans them)."""
    spec = spec_from_hf_config(model.config.to_dict(), precision=precision)
    sysconf = resolve_system("llamacpp", {"memory": {"gpu_memory_gib": "1024"}}, spec)
    kv = _max_kv_tokens(lengths, batch, new)
    plan = plan_memory(spec, sysconf.memory, 0, kv)
    fixed = plan.used_bytes - plan.breakdown["expert_cache"]
    return repr((fixed + (layers_on_gpu + 0.5) * spec.num_experts * spec.expert_bytes) / GIB)


#: whole-layers presets: a budget with one MoE layer on the GPU (2 slots matched in memory are no whole layer)
WHOLE_LAYERS = ("llamacpp", "llamacpp-best", "ktransformers", "moe-lightning")


def overrides_for(system, budget) -> dict | None:
    if system in WHOLE_LAYERS:
        return {"memory": {"gpu_memory_gib": budget}}
    if system == "cpu-only":
        return None  # no cache by design
    over = {"memory": {"cache_experts": "2"}}
    if system == "hybrimoe-best":
        over["prefetch"] = {"min_gain": "0"}  # tiny experts: any gain, so that its prefetch path runs (the paper's)
    return over


#: what each preset must have done (beyond identical outputs), from its counters
EXPECT = {
    "cpu-only": lambda s: s["cpu_experts"] == s["activated"],
    # whole layers: the first on the CPU, the last on the GPU; no per-layer GPU prefill below 30,000 tokens
    "ktransformers": lambda s: s["cpu_experts"] > 0 and s["hits"] > 0 and s["on_demand"] == 0,
    "ktransformers-best": lambda s: s["cpu_experts"] > 0 and s["hits"] > 0 and s["on_demand"] == 0,
    "fiddler": lambda s: s["cpu_experts"] > 0 and s["hits"] > 0,
    "fiddler-best": lambda s: s["cpu_experts"] > 0 and s["hits"] > 0,
    "gpu-lru": lambda s: s["on_demand"] > 0 and s["hits"] > 0 and s["cpu_experts"] == 0 and s["admitted"] > 0,
    "gpu-lfu": lambda s: s["on_demand"] > 0 and s["hits"] > 0 and s["cpu_experts"] == 0,
    "gpu-static": lambda s: s["on_demand"] > 0 and s["hits"] > 0 and s["staged"] == s["on_demand"],
    # CPU layers, the last layer on the GPU, and op offload in prefill (steps of >= 32 tokens)
    "llamacpp": lambda s: s["cpu_experts"] > 0 and s["hits"] > 0 and s["on_demand"] == s["staged"] > 0,
    "llamacpp-best": lambda s: s["cpu_experts"] > 0 and s["hits"] > 0 and s["on_demand"] == s["staged"] > 0,
    # the released code: an LRU cache, no prefetch
    "mixtral-offloading": lambda s: s["prefetch_issued"] == 0 and s["on_demand"] > 0 and s["cpu_experts"] == 0
    and s["hits"] > 0,
    "mixtral-offloading-best": lambda s: s["prefetch_used"] > 0 and s["on_demand"] > 0 and s["cpu_experts"] == 0,
    # the last layer resident whole, the others streamed (the first of a step copied on demand; with 2 MoE
    # layers nothing else is left to stream)
    "moe-lightning": lambda s: s["on_demand"] > 0 and s["hits"] > 0 and s["cpu_experts"] == 0,
    "moe-lightning-best": lambda s: s["prefetch_used"] > 0 and s["on_demand"] > 0 and s["hits"] > 0,
    # (whether its greedy also fetches on demand depends on the costs: the tiny shapes make CPU experts cheap)
    "dali": lambda s: s["prefetch_issued"] > 0 and s["cpu_experts"] > 0 and s["swaps"] > 0,
    "dali-plus": lambda s: s["prefetch_issued"] > 0 and s["cpu_experts"] > 0,
    # the released code: batch-2 steps (multi-token) run every expert on the GPU; single-token steps (a batch
    # whose other sequence has stopped) may use the CPU
    "hybrimoe": lambda s: s["hits"] > 0 and s["on_demand"] > 0,
    "hybrimoe-best": lambda s: s["cpu_experts"] > 0 and s["hits"] > 0,
    # ours: HybriMoE's schedule with the link-budget cache (its swaps depend on the costs)
    "link-budget": lambda s: s["cpu_experts"] > 0 and s["hits"] > 0,
}
#: presets that prefetch (checked on the main families: with 2 MoE layers HybriMoE finds nothing worth it)
PREFETCHING = ("dali", "dali-plus", "hybrimoe", "hybrimoe-best", "mixtral-offloading-best", "moe-lightning-best")
assert set(EXPECT) == set(SYSTEMS), "a new preset needs its expectations here"


class Case:
    """A tiny model of one family with everything the comparisons need."""

    def __init__(self, family, tmp: Path):
        self.family = family
        self.model = tiny_model(family, seed=1)
        self.tok = char_tokenizer()
        self.ids = [self.tok(p)["input_ids"] for p in PROMPTS]
        self._early_eos()
        self.plain, self.plain_logits = plain_greedy(self.model, self.ids, BATCH, NEW)
        res = calibrate_residuals(self.model, get_adapter(self.model), [self.tok(t)["input_ids"] for t in CALIBRATION])
        self.residual = res.save(tmp / f"{family}.residual.safetensors")
        self.budget = whole_layers_budget(self.model, [len(i) for i in self.ids], BATCH, NEW)
        # round-number costs (GPU 1 s per token, CPU 3 s, a copy 2 s) under which copies pay: worth-prefetch's
        # cost gate (dali-plus) declines every copy of a tiny expert on the default profile
        self.round_hw = round_number_profile(tmp / f"{family}.round.json",
                                             spec_from_hf_config(self.model.config.to_dict(), name=family, precision="fp32"))

    def _early_eos(self):
        """Make one sequence stop early at an extra EOS token, so finished rows ride along in decode."""
        plain, _ = plain_greedy(self.model, self.ids, BATCH, NEW)
        cfg = self.model.generation_config
        base = special_ids(self.model, None)[0]
        for tok in [t for seq in plain for t in seq[1:-1]]:
            cfg.eos_token_id = base + [tok]
            gen, _ = plain_greedy(self.model, self.ids, BATCH, NEW)
            lengths = [len(g) for g in gen]
            if min(lengths) < NEW and max(lengths) == NEW:
                return
        cfg.eos_token_id = base

    def run(self, system, **kw):
        opts = dict(batch_size=BATCH, max_new_tokens=NEW, residual=self.residual) | kw.pop("opts", {})
        over = kw.pop("overrides", overrides_for(system, self.budget))
        if system == "dali-plus":
            kw.setdefault("hardware", self.round_hw)
        with Logits(self.model) as cap:
            r = generate(self.model, PROMPTS, system, GenerateOptions(**opts), tokenizer=self.tok, overrides=over, **kw)
        return r, cap.out

    def check_same(self, result, logits, plain=None, plain_logits=None, chunk=0, close_only=False):
        """Tokens equal; logits bit for bit, of every row (padding and stopped sequences included: they are
        computed as the model computes them), but rows of prefill chunks that are all padding (no step)."""
        plain = self.plain if plain is None else plain
        plain_logits = self.plain_logits if plain_logits is None else plain_logits
        assert [g.token_ids for g in result.generated] == plain
        rows = forward_rows(self.ids, plain, BATCH, chunk) if chunk else None
        same_logits(logits, plain_logits, rows, close_only or self.family in NOT_BITWISE)


def forward_rows(ids, generated, batch, chunk=0) -> list[list[int]]:
    """Per forward pass of the greedy loop, the batch rows whose logits belong to a real token (not a
    padding column of a prefill chunk, not a sequence that has already stopped)."""
    out = []
    for start in range(0, len(ids), batch):
        lens = [len(i) for i in ids[start:start + batch]]
        gens = [len(g) for g in generated[start:start + batch]]
        width = max(lens)
        for s in range(0, width, chunk or width):
            last = min(width, s + (chunk or width)) - 1
            out.append([r for r, n in enumerate(lens) if last >= width - n])
        for j in range(max(gens) - 1):
            out.append([r for r, g in enumerate(gens) if j < g - 1])
    return out


def same_logits(logits, plain_logits, rows=None, close_only=False):
    """The LM-head outputs of each forward pass (only ``rows`` of each, if given): bit for bit, or within
    1e-5 with ``close_only``."""
    assert len(logits) == len(plain_logits)
    assert rows is None or len(rows) == len(logits)
    for i, (a, b) in enumerate(zip(logits, plain_logits)):
        if rows is not None:
            a, b = a[rows[i]], b[rows[i]]
        if close_only:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        else:
            assert torch.equal(a, b)


_CASES: dict[str, Case] = {}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("generate")

    def get(family):
        if family not in _CASES:
            _CASES[family] = Case(family, tmp)
        return _CASES[family]

    yield get
    _CASES.clear()


def test_the_plain_references_agree(cases):
    """The recorder's greedy loop is plain transformers generation (the reference of every other test),
    and a sequence really stops early, so finished rows are part of the runs."""
    for family in FAMILIES:
        c = cases(family)
        assert hf_generate(c.model, c.ids, BATCH, NEW) == c.plain, family
        lengths = [len(g) for g in c.plain]
        assert min(lengths) < NEW == max(lengths), family


def _run_all_systems(case, prefetches=True):
    for system in SYSTEMS:
        result, logits = case.run(system)
        case.check_same(result, logits)
        s = result.summary
        assert s["activated"] == s["gpu_experts"] + s["cpu_experts"] > 0
        assert EXPECT[system](s), (case.family, system, {k: s[k] for k in COUNTERS})
        if prefetches and system in PREFETCHING:
            assert s["prefetch_issued"] > 0, (case.family, system)
        assert s["tokens"] == sum(len(i) for i in case.ids) + sum(len(g) - 1 for g in case.plain)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_preset_generates_the_plain_tokens(cases, family):
    _run_all_systems(cases(family))


@pytest.mark.slow
@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_every_preset_generates_the_plain_tokens_more_families(cases, family):
    _run_all_systems(cases(family), prefetches=False)


def test_bounds_are_refused(cases):
    c = cases("mixtral")
    with pytest.raises(ValueError, match="placement policy 'optimal' is a bound"):
        c.run("oracle-heuristic")
    with pytest.raises(ValueError, match="'lower-bound' is a time bound"):
        c.run("lower-bound")
    for family, policy in (("cache", "belady"), ("prefetch", "oracle")):
        over = {family: {"policy": policy}, "memory": {"cache_experts": "2", "prefetch_slots": "2"}}
        with pytest.raises(ValueError, match=f"{family} policy '{policy}' is an oracle heuristic"):
            c.run("gpu-lru", overrides=over)
    assert hasattr(c.model.model.layers[0].mlp.experts, "gate_up_proj")  # refused before touching the model


def test_residual_systems_need_the_vectors(cases, tmp_path):
    c = cases("qwen3_moe")
    for system in ("dali", "dali-plus"):
        with pytest.raises(ValueError, match="--residual FILE"):
            c.run(system, opts={"residual": None})
    other = cases("mixtral")
    with pytest.raises(ValueError, match="residual vectors"):
        c.run("dali", opts={"residual": other.residual})


def test_chunked_prefill_with_padding_only_chunks(cases):
    """Prefill in chunks of 3 columns: the short prompt's first chunks are padding only (no step)."""
    c = cases("deepseek_v2")
    plain, plain_logits = plain_greedy(c.model, c.ids, BATCH, NEW, chunk=3)
    result, logits = c.run("mixtral-offloading", opts={"prefill_chunk": 3})
    assert plain == c.plain
    c.check_same(result, logits, plain, plain_logits, chunk=3)
    width = max(len(i) for i in c.ids)
    assert result.summary["prefill_steps"] == -(-width // 3)
    assert result.per_step["tokens"].sum() == result.summary["tokens"]


def test_skipping_padding_rows(cases):
    """padding=skip: rows outside the workload get no routed output (as an offloading system would run);
    the real tokens' logits then equal the model's up to rounding, the counts are those of exact mode."""
    c = cases("qwen3_moe")
    exact, _ = c.run("fiddler")
    skip, logits = c.run("fiddler", opts={"padding": "skip"})
    assert [g.token_ids for g in skip.generated] == c.plain
    same_logits(logits, c.plain_logits, forward_rows(c.ids, c.plain, BATCH), close_only=True)
    for key in COUNTERS:
        assert skip.summary[key] == exact.summary[key], key
    with pytest.raises(ValueError, match="padding"):
        GenerateOptions(padding="drop")


def test_slow_copies_change_nothing(cases):
    """Every copy held back: prefetches and fetches land late, the outputs are the same."""
    c = cases("olmoe")
    for system in ("mixtral-offloading-best", "moe-lightning", "dali"):
        result, logits = c.run(system, opts={"copy_delay_s": 0.002})
        c.check_same(result, logits)


def test_without_numba_the_same_tokens_logits_and_counts(cases, monkeypatch):
    """The NumPy code of every compiled per-layer loop (no numba, or DALI_NUMBA=0): identical results."""
    from dali_exec.executor import kernels
    from dali_sim.policies import placement_dali
    from dali_sim.workload import online

    c = cases("qwen3_moe")
    compiled = {s: c.run(s)[0] for s in ("dali", "hybrimoe", "gpu-lru")}
    monkeypatch.setattr(kernels, "compiled", lambda name: None)
    monkeypatch.setattr(online, "_segment_kernel", lambda: None)
    monkeypatch.setattr(placement_dali, "_compiled_place", lambda: None)
    for system, first in compiled.items():
        result, logits = c.run(system)
        c.check_same(result, logits)
        assert {k: result.summary[k] for k in COUNTERS} == {k: first.summary[k] for k in COUNTERS}, system


def test_result_layout_and_the_model_is_restored(cases):
    c = cases("mixtral")
    adapter = get_adapter(c.model)
    before = [b.experts for b in adapter.blocks(c.model)]
    result, _ = c.run("dali")
    assert [b.experts for b in adapter.blocks(c.model)] == before
    assert plain_greedy(c.model, c.ids, BATCH, NEW)[0] == c.plain
    s = result.summary
    for key in ("decode_tokens_per_s", "prefill_tokens_per_s", "makespan_s", "ttft_s", "tpot_s", "hit_rate",
                "overhead", "generation", "busy"):
        assert key in s, key
    assert s["decode_tokens_per_s"] > 0 and s["generation"]["new_tokens"] == sum(len(g) for g in c.plain)
    assert s["steps"] == len(result.per_step) == s["prefill_steps"] + s["decode_steps"]
    assert (result.per_step["time_s"] > 0).all()
    assert list(result.per_layer.index) == [b.layer for b in adapter.blocks(c.model)]
    assert {"time_s", "gpu_wait_s", "decision_s", "bookkeeping_s", "lookahead_s"} <= set(result.per_layer.columns)
    assert (result.per_layer["time_s"] > 0).all()
    assert len(result.per_sequence) == len(PROMPTS)
    cfg = result.config
    assert cfg["system"]["name"] == "dali" and cfg["system"]["memory"]["cache_experts"] == 2
    assert cfg["online"]["frequencies"].startswith("uniform")
    assert set(cfg["online"]["predictors"]) == {"residual"}
    assert result.manifest["online"]["residual"] == str(c.residual)
    assert result.manifest["memory"]["cache_slots_per_layer"] == [2] * len(before)
    assert result.manifest["executor"]["expert_layout"]["source"] == "MixtralExperts"
    d = json.loads(result.to_json())
    assert [g["token_ids"] for g in d["generated"]] == c.plain and d["system"] == "dali"
    tracks = {iv.track for iv in result.intervals}
    assert {"gpu", "cpu", "pcie"} <= tracks


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])
def test_counts_equal_a_simulation_of_the_recorded_trace(cases, family, tmp_path):
    """`dali trace record` on the same prompts gives the routing; simulating it without timing must count
    exactly what the online run counted (same controller, same decisions)."""
    c = cases(family)
    from dali_exec.recorder.residual import ResidualVectors

    prompts = [Prompt(i, f"p{i}", text=t) for i, t in enumerate(PROMPTS)]
    trace = tmp_path / "t.parquet"
    rec = record_trace(c.model, prompts, trace, tokenizer=c.tok,
                       options=RecordOptions(batch_size=BATCH, max_new_tokens=NEW,
                                             residuals=ResidualVectors.load(c.residual)))
    assert [rec.generated[i] for i in range(len(PROMPTS))] == c.plain
    for system in ("gpu-lru", "fiddler", "dali", "mixtral-offloading", "moe-lightning", "gpu-static", "llamacpp"):
        over = overrides_for(system, c.budget)
        result, _ = c.run(system, opts={"frequencies_from": trace}, overrides=over)
        # the online run is dali's executor: the simulation decides with the same implementation's costs
        over = {**(over or {}), "system": {"implementation": "dali-executor"}}
        # the whole recorded trace evaluated, its frequencies the online run's profile (--profile-trace)
        sim = simulate(trace, system, batch_size=BATCH, timing=False, overrides=over, precision="fp32",
                       profiling=ProfileSpec(trace=trace))
        for key in COUNTERS:
            assert result.summary[key] == sim.summary[key], (system, key)
        pd.testing.assert_frame_equal(result.per_layer[list(COUNTERS)], sim.per_layer[list(COUNTERS)])
        assert result.manifest["memory"]["cache_slots_per_layer"] == sim.manifest["memory"]["cache_slots_per_layer"]
        assert result.config["online"]["frequencies"].startswith(f"trace {trace}")


def test_cli(tmp_path):
    folder = save_tiny("qwen3_moe", tmp_path / "tiny-qwen3", seed=2)
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    from dali_exec.recorder import load_model

    model, tok = load_model(str(folder))
    plain, _ = plain_greedy(model, [tok(p)["input_ids"] for p in PROMPTS], 2, 5)
    runner = CliRunner()
    base = ["exec", "generate", "--model", str(folder), "--prompts", str(prompts), "--batch-size", "2",
            "--max-new-tokens", "5", "--cpu-threads", "1", "--accel-threads", "1", "-q"]
    r = runner.invoke(cli, base + ["--system", "mixtral-offloading-best", "--cache-experts", "2", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert [g["token_ids"] for g in d["generated"]] == plain
    assert d["config"]["model"] == str(folder) and d["manifest"]["command"].startswith("dali exec generate")
    assert d["prefetch_issued"] > 0 and d["config"]["system"]["memory"]["cache_experts"] == 2
    timeline = tmp_path / "tl.json"
    r = runner.invoke(cli, base + ["--system", "ktransformers", "--cache-experts", "3", "--timeline", str(timeline)])
    assert r.exit_code == 0, r.output
    assert f"generated {sum(len(g) for g in plain)} tokens for 3 prompts" in r.output
    assert "CPU device (no CUDA)" in r.output and "system ktransformers" in r.output
    texts = [tok.decode(g, skip_special_tokens=True) for g in plain]
    for i, t in enumerate(texts):
        assert f"[{i}] prompt-{i}" in r.output and repr(t) in r.output
    assert json.loads(timeline.read_text())
    # the same run through the commands: record the routing, generate, simulate the recording
    trace = tmp_path / "t.parquet"
    r = runner.invoke(cli, ["trace", "record", "--model", str(folder), "--prompts", str(prompts), "--batch-size", "2",
                            "--max-new-tokens", "5", "-q", "-o", str(trace)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli, base + ["--system", "gpu-static", "--cache-experts", "3", "--profile-trace", str(trace),
                                   "--json"])
    assert r.exit_code == 0, r.output
    online = json.loads(r.output)
    # the simulation of the recording with the same profiling input: the whole trace evaluated
    r = runner.invoke(cli, ["sim", "run", "--trace", str(trace), "--system", "gpu-static", "--cache-experts", "3",
                            "--batch-size", "2", "--precision", "fp32", "--no-timing", "--profile-trace", str(trace),
                            "--json"])
    assert r.exit_code == 0, r.output
    simulated = json.loads(r.output)
    assert {k: online[k] for k in COUNTERS} == {k: simulated[k] for k in COUNTERS}
    assert online["hits"] > 0 and online["on_demand"] > 0
    r = runner.invoke(cli, base + ["--system", "oracle-heuristic"])
    assert r.exit_code == 1 and "is a bound" in r.output
    r = runner.invoke(cli, base + ["--system", "dali"])
    assert r.exit_code == 1 and "--residual FILE" in r.output


@pytest.mark.skipif(not SHIPPED.is_dir(), reason="models/dali-tiny-moe is not present (being trained)")
def test_the_shipped_model_generates_its_own_tokens_under_every_preset(tmp_path):
    """models/dali-tiny-moe, a trained Qwen3-MoE: every non-bound preset generates the plain tokens
    (logits bit for bit) on prompts of the shipped prompt file."""
    from dali_exec.recorder import load_model

    model, tok = load_model(str(SHIPPED))
    lines = (REPO / "prompts" / "multidomain.txt").read_text("utf-8").splitlines()
    prompts, calib = lines[::8], lines[1::8]  # one prompt of each domain's block; others calibrate
    ids = [tok(p)["input_ids"] for p in prompts]
    batch, new = 2, 8
    plain, plain_logits = plain_greedy(model, ids, batch, new)
    assert plain == hf_generate(model, ids, batch, new)
    res = calibrate_residuals(model, get_adapter(model), [tok(t)["input_ids"] for t in calib])
    residual = res.save(tmp_path / "res.safetensors")
    budget = whole_layers_budget(model, [len(i) for i in ids], batch, new)
    round_hw = round_number_profile(tmp_path / "round.json", spec_from_hf_config(SHIPPED, name=SHIPPED.name,
                                                                                 precision="fp32"))
    for system in SYSTEMS:
        over = overrides_for(system, budget)
        if over and "cache_experts" in over.get("memory", {}):
            over["memory"]["cache_experts"] = "8"  # of 32 experts per layer
        hw = {"hardware": round_hw} if system == "dali-plus" else {}
        with Logits(model) as cap:
            r = generate(model, prompts, system, GenerateOptions(batch_size=batch, max_new_tokens=new, residual=residual),
                         tokenizer=tok, overrides=over, model_path=str(SHIPPED), **hw)
        assert [g.token_ids for g in r.generated] == plain, system
        same_logits(cap.out, plain_logits)
        assert EXPECT[system](r.summary), (system, {k: r.summary[k] for k in COUNTERS})
        assert system not in PREFETCHING or r.summary["prefetch_issued"] > 0, system


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "flex_olmo", "deepseek_v2",
                                    "deepseek_v3", "glm4_moe", "gpt_oss"])
def test_packed_experts_compute_exactly_the_models_experts(family):
    """Each expert of the host store, computed by the layout, is bit for bit the model's own expert."""
    from dali_exec.generate import pack_experts

    model = tiny_model(family, seed=3)
    adapter = get_adapter(model)
    blocks = adapter.blocks(model)
    store = pack_experts([b.experts for b in blocks], torch.float32)
    assert tuple(store.weights.shape[:2]) == (len(blocks), blocks[0].num_experts)
    assert store.layout.numel == sum(t[0].numel() for t in (
        [blocks[0].experts.gate_up_proj, blocks[0].experts.down_proj]
        + ([blocks[0].experts.gate_up_proj_bias, blocks[0].experts.down_proj_bias] if store.layout.bias else [])))
    x = torch.randn(5, blocks[0].hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for layer, b in enumerate(blocks):
            for e in range(b.num_experts):
                assert torch.equal(store.layout.forward(store.host(layer, e), x), adapter.expert_forward(b, e, x))


def test_routing_counted_rows_and_order():
    """The additive options of LayerRouting.group that real models use."""
    from dali_exec.executor.routing import LayerRouting

    ids = np.array([[2, 0], [0, 1], [2, 1]])
    w = np.array([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]], np.float32)
    r = LayerRouting.group(ids, w, counted=np.array([True, False, True]))
    assert r.experts.tolist() == [0, 1, 2] and r.counts().tolist() == [1, 1, 2]
    assert r.matches(np.array([2, 0, 1]), np.array([2, 1, 1]))
    only_padding = LayerRouting.group(ids, w, counted=np.array([False, True, False]))
    assert only_padding.counts().tolist() == [1, 1, 0]  # expert 2: padding only, not in the workload
    assert only_padding.matches(np.array([0, 1]), np.array([1, 1]))
    assert not only_padding.matches(np.array([0, 1, 2]), np.array([1, 1, 0]))
    order = np.array([2, 1, 5, 3, 4, 0])  # flat ids 0,0 | 1,1 | 2,2, a chosen order inside each expert
    r = LayerRouting.group(ids, w, order=order)
    assert [r.positions[r.segment(e)].tolist() for e in range(3)] == [[2, 1], [5, 3], [4, 0]]
    assert r.weights[r.segment(2)].tolist() == pytest.approx([0.5, 0.7])
    with pytest.raises(ValueError, match="sort the flat positions by expert"):
        LayerRouting.group(ids, w, order=np.array([0, 1, 2, 3, 4, 5]))
    with pytest.raises(ValueError, match="permutation"):
        LayerRouting.group(ids, w, order=np.array([0, 0, 2, 3, 4, 5]))
    with pytest.raises(ValueError, match="counted"):
        LayerRouting.group(ids, w, counted=np.array([True]))


def test_uncounted_experts_left_out_contribute_zero_and_on_cpu_are_computed():
    """run_experts with uncounted rows: an expert only they use is not in the plan; its pairs stay 0 (the output
    buffer is zeroed only then), or, with ``uncounted_on_cpu``, the CPU lane computes it (every pair written)."""
    from dali_exec.executor.devices import Devices
    from dali_exec.executor.routing import LayerRouting
    from dali_exec.executor.runtime import OffloadRuntime
    from dali_exec.generate.experts import pack_experts
    from dali_sim.runtime.controller import CPU, HIT, LayerPlan

    model = tiny_model("qwen3_moe", seed=4)
    blocks = get_adapter(model).blocks(model)
    store = pack_experts([b.experts for b in blocks], torch.float32)
    L = len(blocks)
    rt = OffloadRuntime(store, Devices.create("cpu", "fp32"), np.full(L, 2), 0, 1, cpu_threads=1,
                        cpu_inline=True)
    try:
        resident = np.zeros((L, blocks[0].num_experts), bool)
        resident[0, 1] = True
        rt.load(resident)
        ids = np.array([[1, 0], [0, 1], [3, 2]])  # the last row is padding: experts 3 and 2 only it uses
        w = np.array([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]], np.float32)
        counted = np.array([True, True, False])
        x = torch.randn(3, blocks[0].hidden_size, generator=torch.Generator().manual_seed(1))
        plan = LayerPlan(step=0, layer=0, phase=1, tokens=2, experts=np.array([0, 1]), counts=np.array([2, 2]),
                         on_gpu=np.array([False, True]), source=np.array([CPU, HIT], np.int8),
                         hit=np.array([False, True]), admitted=np.zeros(2, bool), staged=np.zeros(2, bool))

        def expert(e, rows):
            return store.layout.forward(store.host(0, e), x[rows])

        with torch.no_grad():
            left_out = rt.run_experts(plan, x, LayerRouting.group(ids, w, counted=counted))
            on_cpu = rt.run_experts(plan, x, LayerRouting.group(ids, w, counted=counted), uncounted_on_cpu=True)
            want = torch.zeros_like(x)
            for t in range(3):
                for r in range(2):
                    want[t] += float(w[t, r]) * expert(int(ids[t, r]), [t])[0]
        assert torch.allclose(on_cpu, want, atol=1e-6)
        assert torch.equal(left_out[2], torch.zeros(x.shape[1]))  # the padding row's experts: not computed
        assert torch.equal(left_out[:2], on_cpu[:2])
    finally:
        rt.close()
