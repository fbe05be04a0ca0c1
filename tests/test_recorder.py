"""The recorder: on tiny random models of every family, the trace holds exactly the model's own routing.

The reference is independent of the recorder: one plain forward pass (no cache, no padding) over each
recorded sequence, with a hook written here on every router.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dali_exec.models import get_adapter  # noqa: E402
from dali_exec.models.tiny import char_tokenizer, tiny_model, tiny_model_types  # noqa: E402
from dali_exec.recorder import (  # noqa: E402
    Prompt, RecordOptions, ResidualVectors, greedy_generate, record_trace, tokenize,
)
from dali_exec.recorder.generation import left_pad  # noqa: E402
from dali_sim.models.hf_config import HF_READERS  # noqa: E402
from dali_sim.trace import read_trace  # noqa: E402
from dali_sim.trace.schema import TraceError  # noqa: E402

torch.set_num_threads(1)

TEXTS = ["hello world, this is a test of padding", "ab", "the quick brown fox jumps"]
PROMPTS = [Prompt(i, f"p{i}", text=t) for i, t in enumerate(TEXTS)]
TIE = 1e-4  # selection-score gap below which two runs may legitimately choose differently


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def reference_routing(model, token_ids):
    """Per MoE block: (gate inputs (T, H), logits, ids, weights) of one plain forward pass, rank order."""
    adapter = get_adapter(model)
    blocks = adapter.blocks(model)
    seen = {}

    def hook(ordinal):
        def fn(module, inputs, output):
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            w, order = output[1].float().sort(dim=-1, descending=True, stable=True)
            seen[ordinal] = (x, output[0].reshape(-1, output[0].shape[-1]).float(), output[2].gather(-1, order), w)
        return fn

    handles = [b.router.register_forward_hook(hook(i)) for i, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([token_ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return blocks, [seen[i] for i in range(len(blocks))]


def selection_scores(model_type, logits, router):
    if model_type == "deepseek_v3":
        return torch.sigmoid(logits) + router.e_score_correction_bias
    return logits  # softmax is monotone


def assert_same_choice(ids_a, ids_b, scores_ref, k, where):
    """Same expert sets row by row, except where the reference has a near-tie at the k-th place."""
    a, b = np.sort(ids_a, axis=1), np.sort(ids_b, axis=1)
    bad = np.flatnonzero((a != b).any(axis=1))
    if bad.size:
        top = np.sort(scores_ref[bad], axis=1)[:, ::-1]
        gaps = top[:, k - 1] - top[:, k]
        assert (gaps < TIE).all(), f"{where}: rows {bad[gaps >= TIE].tolist()} chose different experts without a tie"
    return bad


def sequence_rows(trace, seq_id):
    t = trace.sorted()
    sel = t.seq_id == seq_id
    return t, sel


@pytest.fixture(scope="module", params=tiny_model_types())
def recorded(request, tmp_path_factory, tok):
    name = request.param
    if name not in HF_READERS:
        pytest.skip(f"dali_sim.models.hf_config has no model spec reader for {name} yet (adapter only)")
    model = tiny_model(name, seed=5)
    adapter = get_adapter(model)
    blocks = adapter.blocks(model)
    gen = torch.Generator().manual_seed(0)
    residuals = ResidualVectors({b.layer: torch.randn(32, generator=gen) for b in blocks[:-1]}, {"model_type": name})
    out = tmp_path_factory.mktemp(name) / "t.parquet"
    depth = min(3, len(blocks) - 1)  # gate2, gate3 where the tiny model has the layers
    options = RecordOptions(batch_size=2, max_new_tokens=6, router_logits=True, hidden_states=True, residuals=residuals,
                            next_gates=depth)
    result = record_trace(model, PROMPTS, out, tokenizer=tok, options=options)
    return name, model, result, read_trace(out), residuals


def test_trace_matches_the_models_own_routing(recorded, tok):
    name, model, result, trace, residuals = recorded
    prompt_ids = tokenize(PROMPTS, tok, "prompts")
    layers = np.asarray(trace.layers)
    for p, ids in zip(PROMPTS, prompt_ids):
        generated = result.generated[p.index]
        tokens = ids + generated[:-1]  # the last generated token is never fed back
        blocks, ref = reference_routing(model, tokens)
        t, sel = sequence_rows(trace, p.index)
        n = len(tokens)
        assert sel.sum() == n * len(layers)
        assert np.array_equal(t.pos[sel], np.repeat(np.arange(n), len(layers)))
        assert np.array_equal(t.layer[sel], np.tile(layers, n))
        assert np.array_equal(t.phase[sel], np.repeat((np.arange(n) >= len(ids)).astype(np.int8), len(layers)))
        for ordinal, (block, (x, logits, ref_ids, ref_w)) in enumerate(zip(blocks, ref)):
            rows = sel & (t.layer == block.layer)
            np.testing.assert_allclose(t.router_logits[rows], logits.numpy(), atol=1e-4, rtol=1e-4)
            scores = selection_scores(name, logits, block.router).numpy()
            bad = assert_same_choice(t.experts[rows], ref_ids.numpy(), scores, block.top_k,
                                     f"{name} block {block.layer}")
            good = np.setdiff1d(np.arange(n), bad)
            assert np.array_equal(t.experts[rows][good], ref_ids.numpy()[good])
            np.testing.assert_allclose(t.weights[rows][good], ref_w.numpy()[good], atol=1e-5, rtol=1e-5)
            # lookahead: router of the next MoE layer on this layer's gate input (+ residual)
            nxt = blocks[ordinal + 1] if ordinal + 1 < len(blocks) else None
            for pred, shift in (("next-gate", 0.0), ("residual", residuals.vectors.get(block.layer))):
                got = t.lookahead(pred)[rows]
                if nxt is None:
                    assert np.isnan(got).all()
                    continue
                with torch.no_grad():
                    want = get_adapter(model).router_logits(nxt, x + shift).float().numpy()
                np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
            # gate<d>: router of the MoE layer d on, on this layer's gate input (HybriMoE)
            far = {n: p.target_offset for n, p in trace.meta.predictors.items() if n.startswith("gate")}
            assert far or len(blocks) < 3
            for pred, d in far.items():
                got = t.lookahead(pred)[rows]
                if ordinal + d >= len(blocks):
                    assert np.isnan(got).all()
                    continue
                with torch.no_grad():
                    want = get_adapter(model).router_logits(blocks[ordinal + d], x).float().numpy()
                np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_generated_tokens_equal_generate(recorded, tok):
    _, model, result, trace, _ = recorded
    prompt_ids = tokenize(PROMPTS, tok, "prompts")
    for start in (0, 2):  # the two batches of the recording
        batch = prompt_ids[start:start + 2]
        ids, mask = left_pad(batch, 0, "cpu")
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        for i, row in enumerate(out[:, ids.shape[1]:].tolist()):
            gen = result.generated[start + i]
            assert row[:len(gen)] == gen
            assert all(t == 0 for t in row[len(gen):])  # generate padded after EOS
    info = {s.seq_id: s for s in trace.meta.sequences}
    assert [info[i].prompt_tokens for i in range(3)] == [len(p) for p in prompt_ids]
    assert [info[i].generated_tokens for i in range(3)] == [len(result.generated[i]) for i in range(3)]


def test_trace_metadata(recorded):
    name, model, _, trace, _ = recorded
    m = trace.meta
    assert m.model.family == name and m.status == "complete"
    far = {f"gate{d}": d for d in range(2, min(3, m.model.num_moe_layers - 1) + 1)}
    assert m.has_router_logits and set(m.predictors) == {"next-gate", "residual", *far}
    assert {name: m.predictors[name].target_offset for name in far} == far
    assert m.hidden_states.dim == 32 and "gate input" in m.hidden_states.what
    assert m.provenance["recorder"]["model_type"] == name
    assert m.weights_note == get_adapter(model).weights_note(get_adapter(model).blocks(model)[0])


def test_hidden_states_are_the_gate_inputs(recorded, tok):
    _, model, result, trace, _ = recorded
    keys, hidden = trace.hidden_states()
    assert len(keys) == len(trace)
    p = PROMPTS[2]
    tokens = tokenize([p], tok, "p")[0] + result.generated[2][:-1]
    blocks, ref = reference_routing(model, tokens)
    for block, (x, *_rest) in zip(blocks, ref):
        rows = ((keys.seq_id == 2) & (keys.layer == block.layer)).to_numpy()
        order = np.argsort(keys.pos.to_numpy()[rows])
        np.testing.assert_allclose(hidden[rows][order].astype(np.float32), x.numpy(), atol=2e-2, rtol=1e-2)


# ---- one family is enough for the recorder's own mechanics -----------------------------------------
def _record(model, tmp_path, name, tok, **options):
    path = tmp_path / f"{name}.parquet"
    result = record_trace(model, PROMPTS, path, tokenizer=tok, options=RecordOptions(**options))
    return result, read_trace(path).sorted()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_hidden_states_flag_does_not_change_routing(family, tmp_path, tok):
    model = tiny_model(family, seed=7)
    _, plain = _record(model, tmp_path, "plain", tok, batch_size=2, max_new_tokens=5)
    _, with_hidden = _record(model, tmp_path, "hidden", tok, batch_size=2, max_new_tokens=5, hidden_states=True)
    assert np.array_equal(plain.experts, with_hidden.experts)
    assert np.array_equal(plain.weights, with_hidden.weights)
    assert np.array_equal(plain.lookahead("next-gate"), with_hidden.lookahead("next-gate"), equal_nan=True)
    assert plain.meta.hidden_states is None and with_hidden.meta.hidden_states is not None


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v2"])
def test_padded_batch_records_what_single_prompts_record(family, tmp_path, tok):
    model = tiny_model(family, seed=8)
    r1, single = _record(model, tmp_path, "single", tok, batch_size=1, max_new_tokens=6, router_logits=True)
    r3, batched = _record(model, tmp_path, "batched", tok, batch_size=3, max_new_tokens=6, router_logits=True)
    assert r1.generated == r3.generated
    for col in ("seq_id", "pos", "layer", "phase"):
        assert np.array_equal(getattr(single, col), getattr(batched, col))
    np.testing.assert_allclose(batched.router_logits, single.router_logits, atol=1e-4, rtol=1e-4)
    bad = assert_same_choice(batched.experts, single.experts, single.router_logits, model.config.num_experts_per_tok,
                             family)
    good = np.setdiff1d(np.arange(len(single)), bad)
    np.testing.assert_allclose(batched.weights[good], single.weights[good], atol=1e-5)


def test_chunked_prefill_records_the_same_rows(tmp_path, tok):
    model = tiny_model("gpt_oss", seed=9)  # sliding-window layers make chunking non-trivial
    r0, whole = _record(model, tmp_path, "whole", tok, batch_size=3, max_new_tokens=4, router_logits=True)
    r5, chunked = _record(model, tmp_path, "chunked", tok, batch_size=3, max_new_tokens=4, router_logits=True,
                          prefill_chunk=5)
    assert r0.generated == r5.generated
    assert np.array_equal(whole.pos, chunked.pos) and np.array_equal(whole.phase, chunked.phase)
    np.testing.assert_allclose(chunked.router_logits, whole.router_logits, atol=1e-4, rtol=1e-4)
    assert_same_choice(chunked.experts, whole.experts, whole.router_logits, 2, "chunked")


def test_sequences_stop_at_eos(tmp_path, tok):
    model = tiny_model("olmoe", seed=4)
    probe = greedy_generate(model, tokenize(PROMPTS, tok, "p"), max_new_tokens=8)
    eos = probe.generated[0][2]  # the third token prompt 0 generates becomes EOS
    model.generation_config.eos_token_id = eos
    result, trace = _record(model, tmp_path, "eos", tok, batch_size=3, max_new_tokens=8)
    for seq, gen in result.generated.items():
        ref = probe.generated[seq]
        stop = ref.index(eos) + 1 if eos in ref else len(ref)
        assert gen == ref[:stop]
        decode = (trace.seq_id == seq) & (trace.phase == 1)
        assert decode.sum() == (len(gen) - 1) * len(trace.layers)
    assert len(result.generated[0]) == 3
    stops = {s.seq_id: s.attrs["stop"] for s in trace.meta.sequences}
    assert stops[0] == "eos"


def test_interrupted_recording_leaves_a_readable_partial_trace(tmp_path, tok):
    model = tiny_model("qwen2_moe", seed=3)
    calls = []

    def explode(module, args):
        calls.append(1)
        if len(calls) == 4:  # prefill + 2 decodes of the first batch, then boom
            raise KeyboardInterrupt("stop")

    handle = model.register_forward_pre_hook(explode)
    out = tmp_path / "cut.parquet"
    try:
        with pytest.raises(KeyboardInterrupt):
            record_trace(model, PROMPTS, out, tokenizer=tok, options=RecordOptions(batch_size=2, max_new_tokens=6))
    finally:
        handle.remove()
    assert not out.exists()
    partial = out.with_name(out.name + ".partial")
    with pytest.raises(TraceError, match="partial"):
        read_trace(partial)
    t = read_trace(partial, allow_partial=True)
    assert t.meta.status == "partial" and "KeyboardInterrupt" in t.meta.partial_reason
    prompt_lens = [len(x) for x in tokenize(PROMPTS[:2], tok, "p")]
    assert len(t) == (sum(prompt_lens) + 2 * 2) * len(t.layers)  # prefill + two decode steps of two sequences
    assert {s.seq_id: s.attrs.get("interrupted") for s in t.meta.sequences} == {0: True, 1: True}


def test_bad_inputs_are_named(tmp_path, tok):
    model = tiny_model("mixtral")
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        RecordOptions(batch_size=0)
    with pytest.raises(ValueError, match=r"prompt 0 \(big\) has token id 999 >= vocab_size 128"):
        record_trace(model, [Prompt(0, "big", input_ids=(5, 999))], tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="is text but the model has no tokenizer"):
        record_trace(model, PROMPTS, tmp_path / "x.parquet")
    wrong = ResidualVectors({0: torch.zeros(16), 1: torch.zeros(16)}, {}, "r.safetensors")
    with pytest.raises(ValueError, match=r"r.safetensors: residual vectors have size \[16\], the model's hidden size"):
        record_trace(model, PROMPTS, tmp_path / "x.parquet", tokenizer=tok, options=RecordOptions(residuals=wrong))
    wrong = ResidualVectors({0: torch.zeros(32)}, {}, "r.safetensors")
    with pytest.raises(ValueError, match=r"for MoE blocks \[0\], the model needs \[0, 1\]"):
        record_trace(model, PROMPTS, tmp_path / "x.parquet", tokenizer=tok, options=RecordOptions(residuals=wrong))
    assert not list(tmp_path.iterdir())  # nothing written for input errors


def test_recording_is_deterministic(tmp_path, tok):
    model = tiny_model("qwen3_moe", seed=11)
    for name in ("a", "b"):
        record_trace(model, PROMPTS, tmp_path / f"{name}.parquet", tokenizer=tok,
                     options=RecordOptions(batch_size=2, max_new_tokens=4))
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
