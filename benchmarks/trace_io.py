"""Trace read/write throughput (rows/s) and the writer's memory bound.

    python benchmarks/trace_io.py [--rows 4000000] [--model mixtral-8x7b] [--chunk 65536]

Writes random but valid rows in chunks (as a recorder or generator would), then reads the file back
with full validation and without. Peak RSS is read from the kernel after each phase; a streaming
writer's peak should stay near one row group plus one chunk, far below the size of the whole table.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from dali_sim.models import get_model
from dali_sim.trace import PredictorInfo, TraceWriter, read_trace


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_chunk(rng, model, start_token: int, tokens: int):
    layers = np.asarray(model.moe_layers)
    n = tokens * len(layers)
    token = start_token + np.repeat(np.arange(tokens), len(layers))
    experts = np.argsort(rng.random((n, model.num_experts), dtype=np.float32), axis=1)[:, : model.top_k]
    weights = np.sort(rng.random((n, model.top_k), dtype=np.float32), axis=1)[:, ::-1]
    return dict(seq_id=token // 1024, pos=token % 1024, layer=np.tile(layers, tokens),
                phase=(token % 1024 >= 256).astype(np.int8), experts=experts, weights=weights / weights.sum(1, keepdims=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--model", default="mixtral-8x7b")
    ap.add_argument("--chunk-tokens", type=int, default=2048)
    ap.add_argument("--lookahead", action="store_true", help="also write one lookahead column")
    args = ap.parse_args()
    model = get_model(args.model)
    rng = np.random.default_rng(0)
    tokens = args.rows // model.num_moe_layers
    preds = [PredictorInfo("synthetic")] if args.lookahead else []
    base = peak_rss_mib()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.parquet"
        chunk_time = 0.0
        t0 = time.perf_counter()
        with TraceWriter(path, model, predictors=preds) as w:
            for start in range(0, tokens, args.chunk_tokens):
                c0 = time.perf_counter()
                chunk = make_chunk(rng, model, start, min(args.chunk_tokens, tokens - start))
                if preds:
                    la = rng.normal(size=(len(chunk["seq_id"]), model.num_experts)).astype(np.float32)
                    chunk["lookahead"] = {"synthetic": la}
                chunk_time += time.perf_counter() - c0
                w.write(**chunk)
        write_s = time.perf_counter() - t0 - chunk_time
        rows = tokens * model.num_moe_layers
        write_peak = peak_rss_mib()
        size = path.stat().st_size
        t0 = time.perf_counter()
        t = read_trace(path)
        _ = t.experts, t.weights
        read_validate_s = time.perf_counter() - t0
        del t
        t0 = time.perf_counter()
        t = read_trace(path, validate=False)
        _ = t.experts, t.weights
        read_s = time.perf_counter() - t0
        table_mib = t.table.nbytes / 2**20
    print(f"model {model.name}: {rows:,} rows ({tokens:,} tokens x {model.num_moe_layers} layers), "
          f"file {size / 2**20:.1f} MiB ({size / rows:.1f} B/row)")
    print(f"write (validate + encode + zstd): {rows / write_s:,.0f} rows/s ({write_s:.2f} s, chunk generation excluded)")
    print(f"read + full validation:          {rows / read_validate_s:,.0f} rows/s ({read_validate_s:.2f} s)")
    print(f"read without validation:         {rows / read_s:,.0f} rows/s ({read_s:.2f} s)")
    print(f"peak RSS: start {base:.0f} MiB, after writing {write_peak:.0f} MiB; whole table in memory = {table_mib:.0f} MiB")


if __name__ == "__main__":
    main()
