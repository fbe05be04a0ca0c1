#!/usr/bin/env bash
# Rebuilds the shipped traces (run from the repository root, with ../shared beside it):
# the imported public traces, and the traces recorded from models/dali-tiny-moe.
set -euo pipefail
src=../shared/validation-traces
dali trace import --format gpt-oss-fingerprint "$src/GPT-OSS-MoE-ExpertFingerprinting/examples" -o traces/gpt-oss-20b.parquet
dali trace import --format switch-router-v2 "$src/stratamoe-lab/router-trace.v2.json" -o traces/switch-base-8.parquet

# recorded from our trained model: inputs, residual vectors, then the two traces
python traces/make_inputs.py --data-dir "$src/OLMoE/text"
model=models/dali-tiny-moe
dali trace calibrate-residual --model $model --texts prompts/calibration.jsonl -o $model/residual.safetensors -q
dali trace record --model $model --prompts prompts/trace64.jsonl --batch-size 16 --max-new-tokens 32 \
    --residual $model/residual.safetensors -o traces/dali-tiny-moe.parquet -q
dali trace record --model $model --prompts prompts/hidden10.jsonl --batch-size 10 --max-new-tokens 24 \
    --residual $model/residual.safetensors --hidden-states --router-logits -o traces/dali-tiny-moe-hidden.parquet -q
