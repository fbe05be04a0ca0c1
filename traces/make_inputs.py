"""Inputs for the traces recorded from models/dali-tiny-moe (run by traces/rebuild.sh).

* ``prompts/trace64.jsonl``: 64 prompts (13/13/13/13/12 per domain), whole lines of 32-96 bytes from the
  **held-out** part of each OLMoE text file, chosen by the training script's own rule
  (``make_prompts``), with domain, file and byte offsets;
* ``prompts/hidden10.jsonl``: the first two prompts of each domain of ``trace64.jsonl`` (the trace
  with hidden states, which are large);
* ``prompts/calibration.jsonl``: 20 windows per domain of 255 bytes from the **training** part (the
  residual vectors are calibrated on text the model was trained on, never on the prompts), as token ids
  (``<s>`` + bytes, so no window is cut inside a UTF-8 character), with domain, file and offsets.

Deterministic: evenly spaced positions, no randomness.

    python traces/make_inputs.py [--data-dir ../shared/validation-traces/OLMoE/text]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "experiments"))

import train_tiny_moe as T  # noqa: E402

TRACE_PROMPTS = {"arxiv": 13, "book": 13, "c4": 13, "github": 13, "wikipedia": 12}
HIDDEN_PER_DOMAIN = 2
CALIBRATION_WINDOWS = 20
WINDOW_BYTES = 255  # + <s> = the training window length


def calibration_windows(data: dict[str, dict]) -> list[dict]:
    out = []
    for dom, d in data.items():
        train = d["train"]
        for i in range(CALIBRATION_WINDOWS):
            start = int((i + 0.5) * (len(train) - WINDOW_BYTES) / CALIBRATION_WINDOWS)
            ids = [T.BOS_ID] + train[start:start + WINDOW_BYTES].tolist()
            out.append({"name": f"{dom}-{i}", "domain": dom, "file": d["file"], "start": start,
                        "end": start + WINDOW_BYTES, "input_ids": ids})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {path} ({len(rows)} entries)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=T.DEFAULT_DATA)
    p.add_argument("--heldout-frac", type=float, default=0.05, help="as in the training run (its default)")
    p.add_argument("--out", type=Path, default=REPO / "prompts")
    args = p.parse_args(argv)
    data = T.load_domains(args.data_dir, args.heldout_frac)
    prompts = T.make_prompts(data, TRACE_PROMPTS, min_len=32, max_len=96)
    named = [{"name": f"{r['domain']}-{i}", **r} for i, r in enumerate(prompts)]
    write_jsonl(args.out / "trace64.jsonl", named)
    write_jsonl(args.out / "hidden10.jsonl", [r for dom in TRACE_PROMPTS for r in
                                              [x for x in named if x["domain"] == dom][:HIDDEN_PER_DOMAIN]])
    write_jsonl(args.out / "calibration.jsonl", calibration_windows(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
