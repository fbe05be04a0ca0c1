"""The executor's compiled per-layer calls through numba's dispatcher and through their entry points.

    python benchmarks/kernel_calls.py                      # Qwen3-30B-A3B shape, batch 32 (as exec_overhead's)
    python benchmarks/kernel_calls.py --systems dali --calls 64 --rounds 9 --json out.json

A replay of the exec_overhead benchmark's Qwen3 command (``--shape``, 4 MoE layers at scale 1/16, 32 x 32
decode tokens, batch 32, CPU device) runs once per system, and the arguments of every compiled per-layer call
(``route_partition``: a layer's routing grouped, checked and split, which the runtime makes through
``kernels.Entries``; ``group_index_into``: a later group's indices, of either lane, made through the dispatcher) are
kept as they were before the call. Each kept call is then made again on fresh copies of its arguments, round by
round and interleaved: through the dispatcher (``kernels.compiled(name)``, which types every argument at every
call) and through an entry point (``Entries``: compiled for the argument types once), alone (``entry``) and with
its key built from the arguments' dtypes and looked up first, as the runtime does for the route call
(``lookup``), each **warm** (its arguments just copied, the code run the moment before) and **cold** (a pass
over ``--flush-mib`` of memory between the copy and the call, as a layer's tensor work leaves the caches).
Thread CPU of the calling thread, in microseconds: the median over calls and rounds; ``clock_us`` is the same
measurement around an empty Python call (the two clock readings); ``saved_*_us`` is dispatcher minus lookup.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))

import exec_overhead as X  # noqa: E402
from dali_exec.executor import Devices, ExecOptions, HostExpertStore, ReplayOptions, prepare_replay  # noqa: E402
from dali_exec.executor import kernels as K  # noqa: E402
from dali_exec.executor.devices import cpu_name  # noqa: E402
from dali_exec.executor.workspace import GroupWorkspace  # noqa: E402
from dali_sim.trace import read_trace  # noqa: E402
from dali_sim.trace.synth import SynthConfig, synthesize  # noqa: E402
from dali_sim.workload.profiling import ProfileSpec  # noqa: E402


def _copy(args: tuple) -> tuple:
    return tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)


def capture(trace, system: str, opts: ReplayOptions, batch: int, store_cache: dict) -> list[tuple]:
    """(kernel name, entry point, its arguments before the call) of every ``Entries`` call of one replay."""
    setup = prepare_replay(trace, system, opts, batch_size=batch, profiling=ProfileSpec(share=0.0))
    devices = Devices.create("cpu", opts.dtype)
    if setup.model.name not in store_cache:
        store_cache[setup.model.name] = HostExpertStore.random(setup.model, devices.dtype, 0)
    calls: list[tuple] = []
    get, build = K.Entries.get, GroupWorkspace.build
    groups = K.Entries("group_index_into", range(6))  # (what the runtime's group call would use: its first six)

    def kept(self, key, args):
        fn = get(self, key, args)
        calls.append((self.name, fn, _copy(args), self))
        return fn

    def built(self, kernel, routing, seg, rows, layer, state):
        args = (routing.ptr, routing.positions, routing.weights, routing.experts, seg, rows, routing.top_k, layer,
                state, self.ints, self.w, self.small, self.table_counts, self.offs)
        key = tuple(a.dtype for a in args[:6])
        calls.append(("group_index_into", get(groups, key, args), _copy(args), groups))
        return build(self, kernel, routing, seg, rows, layer, state)
    with mock.patch.object(K.Entries, "get", kept), mock.patch.object(GroupWorkspace, "build", built):
        X.run_once(setup, devices, ExecOptions(device="cpu"), store_cache[setup.model.name])
    return calls


def time_calls(calls: list[tuple], rounds: int, flush: np.ndarray) -> pd.DataFrame:
    """Per kept call, round and variant (dispatcher / entry, warm / cold): thread-CPU microseconds."""
    rows = []
    empty = lambda *a: None  # noqa: E731
    for r in range(rounds):
        for i, (name, entry, args, entries) in enumerate(calls):
            if name == "route_partition":  # the key built as the runtime builds it, looked up, then the call
                def looked_up(*a, entries=entries):
                    return entries.get((a[0].dtype, a[3].dtype, a[4].dtype, a[5].dtype, a[6].dtype), a)(*a)
            else:
                def looked_up(*a, entries=entries):
                    return entries.get((a[0].dtype, a[1].dtype, a[2].dtype, a[3].dtype, a[4].dtype, a[5].dtype), a)(*a)
            for via, fn in (("dispatcher", K.compiled(name)), ("entry", entry), ("lookup", looked_up),
                            ("clock", empty)):
                for state in ("warm", "cold"):
                    a = _copy(args)
                    if state == "warm":
                        fn(*_copy(args))  # (code and the arguments' layout hot)
                    else:
                        np.add(flush, 1, out=flush)
                    t0 = time.thread_time_ns()
                    fn(*a)
                    rows.append((name, i, r, via, state, (time.thread_time_ns() - t0) / 1e3))
    return pd.DataFrame(rows, columns=["kernel", "call", "round", "via", "state", "us"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--systems", default="gpu-lru,llamacpp,dali")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--scale", type=float, default=0.0625)
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--calls", type=int, default=32, help="kept calls per system and kernel (evenly spaced)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--flush-mib", type=int, default=32)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if K.compiled("route_partition") is None:
        print("numba is off (DALI_NUMBA=0): nothing to compare", file=sys.stderr)
        return 1
    opts = ReplayOptions(layers=a.layers, scale=a.scale, sequences=a.sequences, max_tokens=a.max_tokens, dtype="fp32",
                         precision="bf16")
    stores: dict = {}
    flush = np.zeros((a.flush_mib << 20) // 8)
    frames = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.parquet"
        synthesize(SynthConfig(model=a.shape, sequences=a.sequences, prompt_len=0, gen_len=a.max_tokens, seed=1,
                               lookahead=X.LOOKAHEAD), path)
        trace = read_trace(path)
        for system in [s for s in a.systems.split(",") if s]:
            calls = capture(trace, system, opts, a.batch_size, stores)
            kept = []
            for name in sorted({c[0] for c in calls}):
                mine = [c for c in calls if c[0] == name]
                kept += [mine[j] for j in np.linspace(0, len(mine) - 1, min(a.calls, len(mine))).astype(int)]
            frames.append(time_calls(kept, a.rounds, flush).assign(system=system))
    df = pd.concat(frames)
    table = df.pivot_table(index=["system", "kernel"], columns=["via", "state"], values="us", aggfunc="median")
    table.columns = [f"{via}_{state}_us" for via, state in table.columns]
    for state in ("warm", "cold"):
        table[f"saved_{state}_us"] = table[f"dispatcher_{state}_us"] - table[f"lookup_{state}_us"]
    counts = df[df.via == "entry"].groupby(["system", "kernel"])["call"].nunique()
    table.insert(0, "calls", counts)
    machine = {"cpu": cpu_name(), "cores": os.cpu_count(), "load_average": os.getloadavg()}
    print(f"machine: {machine}")
    print(f"thread-CPU us per call, median over calls x {a.rounds} rounds; cold: after a pass over {a.flush_mib} MiB")
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.round(1).to_string())
    if a.json:
        a.json.write_text(json.dumps({"machine": machine, "settings": vars(a) | {"json": str(a.json)},
                                      "rows": table.reset_index().to_dict("records")}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
