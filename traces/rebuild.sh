#!/usr/bin/env bash
# Rebuilds the shipped traces from ../shared/validation-traces (run from the repository root).
set -euo pipefail
src=../shared/validation-traces
dali trace import --format gpt-oss-fingerprint "$src/GPT-OSS-MoE-ExpertFingerprinting/examples" -o traces/gpt-oss-20b.parquet
dali trace import --format switch-router-v2 "$src/stratamoe-lab/router-trace.v2.json" -o traces/switch-base-8.parquet
