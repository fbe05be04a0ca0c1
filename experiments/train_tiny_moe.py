"""Train ``dali-tiny-moe``: a small, really trained Qwen3-MoE causal LM over bytes, on the CPU.

    python experiments/train_tiny_moe.py --out models/dali-tiny-moe --prompts-dir prompts \
        --steps 3000 --batch-size 16 --seq-len 256 --seed 0 --threads 1 --max-minutes 31

(the shipped model's command; ``--max-minutes`` stopped it after 2840 steps, so ``--stop-after 2840`` in its place
reproduces it). ``--card-only`` rewrites the model card, loss curve and prompt files of a finished run.

Data: the five multi-domain text samples of the OLMoE project (``../shared/validation-traces/OLMoE/text``:
arXiv, books, C4 web text, GitHub code, Wikipedia). The last ``--heldout-frac`` (5 %) of the bytes of
every file is held out for evaluation and for the shipped prompts; training windows are drawn from the
rest, round-robin over the five domains, each window ``<s>`` + ``seq_len - 1`` raw bytes (token id =
byte value; ``<pad>`` = 256, ``<s>`` = 257, ``</s>`` = 258).

Model: ``Qwen3MoeForCausalLM`` from transformers (no forked modeling code), every block MoE, trained
with next-byte cross entropy plus ``--aux-coef`` x the Switch-Transformer load-balancing loss
(transformers' ``load_balancing_loss_func``) computed per layer and averaged over layers.

Writes into ``--out``: ``config.json``, ``generation_config.json``, ``model.safetensors`` (fp32),
``tokenizer.json``, ``tokenizer_config.json``, ``training_log.csv``, ``loss_curve.png``,
``routing_stats.json`` (per-domain expert usage on held-out text, at initialisation and after training,
with Jensen-Shannon divergences), ``training_summary.json`` and the model card ``README.md``. With
``--prompts-dir`` it also writes the prompt file cut from the held-out text (``multidomain.txt``, one
prompt per line; ``multidomain.jsonl`` with provenance) and its ``README.md``.

Everything is seeded; on one thread the run is deterministic.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "validation-traces" / "OLMoE" / "text"

#: domain name (as in the OLMoE routing_counts) -> text file
DOMAINS = {
    "arxiv": "arxiv_texts.txt",
    "book": "b3g_texts.txt",
    "c4": "c4_texts.txt",
    "github": "github_oss_with_stack_texts.txt",
    "wikipedia": "wikipedia_texts.txt",
}
DOMAIN_DESC = {
    "arxiv": "arXiv papers (LaTeX source)",
    "book": "books (b3g)",
    "c4": "C4 web text",
    "github": "GitHub code (OSS with the Stack)",
    "wikipedia": "Wikipedia, incl. non-English pages",
}
SOURCE = {
    "repository": "github.com/allenai/OLMoE",
    "commit": "357454f4f647385839c0ff6b99a688dc7cd9c13f",
    "path_in_repo": "scripts/routing_output/text/ (copied verbatim to shared/validation-traces/OLMoE/text)",
    "licence": "repository Apache-2.0; the texts are samples of the OLMoE pre-training sources (Dolma-derived, "
               "ODC-BY for the collection; upstream licences are those of the respective sources)",
}
PAD_ID, BOS_ID, EOS_ID = 256, 257, 258
SPECIALS = ("<pad>", "<s>", "</s>")
PROMPTS_PER_DOMAIN = {"arxiv": 7, "book": 7, "c4": 6, "github": 6, "wikipedia": 6}
VOCAB_SIZE = 259
LN2 = math.log(2.0)


# ----------------------------------------------------------------------------------------------- data
def load_domains(data_dir: Path, heldout_frac: float) -> dict[str, dict]:
    out = {}
    for dom, fname in DOMAINS.items():
        raw = (data_dir / fname).read_bytes()
        split = int(len(raw) * (1.0 - heldout_frac))
        out[dom] = {
            "file": fname, "bytes": raw, "split": split, "sha1": hashlib.sha1(raw).hexdigest(),
            "git_blob": hashlib.sha1(b"blob %d\0" % len(raw) + raw).hexdigest(),
            "train": np.frombuffer(raw[:split], dtype=np.uint8), "heldout": np.frombuffer(raw[split:], dtype=np.uint8),
        }
    return out


def heldout_windows(data: dict[str, dict], seq_len: int, max_windows: int | None = None) -> dict[str, np.ndarray]:
    """Non-overlapping ``<s>`` + (seq_len - 1)-byte windows of each domain's held-out bytes, in order."""
    n = seq_len - 1
    out = {}
    for dom, d in data.items():
        h = d["heldout"].astype(np.int64)
        k = len(h) // n
        if max_windows is not None:
            k = min(k, max_windows)
        w = h[: k * n].reshape(k, n)
        out[dom] = np.concatenate([np.full((k, 1), BOS_ID, dtype=np.int64), w], axis=1)
    return out


def sample_batch(data: dict[str, dict], doms: list[str], rng: np.random.Generator, step: int,
                 batch_size: int, seq_len: int) -> torch.Tensor:
    """Training windows; domains round-robin (so every domain gets the same share), offsets uniform."""
    n = seq_len - 1
    rows = np.empty((batch_size, seq_len), dtype=np.int64)
    rows[:, 0] = BOS_ID
    for i in range(batch_size):
        tr = data[doms[(step * batch_size + i) % len(doms)]]["train"]
        o = int(rng.integers(0, len(tr) - n))
        rows[i, 1:] = tr[o:o + n]
    return torch.from_numpy(rows)


def ngram_baselines(data: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Held-out cross entropy (bits/byte) of add-one-smoothed unigram and bigram byte models fitted on
    the domain's own training bytes (the bigram's first byte scored by the unigram)."""
    out = {}
    for dom, d in data.items():
        tr, ho = d["train"].astype(np.int64), d["heldout"].astype(np.int64)
        uni = np.bincount(tr, minlength=256) + 1.0
        p1 = uni / uni.sum()
        big = np.ones((256, 256))
        np.add.at(big, (tr[:-1], tr[1:]), 1.0)
        p2 = big / big.sum(axis=1, keepdims=True)
        h1 = -np.log2(p1[ho]).mean()
        h2 = -(np.log2(p1[ho[0]]) + np.log2(p2[ho[:-1], ho[1:]]).sum()) / len(ho)
        out[dom] = {"unigram": float(h1), "bigram": float(h2)}
    return out


# ----------------------------------------------------------------------------------------- prompts
def make_prompts(data: dict[str, dict], per_domain: dict[str, int], min_len: int = 48,
                 max_len: int = 160) -> list[dict]:
    """Single-line prompts cut from the held-out bytes: for each domain, lines of ``min_len``..``max_len``
    bytes (after stripping), valid UTF-8, no tabs/control characters, taken at evenly spaced positions of
    the held-out part. Returns records with domain, file, absolute byte offsets and text."""
    out = []
    for dom, d in data.items():
        raw, split = d["bytes"], d["split"]
        cands = []
        pos = raw.index(b"\n", split) + 1  # start at the first full line of the held-out part
        while pos < len(raw):
            end = raw.find(b"\n", pos)
            end = len(raw) if end < 0 else end
            line = raw[pos:end]
            s = len(line) - len(line.lstrip())
            e = len(line.rstrip())
            body = line[s:e]
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            if (text is not None and min_len <= len(body) <= max_len and text.isprintable()
                    and sum(c.isalpha() for c in text) >= len(text) // 3):
                cands.append((pos + s, pos + e, text))
            pos = end + 1
        k = per_domain[dom]
        if len(cands) < k:
            raise SystemExit(f"{dom}: only {len(cands)} candidate prompt lines in the held-out part")
        picks = [cands[int((i + 0.5) * len(cands) / k)] for i in range(k)]
        for start, end, text in picks:
            out.append({"domain": dom, "file": d["file"], "start": start, "end": end, "text": text})
    return out


def write_prompts(prompts_dir: Path, prompts: list[dict], data: dict[str, dict], heldout_frac: float) -> None:
    prompts_dir.mkdir(parents=True, exist_ok=True)
    (prompts_dir / "multidomain.txt").write_text("".join(p["text"] + "\n" for p in prompts), encoding="utf-8")
    with open(prompts_dir / "multidomain.jsonl", "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")
    counts = {dom: sum(p["domain"] == dom for p in prompts) for dom in DOMAINS}
    lines = [
        "# Prompts", "",
        "Short multi-domain prompts for dali's examples (recording routing traces from a model, running the",
        "executor), cut from the **held-out** part of the OLMoE multi-domain texts: the last "
        f"{heldout_frac:.0%} of the bytes of each file, which `experiments/train_tiny_moe.py` never trains on.",
        "So they are unseen text for `models/dali-tiny-moe`.", "",
        "## Files", "",
        f"* `multidomain.txt`: {len(prompts)} prompts, **one prompt per line** (UTF-8, `\\n`-terminated, no "
        "empty lines, no leading/trailing spaces). Read it as `Path(f).read_text('utf-8').splitlines()`.",
        "* `multidomain.jsonl`: the same prompts in the same order, one JSON object per line with "
        "`domain`, `file`, `start`, `end` (byte offsets of the prompt in the source file, end exclusive: "
        "`file_bytes[start:end].decode('utf-8') == text`) and `text`.", "",
        "Domains (in file order): " + ", ".join(f"{dom} ({n})" for dom, n in counts.items()) + ".", "",
        "## How they were chosen", "",
        "`python experiments/train_tiny_moe.py --prompts-dir prompts ...` (function `make_prompts`): in each",
        "domain's held-out part, every whole line of 48-160 bytes after stripping whitespace that is valid",
        "UTF-8, printable (no tabs or control characters) and at least one-third letters is a candidate;",
        "the prompts are the candidates at evenly spaced positions. Deterministic; no manual editing.", "",
        "## Source and licence", "",
        f"* Source: `{SOURCE['repository']}` at commit `{SOURCE['commit']}`, files `scripts/routing_output/text/*`",
        "  as copied to `shared/validation-traces/OLMoE/text/` (see its README).",
        f"* Licence: {SOURCE['licence']}.", "",
        "Files (git blob id as listed in the OLMoE README, and `sha1sum` of the file):", "",
        "| file | git blob id | sha1sum | held-out part (bytes, end exclusive) |", "|---|---|---|---|",
    ]
    for d in data.values():
        lines.append(f"| `{d['file']}` | `{d['git_blob']}` | `{d['sha1']}` | {d['split']}-{len(d['bytes'])} |")
    lines += ["", "| # | domain | file | bytes | text (start) |", "|---|---|---|---|---|"]
    for i, p in enumerate(prompts, 1):
        snippet = p["text"][:60].replace("|", "\\|").replace("`", "'")
        lines.append(f"| {i} | {p['domain']} | `{p['file']}` | {p['start']}-{p['end']} | {snippet}... |")
    (prompts_dir / "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------- tokenizer, model
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by the ByteLevel pre-tokenizer/decoder."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tokenizer(max_len: int):
    """Byte-level tokenizer: token id = byte value (no merges) + <pad>/<s>/</s>; <s> is prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    for i, s in enumerate(SPECIALS):
        vocab[s] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS_ID)])
    # split_special_tokens: text that happens to contain "<s>" is encoded as bytes, so decode(encode(x)) == x
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   model_max_length=max_len, split_special_tokens=True, padding_side="left")


def build_config(args):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        intermediate_size=args.moe_intermediate, moe_intermediate_size=args.moe_intermediate,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=args.max_positions,
        rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.02,
        output_router_logits=False, router_aux_loss_coef=args.aux_coef,
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, use_cache=True,
    )


def per_layer_aux(router_logits, num_experts: int, top_k: int) -> torch.Tensor:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    return torch.stack([load_balancing_loss_func((g,), num_experts, top_k) for g in router_logits]).mean()


# ------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(model, windows: dict[str, np.ndarray], batch: int, top_k: int, routing: bool) -> dict:
    """Bits/byte per domain and (optionally) per-window expert counts: counts[dom] is
    (windows, layers, experts) of top-k selections over the window's tokens (incl. <s>)."""
    model.eval()
    res = {"bpb": {}, "counts": {}}
    E = model.config.num_experts
    for dom, w in windows.items():
        nll, nbytes, counts = 0.0, 0, []
        for i in range(0, len(w), batch):
            x = torch.from_numpy(w[i:i + batch])
            out = model(input_ids=x, output_router_logits=routing)
            logits = out.logits[:, :-1].float()
            nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
            nbytes += x[:, 1:].numel()
            if routing:
                b, t = x.shape
                per_layer = []
                for g in out.router_logits:
                    sel = torch.topk(g, top_k, dim=-1).indices.reshape(b, t * top_k)
                    per_layer.append(F.one_hot(sel, E).sum(1))  # (b, E)
                counts.append(torch.stack(per_layer, 1).numpy())
        res["bpb"][dom] = nll / nbytes / LN2
        if routing:
            res["counts"][dom] = np.concatenate(counts, 0)
    model.train()
    return res


def _jsd_bits(p: np.ndarray, q: np.ndarray) -> float:
    p, q = p / p.sum(), q / q.sum()
    m = 0.5 * (p + q)

    def kl(a, b):
        nz = a > 0
        return float((a[nz] * np.log2(a[nz] / b[nz])).sum())

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def routing_statistics(counts: dict[str, np.ndarray], top_k: int, top_n: int = 4) -> dict:
    """Per-layer expert-usage distributions per domain and how much they differ.

    * ``jsd_between_domains``: JSD (bits, 0..1) between two domains' usage distributions, per layer.
    * ``jsd_within_domain_split_half``: JSD between the first and second half of the same domain's held-out
      windows (sampling noise + drift inside a domain), per layer; the between/within ratio shows domain
      specialisation beyond noise.
    * ``domain_id_accuracy``: classify each window of the second half by its routing histogram (all layers,
      L1 distance to the per-domain centroids of the first half); chance = 1/5.
    """
    doms = list(counts)
    L, E = next(iter(counts.values())).shape[1:]
    dist = {d: counts[d].sum(0) for d in doms}  # (L, E)
    pairs = [(a, b) for i, a in enumerate(doms) for b in doms[i + 1:]]
    between = {f"{a}|{b}": [_jsd_bits(dist[a][l], dist[b][l]) for l in range(L)] for a, b in pairs}
    within = {}
    for d in doms:
        h = len(counts[d]) // 2
        c1, c2 = counts[d][:h].sum(0), counts[d][h:].sum(0)
        within[d] = [_jsd_bits(c1[l], c2[l]) for l in range(L)]
    mean_between = [float(np.mean([v[l] for v in between.values()])) for l in range(L)]
    mean_within = [float(np.mean([v[l] for v in within.values()])) for l in range(L)]
    # nearest-centroid domain identification from routing
    cents, tests = {}, []
    for d in doms:
        h = len(counts[d]) // 2
        norm = counts[d] / counts[d].sum(-1, keepdims=True)
        cents[d] = norm[:h].mean(0)
        tests += [(d, x) for x in norm[h:]]
    correct = 0
    per_layer_correct = np.zeros(L)
    for d, x in tests:
        dists = {c: np.abs(x - cents[c]).sum() for c in doms}
        correct += min(dists, key=dists.get) == d
        for l in range(L):
            dl = {c: np.abs(x[l] - cents[c][l]).sum() for c in doms}
            per_layer_correct[l] += min(dl, key=dl.get) == d
    total = sum(dist[d] for d in doms)
    share = total / total.sum(-1, keepdims=True)
    ent = -(share * np.log(np.where(share > 0, share, 1))).sum(-1) / math.log(E)
    top = {}
    for d in doms:
        s = dist[d] / dist[d].sum(-1, keepdims=True)
        top[d] = [[{"expert": int(e), "share": round(float(s[l, e]), 4)} for e in np.argsort(-s[l], kind="stable")[:top_n]]
                  for l in range(L)]
    return {
        "tokens_per_domain": {d: int(counts[d].sum() // (L * top_k)) for d in doms},
        "expert_counts": {d: dist[d].astype(int).tolist() for d in doms},
        "jsd_between_domains": {k: [round(x, 5) for x in v] for k, v in between.items()},
        "jsd_within_domain_split_half": {k: [round(x, 5) for x in v] for k, v in within.items()},
        "mean_jsd_between_domains": [round(x, 5) for x in mean_between],
        "mean_jsd_within_domain": [round(x, 5) for x in mean_within],
        "between_over_within": [round(b / w, 2) if w > 0 else None for b, w in zip(mean_between, mean_within)],
        "domain_id_accuracy": round(correct / len(tests), 4),
        "domain_id_accuracy_per_layer": [round(float(c) / len(tests), 4) for c in per_layer_correct],
        "domain_id_windows": len(tests),
        "top_experts": top,
        "all_domains_usage_entropy_normalised": [round(float(x), 4) for x in ent],
        "all_domains_max_expert_share_times_E": [round(float(x), 3) for x in share.max(-1) * E],
    }


# ------------------------------------------------------------------------------------------- card
def _fmt_cmd(argv: list[str]) -> str:
    return "python experiments/train_tiny_moe.py " + " ".join(shlex.quote(a) for a in argv)


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def plot_curves(log_rows: list[dict], baselines: dict, path: Path, doms: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    steps = [r["step"] for r in log_rows]
    ax.plot(steps, [r["train_bpb"] for r in log_rows], color="0.6", lw=0.8, label="train (all domains)")
    colors = dict(zip(doms, ["C0", "C1", "C2", "C3", "C4"]))
    ev = [r for r in log_rows if r.get("eval_bpb_mean") not in (None, "")]
    for d in doms:
        ax.plot([r["step"] for r in ev], [r[f"eval_bpb_{d}"] for r in ev], color=colors[d], marker=".", lw=1.2,
                label=f"held-out {d}")
        ax.axhline(baselines[d]["unigram"], color=colors[d], ls=":", lw=0.8)
    ax.axhline(8.0, color="k", ls="--", lw=0.6)
    ax.set_ylim(0, 8.3)
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_title("next-byte loss (dotted: per-domain unigram baseline; dashed: uniform)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    ax2.plot(steps, [r["aux_loss"] for r in log_rows], color="C5", lw=0.8)
    ax2.set_xlabel("step")
    ax2.set_ylabel("load-balancing loss (per layer, mean)")
    ax2.set_title("aux loss (top_k = perfectly balanced)", fontsize=9)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _throughput_range(out: Path, args) -> str:
    """', 10-step intervals from A to B' from training_log.csv (the machine may be shared)."""
    try:
        with open(out / "training_log.csv", newline="") as f:
            rows = [(int(r["step"]), float(r["elapsed_s"])) for r in csv.DictReader(f)]
    except (OSError, KeyError, ValueError):
        return ""
    rates = [(s1 - s0) * args.batch_size * args.seq_len / (t1 - t0)
             for (s0, t0), (s1, t1) in zip(rows, rows[1:]) if t1 > t0 and s1 - s0 == args.log_every]
    if len(rates) < 2:
        return ""
    lo, hi = np.percentile(rates, [5, 95])
    return f"; {args.log_every}-step intervals: 5th-95th percentile {lo:.0f}-{hi:.0f} tokens/s"


def write_card(out: Path, args, argv: list[str], summary: dict, stats: dict, stats0: dict,
               examples: list[dict]) -> None:
    doms = list(DOMAINS)
    cfg = dict(summary["config"], num_experts=args.experts)  # transformers 5 saves it as num_local_experts
    bl, ev = summary["baselines_bits_per_byte"], summary["heldout_bits_per_byte"]
    ev0 = summary["heldout_bits_per_byte_at_init"]
    L = cfg["num_hidden_layers"]
    fm = ["---", "license: apache-2.0", "library_name: transformers", "pipeline_tag: text-generation",
          "tags: [moe, qwen3_moe, byte-level, tiny, dali]", "---", ""]
    t = [
        "# dali-tiny-moe", "",
        "A **tiny, really trained Mixture-of-Experts causal LM over bytes** in Hugging Face format, made for",
        "dali's offline tests and examples: the routing-trace recorder and the offloading executor load it",
        "like any real model (`AutoModelForCausalLM.from_pretrained`), and its routing is not random: it was",
        "trained on five text domains with a load-balancing loss and its experts specialise by domain.",
        "It is **not** a useful language model.", "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "tok = AutoTokenizer.from_pretrained('models/dali-tiny-moe')",
        "model = AutoModelForCausalLM.from_pretrained('models/dali-tiny-moe')",
        "x = tok('The results show that', return_tensors='pt')",
        "y = model.generate(**x, max_new_tokens=48, do_sample=False)",
        "print(tok.decode(y[0], skip_special_tokens=True))",
        "```", "",
        "## Architecture", "",
        "`Qwen3MoeForCausalLM` (transformers `model_type: qwen3_moe`, unmodified modeling code): every block",
        "is MoE with plain routed experts (no shared expert), softmax router, top-k with renormalised weights",
        "(`norm_topk_prob: true`).", "",
        "| | |", "|---|---|",
        f"| layers (all MoE) | {L} |",
        f"| hidden size | {cfg['hidden_size']} |",
        f"| attention | {cfg['num_attention_heads']} query heads, {cfg['num_key_value_heads']} KV heads (GQA), head dim {cfg['head_dim']}, RoPE, QK-norm |",
        f"| experts per layer | {cfg['num_experts']} routed, top-{cfg['num_experts_per_tok']} |",
        f"| expert FFN | SwiGLU, intermediate size {cfg['moe_intermediate_size']} |",
        f"| vocabulary | {VOCAB_SIZE}: 256 bytes (token id = byte value) + `<pad>`={PAD_ID}, `<s>`={BOS_ID}, `</s>`={EOS_ID} |",
        f"| context | {cfg['max_position_embeddings']} positions (trained on {args.seq_len}) |",
        "| embeddings | tied input/output |",
        f"| parameters | {summary['params']['total']:,} total, {summary['params']['experts']:,} in experts "
        f"({summary['params']['per_expert']:,} per expert), ~{summary['params']['active_per_token']:,} active per token |",
        f"| weights | `model.safetensors`, float32, {summary['weights_bytes'] / 2**20:.2f} MiB |", "",
        "Tokenizer: a `tokenizers` byte-level BPE with no merges (ByteLevel pre-tokenizer and decoder), saved as",
        "a fast tokenizer (`tokenizer.json`); it prepends `<s>`, encodes any UTF-8 text byte by byte",
        "(`decode(encode(text), skip_special_tokens=True) == text`, also for text containing `<s>`), pads on the",
        "left. The model never saw `</s>` in training, so generation runs to `max_new_tokens`.", "",
        f"Saved with transformers {summary['transformers']} (tested with it only). The weights use the per-expert",
        "tensor names (`mlp.experts.<i>.{gate,up,down}_proj.weight`) and `config.json` carries both `num_experts`",
        "and `num_local_experts`, so transformers 4.x should read it too (untested).", "",
        "dali reads the config: `dali_sim.models.hf_config.spec_from_hf_config('models/dali-tiny-moe')` gives",
        f"`{summary['spec']}`.", "",
        "## Training", "",
        "Command, exactly as run (from the repository root, with the shared folder next to it):", "",
        "```", _fmt_cmd(argv), "```", "",
        f"* Machine: {summary['machine']}; `torch.set_num_threads({args.threads})`; torch {torch.__version__}, "
        f"transformers {summary['transformers']}.",
        f"* Wall time: {summary['train_seconds'] / 60:.1f} min of training ({summary['total_seconds'] / 60:.1f} min "
        f"for the whole script incl. evaluation), {summary['tokens_seen']:,} training tokens "
        f"({summary['tokens_per_second']:.0f} tokens/s on average{_throughput_range(out, args)}).",
        f"* {summary['steps_run']} steps x batch {args.batch_size} x {args.seq_len} tokens; AdamW (lr {args.lr:g}, "
        f"betas (0.9, 0.95), weight decay {args.weight_decay:g}), {args.warmup} warm-up steps then cosine to "
        f"{args.min_lr_frac:g} x lr at step {summary['steps_requested']}; gradient clipping 1.0; seed {args.seed}.",
    ]
    if summary["steps_run"] < summary["steps_requested"]:
        t += [f"* `--max-minutes` stopped the run after {summary['steps_run']} of the {summary['steps_requested']} "
              f"scheduled steps (lr then {summary['final_lr']:.2g}, the schedule's end is {args.min_lr_frac * args.lr:.2g}). "
              "The run is deterministic on one thread: the same command with "
              f"`--stop-after {summary['steps_run']}` in place of `--max-minutes {args.max_minutes:g}` reproduces it "
              "(with the same software; another CPU type may differ in the last bits)."]
    t += [
        f"* Loss: next-byte cross entropy + {args.aux_coef:g} x the Switch-Transformer load-balancing loss "
        "(transformers' `load_balancing_loss_func`, computed per layer and averaged; equals top_k when perfectly "
        "balanced).",
        f"* Code: `experiments/train_tiny_moe.py` (repository commit `{summary['git_commit'][:12]}` plus the working tree).", "",
        "### Data", "",
        "The multi-domain text samples of the OLMoE project (the texts behind its routing analysis), as",
        "copied verbatim to `shared/validation-traces/OLMoE/text/`:", "",
        f"* Source: `{SOURCE['repository']}`, commit `{SOURCE['commit']}`, `scripts/routing_output/text/`.",
        f"* Licence: {SOURCE['licence']}.",
        f"* Split: the last {args.heldout_frac:.0%} of the bytes of each file is held out (evaluation, routing",
        "  statistics, `prompts/`); training windows are `<s>` + 255 bytes at uniform offsets of the other "
        f"{1 - args.heldout_frac:.0%}, the five domains round-robin (equal share).", "",
        "| domain | file | git blob id | training bytes | held-out bytes |", "|---|---|---|---|---|",
    ]
    for d in doms:
        s = summary["data"][d]
        t.append(f"| {d}: {DOMAIN_DESC[d]} | `{s['file']}` | `{s['git_blob'][:12]}` | {s['train_bytes']:,} | "
                 f"{s['heldout_bytes']:,} |")
    t += [
        "", "### Loss curve", "", "![loss curve](loss_curve.png)", "",
        "Per-step log: `training_log.csv` (step, tokens, lr, train cross entropy in bits/byte, aux loss,",
        "elapsed seconds, and the held-out bits/byte of a fixed 8-window subset per domain every "
        f"{args.eval_every} steps).", "",
        "## Held-out loss (bits per byte)", "",
        "On all held-out bytes of each domain, in non-overlapping 256-token windows (`<s>` + 255 bytes);",
        "baselines are add-one-smoothed byte unigram / bigram models fitted on the domain's own training bytes.", "",
        "| domain | model | at init | unigram baseline | bigram baseline |", "|---|---|---|---|---|",
    ]
    for d in doms:
        t.append(f"| {d} | **{ev[d]:.3f}** | {ev0[d]:.3f} | {bl[d]['unigram']:.3f} | {bl[d]['bigram']:.3f} |")
    def mean(x):
        return sum(x.values()) / len(x)

    t.append(f"| mean | **{mean(ev):.3f}** | {mean(ev0):.3f} | {mean({d: bl[d]['unigram'] for d in doms}):.3f} | "
             f"{mean({d: bl[d]['bigram'] for d in doms}):.3f} |")
    t += [
        "", "## Routing statistics", "",
        "`routing_stats.json`: for every domain's held-out text, the top-k selections per layer and expert",
        "(`expert_counts`), after training and at initialisation (`at_init`), and the statistics below.",
        "JSD = Jensen-Shannon divergence in bits (0 = same distribution, 1 = disjoint) between per-layer",
        "expert-usage distributions; *within* = between the first and the second half of the same domain's",
        "held-out windows (what sampling noise and drift inside a domain alone give).", "",
        "| layer | mean JSD between domains | mean JSD within domain | ratio | same at init (between / within) | usage entropy / log E | max expert share x E |",
        "|---|---|---|---|---|---|---|",
    ]
    for l in range(L):
        t.append(f"| {l} | {stats['mean_jsd_between_domains'][l]:.4f} | {stats['mean_jsd_within_domain'][l]:.4f} | "
                 f"{stats['between_over_within'][l]} | {stats0['mean_jsd_between_domains'][l]:.4f} / "
                 f"{stats0['mean_jsd_within_domain'][l]:.4f} | {stats['all_domains_usage_entropy_normalised'][l]:.3f} | "
                 f"{stats['all_domains_max_expert_share_times_E'][l]:.2f} |")
    t += [
        "",
        "Domain identification from routing alone (each held-out window of the second half classified by",
        f"its per-layer expert histogram, nearest centroid of the first half; {stats['domain_id_windows']} windows,",
        f"chance 20%): **{stats['domain_id_accuracy']:.1%}** after training (per layer: "
        + ", ".join(f"{a:.0%}" for a in stats["domain_id_accuracy_per_layer"])
        + f"), {stats0['domain_id_accuracy']:.1%} at initialisation.", "",
        "Pairwise JSD between domains (mean over layers):", "",
        "| | " + " | ".join(doms) + " |", "|---" * (len(doms) + 1) + "|",
    ]
    for a in doms:
        row = []
        for b in doms:
            if a == b:
                row.append("-")
            else:
                k = f"{a}|{b}" if f"{a}|{b}" in stats["jsd_between_domains"] else f"{b}|{a}"
                row.append(f"{np.mean(stats['jsd_between_domains'][k]):.3f}")
        t.append(f"| {a} | " + " | ".join(row) + " |")
    t += ["", "Each domain's most used experts (share of that layer's top-k selections; uniform = "
          f"{1 / cfg['num_experts']:.1%}):", "",
          "| domain | " + " | ".join(f"layer {l}" for l in range(L)) + " |", "|---" * (L + 1) + "|"]
    for d in doms:
        cells = [", ".join(f"{e['expert']} ({e['share']:.0%})" for e in stats["top_experts"][d][l]) for l in range(L)]
        t.append(f"| {d} | " + " | ".join(cells) + " |")
    if examples:
        t += ["", "## Examples", "",
              "Greedy continuations (48 new bytes) of the first prompt of each domain in `prompts/multidomain.txt`",
              "(held-out text, see `prompts/README.md`): the prompt, then `\u2502`, then what the model wrote.", ""]
        for e in examples:
            body = (e["prompt"] + "\u2502" + e["continuation"]).replace("```", "'''")
            t += [f"{e['domain']}:", "```", body, "```"]
    t += [
        "", "## Intended use", "",
        "Offline tests and examples of dali: recording routing traces with the recorder, residual-vector",
        "calibration, running the offloading executor and comparing its generated tokens with plain",
        "transformers, and checking the simulator against a model whose routing has real structure (domain",
        "specialisation, load balance, cross-layer correlation). Small enough to ship in the repository and",
        "to run on any CPU in seconds.", "",
        "## Limitations", "",
        "* Tiny and briefly trained: it continues text with locally plausible bytes (words, LaTeX, code",
        "  tokens) but produces no meaningful content. Not for any downstream use.",
        "* Byte-level, so sequences are ~4x longer than with a subword tokenizer, and the routing statistics",
        "  are per byte; expert sizes are toy sizes, so timings measured with it say little about real models.",
        f"* Trained on {args.seq_len}-token windows only; longer contexts (up to {cfg['max_position_embeddings']}) are untested.",
        "* Inherits whatever biases the five text samples have; the Wikipedia sample is partly non-English.",
        "",
    ]
    (out / "README.md").write_text("\n".join(fm + t), encoding="utf-8")


# ------------------------------------------------------------------------------------------- main
def lr_schedule(args, step: int) -> float:
    """Linear warm-up to --lr, then cosine down to --min-lr-frac x --lr at step --steps."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    prog = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "models" / "dali-tiny-moe", help="output model folder")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA, help="folder with the OLMoE *_texts.txt files")
    p.add_argument("--prompts-dir", type=Path, default=None, help="also write the held-out prompt file here")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training window incl. <s>")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--aux-coef", type=float, default=0.01, help="load-balancing loss coefficient")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-intermediate", type=int, default=48)
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--heldout-frac", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop training early after this many minutes (safety; the card reports the steps run)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop after this many steps, the lr schedule still following --steps (reproduces a run that "
                        "--max-minutes stopped)")
    p.add_argument("--card-only", action="store_true",
                   help="only rewrite README.md and loss_curve.png of a finished run in --out (and the prompt files "
                        "if --prompts-dir is given); no training")
    return p.parse_args(argv)


def compat_files(out: Path, num_experts: int) -> None:
    """Make the saved files readable by transformers 4 as well as 5 (idempotent): transformers 5 writes the
    expert count only as ``num_local_experts`` (Qwen3-MoE's 4.x config reads ``num_experts``, default 128) and
    names the tokenizer class ``TokenizersBackend`` (4.x: ``PreTrainedTokenizerFast``, which 5 maps back)."""
    cfg = json.loads((out / "config.json").read_text())
    if cfg.get("num_experts") != num_experts:
        cfg["num_experts"] = num_experts
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")


def rewrite_card(out: Path, prompts_dir: Path | None = None) -> None:
    """Rewrite README.md and loss_curve.png from the files a finished run left in ``out`` (and the prompt
    files, which are a deterministic function of the data)."""
    summary = json.loads((out / "training_summary.json").read_text())
    routing = json.loads((out / "routing_stats.json").read_text())
    args = parse_args(summary["argv"])
    compat_files(out, args.experts)
    summary.setdefault("final_lr", lr_schedule(args, summary["steps_run"] - 1))
    data = load_domains(args.data_dir, args.heldout_frac)
    for d, v in summary["data"].items():
        assert v["sha1"] == data[d]["sha1"], f"{d}: the data changed since training"
        v.setdefault("git_blob", data[d]["git_blob"])
    (out / "training_summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    if prompts_dir is not None:
        write_prompts(prompts_dir, make_prompts(data, PROMPTS_PER_DOMAIN), data, args.heldout_frac)
    with open(out / "training_log.csv", newline="") as f:
        rows = [{k: (float(v) if v != "" else None) for k, v in r.items()} for r in csv.DictReader(f)]
    plot_curves(rows, summary["baselines_bits_per_byte"], out / "loss_curve.png", list(DOMAINS))
    write_card(out, args, summary["argv"], summary, routing["after_training"], routing["at_init"],
               summary["examples"])


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.card_only:
        rewrite_card(args.out, args.prompts_dir)
        return 0
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    import transformers
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    transformers.logging.set_verbosity_error()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    data = load_domains(args.data_dir, args.heldout_frac)
    doms = list(DOMAINS)
    prompts = []
    if args.prompts_dir is not None:
        prompts = make_prompts(data, PROMPTS_PER_DOMAIN)
        write_prompts(args.prompts_dir, prompts, data, args.heldout_frac)
        print(f"wrote {len(prompts)} prompts to {args.prompts_dir}", flush=True)

    tok = build_tokenizer(args.max_positions)
    config = build_config(args)
    model = Qwen3MoeForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                                               do_sample=False)
    n_params = sum(p.numel() for p in model.parameters())
    n_exp = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    per_expert = n_exp // (args.layers * args.experts)
    params = {"total": n_params, "experts": n_exp, "per_expert": per_expert,
              "active_per_token": n_params - n_exp + args.layers * args.top_k * per_expert}
    print(f"params {params}", flush=True)

    eval_small = heldout_windows(data, args.seq_len, max_windows=8)
    eval_full = heldout_windows(data, args.seq_len)
    baselines = ngram_baselines(data)
    print("baselines", json.dumps(baselines), flush=True)
    ev0 = evaluate(model, eval_full, 32, args.top_k, routing=True)
    stats0 = routing_statistics(ev0["counts"], args.top_k)
    print(f"init: bpb {ev0['bpb']} jsd between {stats0['mean_jsd_between_domains']} "
          f"within {stats0['mean_jsd_within_domain']} id-acc {stats0['domain_id_accuracy']}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        return lr_schedule(args, step)

    log_rows: list[dict] = []
    acc_ce = acc_aux = 0.0
    acc_n = 0
    t_train = time.perf_counter()
    steps_run = 0
    model.train()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x = sample_batch(data, doms, rng, step, args.batch_size, args.seq_len)
        outp = model(input_ids=x, output_router_logits=True)
        logits = outp.logits[:, :-1]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        aux = per_layer_aux(outp.router_logits, args.experts, args.top_k)
        loss = ce + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps_run = step + 1
        acc_ce += ce.item()
        acc_aux += aux.item()
        acc_n += 1
        last = steps_run == args.steps
        elapsed = time.perf_counter() - t_train
        over = ((args.max_minutes is not None and elapsed > args.max_minutes * 60)
                or (args.stop_after is not None and steps_run >= args.stop_after and not last))
        if steps_run % args.log_every == 0 or last or over:
            row = {"step": steps_run, "tokens": steps_run * args.batch_size * args.seq_len, "lr": lr_at(step),
                   "train_bpb": acc_ce / acc_n / LN2, "aux_loss": acc_aux / acc_n, "elapsed_s": round(elapsed, 1)}
            if steps_run % args.eval_every == 0 or last or over:
                ev = evaluate(model, eval_small, 40, args.top_k, routing=False)["bpb"]
                for d in doms:
                    row[f"eval_bpb_{d}"] = ev[d]
                row["eval_bpb_mean"] = float(np.mean(list(ev.values())))
                print(f"step {steps_run} eval " + " ".join(f"{d}={v:.3f}" for d, v in ev.items()), flush=True)
            log_rows.append(row)
            print(f"step {steps_run} lr {row['lr']:.2e} train_bpb {row['train_bpb']:.3f} aux {row['aux_loss']:.3f} "
                  f"{elapsed:.0f}s ({steps_run * args.batch_size * args.seq_len / elapsed:.0f} tok/s)", flush=True)
            acc_ce = acc_aux = 0.0
            acc_n = 0
        if over:
            print(f"stopping after {steps_run} of {args.steps} steps (--max-minutes / --stop-after)", flush=True)
            break
    train_seconds = time.perf_counter() - t_train

    ev1 = evaluate(model, eval_full, 32, args.top_k, routing=True)
    stats1 = routing_statistics(ev1["counts"], args.top_k)
    print(f"final: bpb {ev1['bpb']} jsd between {stats1['mean_jsd_between_domains']} "
          f"within {stats1['mean_jsd_within_domain']} id-acc {stats1['domain_id_accuracy']}", flush=True)

    # save the model and tokenizer
    model.save_pretrained(out)
    tok.save_pretrained(out)
    compat_files(out, args.experts)

    # examples from the prompt file
    examples = []
    if prompts:
        model.eval()
        for d in doms:
            p = next(q for q in prompts if q["domain"] == d)
            enc = tok(p["text"], return_tensors="pt")
            with torch.no_grad():
                y = model.generate(**enc, max_new_tokens=48, do_sample=False)
            cont = tok.decode(y[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            examples.append({"domain": d, "prompt": p["text"], "continuation": cont})

    with open(out / "training_log.csv", "w", newline="") as f:
        cols = ["step", "tokens", "lr", "train_bpb", "aux_loss", "elapsed_s"] + [f"eval_bpb_{d}" for d in doms] + [
            "eval_bpb_mean"]
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in log_rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    plot_curves(log_rows, baselines, out / "loss_curve.png", doms)

    from dali_sim.models.hf_config import spec_from_hf_config

    spec = spec_from_hf_config(out, name="dali-tiny-moe")
    spec_txt = (f"ModelSpec(family={spec.family!r}, num_layers={spec.num_layers}, moe_layers={spec.moe_layers}, "
                f"num_experts={spec.num_experts}, top_k={spec.top_k}, hidden_size={spec.hidden_size}, "
                f"expert_intermediate_size={spec.expert_intermediate_size}, precision={spec.precision.name!r})")
    routing = {
        "description": "Expert usage of dali-tiny-moe on the held-out last "
                       f"{args.heldout_frac:.0%} of each OLMoE domain text, in non-overlapping windows of <s> + "
                       f"{args.seq_len - 1} bytes; counts are top-{args.top_k} selections (token, rank) per layer "
                       "and expert; JSD in bits. See routing_statistics() in experiments/train_tiny_moe.py.",
        "num_layers": args.layers, "num_experts": args.experts, "top_k": args.top_k,
        "domains": {d: DOMAINS[d] for d in doms},
        "after_training": stats1, "at_init": stats0,
    }
    (out / "routing_stats.json").write_text(json.dumps(routing, indent=1) + "\n")
    weights = out / "model.safetensors"
    for f in out.iterdir():
        f.chmod(0o644)
    summary = {
        "argv": argv, "command": _fmt_cmd(argv), "git_commit": _git_commit(),
        "machine": f"{os.cpu_count()}-core {_cpu_name()} VM ({platform.machine()}, {platform.system()})",
        "threads": args.threads, "torch": torch.__version__, "transformers": transformers.__version__,
        "steps_requested": args.steps, "steps_run": steps_run, "final_lr": lr_at(steps_run - 1),
        "tokens_seen": steps_run * args.batch_size * args.seq_len,
        "train_seconds": round(train_seconds, 1), "total_seconds": round(time.perf_counter() - t_start, 1),
        "tokens_per_second": steps_run * args.batch_size * args.seq_len / train_seconds,
        "params": params, "weights_bytes": weights.stat().st_size,
        "config": json.loads((out / "config.json").read_text()),
        "spec": spec_txt,
        "data": {d: {"file": data[d]["file"], "sha1": data[d]["sha1"], "git_blob": data[d]["git_blob"],
                     "train_bytes": data[d]["split"],
                     "heldout_bytes": len(data[d]["bytes"]) - data[d]["split"]} for d in doms},
        "source": SOURCE,
        "heldout_bits_per_byte": ev1["bpb"], "heldout_bits_per_byte_at_init": ev0["bpb"],
        "baselines_bits_per_byte": baselines,
        "examples": examples,
    }
    (out / "training_summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    write_card(out, args, argv, summary, stats1, stats0, examples)
    print(f"done in {summary['total_seconds']:.0f}s; wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
