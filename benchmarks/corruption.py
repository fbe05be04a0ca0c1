"""How many random single-byte changes of a trace (or a next-use file) does reading detect?

Each trial copies the file, XORs one byte at a random offset with a random non-zero value, and reads
the copy as dali does (``read_trace`` with validation, or ``load_future``). A trial is *rejected*
(an error naming the file), *crashed* (any other exception), *identical* (every column and the
metadata read back equal to the original's, e.g. a changed statistic or padding byte) or *silently
different* (read as ok with other data: what must never happen).

    python benchmarks/corruption.py traces/gpt-oss-20b.parquet --flips 200
    python benchmarks/corruption.py --synth --flips 300          # a small synthetic trace
    python benchmarks/corruption.py --synth --future --flips 200  # its next-use file (dali trace enrich)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from dali_sim.trace import read_trace
from dali_sim.trace.synth import SynthConfig, synthesize

OUTCOMES = ("rejected", "identical", "silently_different", "crashed")


def trace_content(path: Path):
    t = read_trace(path)
    arrays = [t.seq_id, t.phase, t.pos, t.layer, t.experts]
    arrays += [t.weights] if t.weights is not None else []
    arrays += [t.lookahead(p) for p in sorted(t.meta.predictors)]
    return t.meta.to_json(), arrays


def future_content(path: Path, trace_path: Path, batch_size: int):
    from dali_sim.runtime.future import load_future
    from dali_sim.workload.builder import WorkloadConfig

    f = load_future(read_trace(trace_path), WorkloadConfig(batch_size), path, share=0.0)  # the whole trace
    return "", [f._steps, f._key]


def same(a, b) -> bool:
    meta_a, arrays_a = a
    meta_b, arrays_b = b
    return meta_a == meta_b and len(arrays_a) == len(arrays_b) and all(
        x.shape == y.shape and np.array_equal(x, y, equal_nan=x.dtype.kind == "f") for x, y in zip(arrays_a, arrays_b))


def run(path: Path, flips: int, seed: int, read) -> dict[str, int]:
    original = read(path)
    data = path.read_bytes()
    rng = np.random.default_rng(seed)
    counts = dict.fromkeys(OUTCOMES, 0)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / path.name
        for _ in range(flips):
            changed = bytearray(data)
            offset = int(rng.integers(len(changed)))
            changed[offset] ^= int(rng.integers(1, 256))
            copy.write_bytes(changed)
            try:
                got = read(copy)
            except (ValueError, OSError):
                counts["rejected"] += 1
                continue
            except Exception:  # an error that is not the reader's own: a traceback for the user
                counts["crashed"] += 1
                continue
            counts["identical" if same(got, original) else "silently_different"] += 1
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", type=Path, help="Trace to corrupt (or --synth: a small synthetic one).")
    ap.add_argument("--synth", action="store_true", help="Corrupt a small synthetic trace with a lookahead column.")
    ap.add_argument("--future", action="store_true", help="Corrupt the trace's next-use file instead (batch size 2).")
    ap.add_argument("--flips", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.synth:
            path = Path(tmp) / "synth.parquet"
            synthesize(SynthConfig("mixtral-8x7b", sequences=2, prompt_len=16, gen_len=16, seed=1,
                                   lookahead=("next-gate=0.8",)), path, progress=False)
        elif args.trace is not None:
            path = Path(tmp) / args.trace.name
            shutil.copy(args.trace, path)
        else:
            ap.error("give a TRACE or --synth")
        if args.future:
            from dali_sim.runtime.future import write_future
            from dali_sim.workload.builder import WorkloadConfig

            target = write_future(read_trace(path), WorkloadConfig(2), Path(tmp) / "future.parquet", share=0.0)
            counts = run(target, args.flips, args.seed, lambda p: future_content(p, path, 2))
        else:
            target = path
            counts = run(target, args.flips, args.seed, trace_content)
        size = target.stat().st_size
    print(json.dumps({"file": str(args.trace or "synthetic") + (" (next-use file)" if args.future else ""),
                      "bytes": size, "flips": args.flips, **counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
