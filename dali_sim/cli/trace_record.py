"""``dali trace record`` and ``dali trace calibrate-residual``.

They need torch and transformers (``pip install -e '.[exec]'``).

dali_sim never imports torch: :mod:`dali_exec` is imported inside the command bodies only.
"""

from __future__ import annotations

from pathlib import Path

import click

from dali_sim.cli.common import MAX_NEW_TOKENS, MODEL_DTYPE, check_outputs, checkpoint_files, command_line, require_exec
from dali_sim.trace.provenance import default_provenance, file_sha256
from dali_sim.trace.schema import hidden_sidecar_name


def _exec_versions() -> dict[str, str]:
    from dali_sim.trace.provenance import software_versions

    return software_versions(("torch", "transformers", "safetensors"))


def _model_options(f):
    f = click.option("--dtype", type=MODEL_DTYPE, default="fp32", show_default=True,
                     help="Weights dtype; auto = the checkpoint's (bfloat16, float16, float32 also accepted).")(f)
    f = click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")(f)
    f = click.option("--model", "model_path", required=True, metavar="PATH_OR_NAME",
                     help="A local transformers checkpoint folder (or a name in the local HF cache); nothing is "
                          "downloaded. Families: mixtral, qwen2_moe, qwen3_moe, olmoe, flex_olmo, deepseek_v2, "
                          "deepseek_v3, glm4_moe, gpt_oss.")(f)
    return f


def _spec(model_path: str):
    """The trace's model spec, from the checkpoint's config.json (read before any weights are loaded)."""
    from dali_exec.models import get_adapter
    from dali_exec.recorder.loading import config_file, load_config
    from dali_sim.models.hf_config import spec_from_hf_config

    config = load_config(model_path)
    get_adapter(config)  # unsupported family: the list of supported ones
    return spec_from_hf_config(config_file(model_path) or config.to_dict(), name=Path(model_path).name or model_path)


@click.command("record")
@_model_options
@click.option("--prompts", "prompts_file", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Prompts: .txt (one per line), .jsonl or .json (strings, or objects with text/prompt or "
                   "input_ids, and optional name).")
@click.option("--batch-size", type=int, default=1, show_default=True,
              help="Prompts generated side by side (left-padded; padding is never recorded).")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=MAX_NEW_TOKENS, show_default=True,
              help="Tokens generated per prompt (fewer if EOS comes first); greedy decoding.")
@click.option("--prefill-chunk", type=int, default=0, show_default=True,
              help="Prompt positions per prefill forward pass; 0 = the whole prompt at once.")
@click.option("--hidden-states", is_flag=True,
              help="Also store every gate input (float16) in the sidecar OUT.hidden.parquet.")
@click.option("--router-logits", is_flag=True, help="Also store the full router logits of every row.")
@click.option("--residual", "residual_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Residual vectors from `dali trace calibrate-residual`: adds the `residual` lookahead column "
                   "(DALI). Without it only the `next-gate` column is recorded.")
@click.option("--no-next-gate", is_flag=True, help="Leave out the `next-gate` lookahead column.")
@click.option("--next-gates", type=click.IntRange(min=1), default=1, show_default=True,
              help="Record the routers of the next N MoE layers on each gate input: next-gate (l+1) and, for N >= 2, "
                   "`gate2` .. `gateN` (l+2 ..), the look-ahead HybriMoE reads (--next-gates 3).")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Trace to write (.parquet); OUT.parquet.partial if the run stops early.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary line.")
def record(model_path, dtype, device, prompts_file, batch_size, max_new_tokens, prefill_chunk, hidden_states,
           router_logits, residual_file, no_next_gate, next_gates, output, quiet) -> None:
    """Record the routing of a transformers MoE model while it generates greedily for each prompt.

    One row per (sequence, position, MoE layer), prefill and decode: top-k expert ids and weights,
    the lookahead columns `next-gate` (router of layer l+1 on the gate input of layer l), with
    --residual `residual` (the same plus DALI's residual vector) and with --next-gates 3 `gate2` and
    `gate3` (routers of layers l+2, l+3: HybriMoE); optionally router logits and gate inputs. See
    docs/recorder.md.

    \b
    dali trace record --model models/tiny-qwen3-moe --prompts prompts.jsonl --batch-size 4 -o t.parquet
    dali trace calibrate-residual --model models/tiny-qwen3-moe --texts calib.txt -o res.safetensors
    dali trace record --model models/tiny-qwen3-moe --prompts p.txt --residual res.safetensors -o t.parquet
    """
    inputs = [*checkpoint_files(model_path), prompts_file, residual_file]
    outputs = {"trace": output}
    if hidden_states:
        outputs["hidden-state sidecar"] = output.with_name(hidden_sidecar_name(output))
    check_outputs(outputs, inputs)
    require_exec("dali_exec.recorder")
    from dali_exec.recorder import RecordOptions, ResidualVectors, load_model, read_prompts, record_trace

    prompts = read_prompts(prompts_file)
    residuals = ResidualVectors.load(residual_file) if residual_file is not None else None
    options = RecordOptions(batch_size=batch_size, max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk,
                            router_logits=router_logits, hidden_states=hidden_states, next_gate=not no_next_gate,
                            residuals=residuals, next_gates=next_gates)
    spec = _spec(model_path)
    model, tokenizer = load_model(model_path, device=device, dtype=dtype, progress=not quiet)
    extra = {"model": model_path, "prompts": {"file": prompts_file.name, "sha256": file_sha256(prompts_file)}}
    if residual_file is not None:
        extra["residual"] = {"file": residual_file.name, "sha256": file_sha256(residual_file), **residuals.meta}
    provenance = default_provenance("record", command_line(), **extra)
    provenance["versions"] = _exec_versions()
    try:
        result = record_trace(model, prompts, output, tokenizer=tokenizer, options=options,
                              spec=spec, provenance=provenance,
                              prompts_source=prompts_file.name, progress=not quiet)
    except BaseException:
        partial = output.with_name(output.name + ".partial")
        if partial.exists():
            click.echo(f"stopped: partial trace kept at {partial} (read it with --allow-partial)", err=True)
        raise
    if not quiet:
        tokens = sum(len(g) for g in result.generated.values())
        click.echo(f"wrote {result.path}: {result.rows} rows, {len(result.generated)} sequences, "
                   f"{tokens} generated tokens")


@click.command("calibrate-residual")
@_model_options
@click.option("--texts", "texts_file", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Calibration texts, same formats as --prompts of `dali trace record`.")
@click.option("--batch-size", type=int, default=8, show_default=True, help="Texts per forward pass.")
@click.option("--max-length", type=int, default=512, show_default=True,
              help="Tokens kept per text (the rest is cut).")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Residual vectors to write (.safetensors).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary line.")
def calibrate_residual(model_path, dtype, device, texts_file, batch_size, max_length, output, quiet) -> None:
    """Compute DALI's residual vectors: per MoE layer l, the mean over calibration tokens of (gate input
    of MoE layer l+1 - gate input of MoE layer l). `dali trace record --residual` uses them."""
    if max_length < 1:
        raise click.BadParameter(f"must be >= 1, got {max_length}", param_hint="--max-length")
    check_outputs({"residual file": output}, [*checkpoint_files(model_path), texts_file])
    require_exec("dali_exec.recorder")
    from dali_exec.models import get_adapter
    from dali_exec.recorder import calibrate_residuals, load_model, read_prompts, tokenize

    texts = read_prompts(texts_file)
    model, tokenizer = load_model(model_path, device=device, dtype=dtype, progress=not quiet)
    from dali_exec.recorder.record import special_ids

    _, pad = special_ids(model, tokenizer)
    ids = tokenize(texts, tokenizer, str(texts_file), max_length=max_length)
    meta = {"model": model_path, "texts": texts_file.name, "texts_sha256": file_sha256(texts_file),
            "max_length": max_length, "command": command_line(), "versions": _exec_versions()}
    vectors = calibrate_residuals(model, get_adapter(model), ids, batch_size=batch_size, pad_id=pad,
                                  progress=not quiet, meta=meta)
    path = vectors.save(output)
    if not quiet:
        click.echo(f"wrote {path}: {len(vectors.vectors)} residual vectors of size {vectors.hidden_size} "
                   f"from {vectors.meta['num_tokens']} tokens of {vectors.meta['num_texts']} texts")
