"""Where a layer visit's counted host time goes, statement by statement, in the replay itself.

    python benchmarks/visit_statements.py --system gpu-lru        # the Qwen3 command of exec_overhead.py
    python benchmarks/visit_statements.py --system dali --top 40 --json statements.json
    python benchmarks/visit_statements.py --system gpu-lru --shape mixtral-8x7b --batch-size 4 --sequences 4

``exec_overhead.py --segments`` times the stopwatch segments; this goes one level down. It replays one system
(after one warm-up replay) with a copy of ``dali_exec/executor/runtime.py`` in which every statement of the
runtime's per-visit methods is preceded by a stamp (``time.perf_counter``, about 0.1 us each here) and with the
stopwatches reporting when they run. Each interval between two consecutive stamps is charged to the statement
that starts it; it is *counted* when an executor stopwatch ran at both stamps (the executor's bookkeeping), else
uncounted (device work, waits, the dense part, the caller). Per statement: counted microseconds per layer visit
(the mean), how often it runs per visit, and the median of one run. Wall clock, not thread CPU (a thread-CPU
reading is a system call of about 0.6 us here): on a quiet machine the two differ little; the stamps add about
0.1 us to each statement. ``--controller`` stamps ``Controller.plan`` too (the decision: counted, since its
stopwatch runs).

Why in the replay and not in a loop: a call's cost there is several times its cost in a tight loop (the caches
the rest of the visit leaves cold), and unevenly so (benchmarks/README.md, "The staging schedule started in the
route call"). The instrumented runtime makes the same decisions and computes the same outputs; the replay's
counters are checked against an uninstrumented replay of the same system. With ``--no-tensor-work`` (the
default, as on an accelerator that computes and copies by itself) the computes and copies are no-ops
(``exec_overhead.no_tensor_work``); ``--tensor-work`` keeps them. The CPU lane's worker runs ``_cpu_lane``, which
is not stamped (the stamps of two threads would interleave).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path
from unittest import mock

import numpy as np
import pandas as pd

from dali_exec.executor import Devices, ExecOptions, HostExpertStore, Replay, ReplayOptions, prepare_replay
from dali_exec.executor import replay as replay_module
from dali_exec.executor import runtime as runtime_module
from dali_exec.executor.devices import cpu_name
from dali_sim.runtime import controller as controller_module
from dali_sim.sim.counters import COUNTERS
from dali_sim.trace import read_trace
from dali_sim.trace.synth import SynthConfig, synthesize
from dali_sim.workload.profiling import ProfileSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exec_overhead import LOOKAHEAD, no_tensor_work, stopwatches_reporting  # noqa: E402

#: the runtime's methods a layer visit runs in the replay's thread (and the closures inside them)
RUNTIME_METHODS = ("start_layer", "run_experts", "_route", "_partition", "_accelerator_lane", "_copy_now", "_ready",
                   "_single_turns", "_single_prepare", "_single_after", "_staging_turns", "_compute", "_group",
                   "_group_booked", "_group_done", "_written", "_settle_ahead", "_layer_checked", "_combine_buffer",
                   "_issue_deferred", "_copy_many", "_free_prefetch", "of")
CONTROLLER_METHODS = ("plan", "_fused_plan", "_segment")


class Stamps:
    """The stamps of one replay: (statement, perf_counter, whether a stopwatch ran) in the order taken."""

    def __init__(self) -> None:
        self.taken: list[tuple[int, float, int]] = []
        self.labels: list[str] = []
        self.running: set[int] = set()

    def watching(self):
        """The stopwatches report when they run (``exec_overhead.stopwatches_reporting``)."""
        return stopwatches_reporting(self.running)

    def table(self, visits: int) -> pd.DataFrame:
        """Per statement: counted and uncounted us per visit, runs per visit, the median us of a counted run."""
        counted: dict[int, list[float]] = {}
        uncounted: dict[int, float] = {}
        for (a, t0, r0), (_, t1, r1) in zip(self.taken, self.taken[1:]):
            if r0 and r1:
                counted.setdefault(a, []).append(t1 - t0)
            else:
                uncounted[a] = uncounted.get(a, 0.0) + (t1 - t0)
        rows = []
        for i, label in enumerate(self.labels):
            c = counted.get(i, [])
            if not c and i not in uncounted:
                continue
            rows.append({"statement": label, "counted_us_per_visit": 1e6 * sum(c) / visits,
                         "runs_per_visit": len(c) / visits, "median_us": 1e6 * float(np.median(c)) if c else np.nan,
                         "uncounted_us_per_visit": 1e6 * uncounted.get(i, 0.0) / visits})
        out = pd.DataFrame(rows)
        return out.sort_values("counted_us_per_visit", ascending=False, ignore_index=True)


def instrumented(module: types.ModuleType, methods: tuple[str, ...], stamps: Stamps) -> types.ModuleType:
    """A copy of ``module`` whose ``methods`` (functions of that name, and the functions defined inside them) stamp
    before each statement: ``_STAMPS.append((i, _CLOCK(), len(_RUNNING)))``, ``i`` the statement's label in
    ``stamps.labels``."""
    path = Path(module.__file__)
    source = path.read_text()
    tree = ast.parse(source)

    def stamp(label: str) -> ast.stmt:
        stamps.labels.append(label)
        return ast.parse(f"_STAMPS.append(({len(stamps.labels) - 1}, _CLOCK(), len(_RUNNING)))").body[0]

    def body(stmts: list, where: str) -> list:
        out = []
        for st in stmts:
            if not isinstance(st, (ast.FunctionDef, ast.ClassDef)):
                for field in ("body", "orelse", "finalbody"):
                    inner = getattr(st, field, None)
                    if isinstance(inner, list) and inner:
                        setattr(st, field, body(inner, where))
                for handler in getattr(st, "handlers", ()):
                    handler.body = body(handler.body, where)
            line = ast.get_source_segment(source, st).splitlines()[0].strip()
            out += [stamp(f"{where}:{st.lineno} {line[:80]}"), st]
        if not isinstance(out[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break)):
            out.append(stamp(f"{where}:{stmts[-1].end_lineno} (the end of the block from line {stmts[0].lineno})"))
        return out

    class Stamper(ast.NodeTransformer):
        def __init__(self):
            self.inside = 0

        def visit_FunctionDef(self, node):
            chosen = node.name in methods
            self.inside += chosen
            self.generic_visit(node)
            if self.inside and node.name != "_cpu_lane":  # (the worker's: stamps of two threads would interleave)
                node.body = body(node.body, node.name)
            self.inside -= chosen
            return node

    tree = ast.fix_missing_locations(Stamper().visit(tree))
    copy = types.ModuleType(module.__name__ + "_stamped")
    copy.__file__ = str(path)
    copy.__dict__.update(_STAMPS=stamps.taken, _CLOCK=time.perf_counter, _RUNNING=stamps.running)
    sys.modules[copy.__name__] = copy  # (dataclasses look their module up while the classes are made)
    try:
        exec(compile(tree, str(path), "exec"), copy.__dict__)
    finally:
        del sys.modules[copy.__name__]
    return copy


def counters(result) -> dict:
    return {k: result.summary[k] for k in COUNTERS}


def measure(trace, system: str, opts: ReplayOptions, batch: int, with_controller: bool) -> tuple[pd.DataFrame, dict]:
    """One warm-up replay, one plain replay (its counters) and one stamped replay of ``system``: the statements'
    table and the stamped replay's summary figures."""
    setup = prepare_replay(trace, system, opts, batch_size=batch, profiling=ProfileSpec(share=0.0))
    devices = Devices.create("cpu", opts.dtype)
    store = HostExpertStore.random(setup.model, devices.dtype, 0, pin=False)
    run = ExecOptions(device="cpu")

    def replay():
        r = Replay(setup, devices, run, store=store)
        try:
            return r.run()
        finally:
            r.close()

    replay()  # warm-up (compiled kernels, allocator, threads)
    plain = replay()
    stamps = Stamps()
    patches = [mock.patch.object(replay_module, "OffloadRuntime",
                                 instrumented(runtime_module, RUNTIME_METHODS, stamps).OffloadRuntime)]
    if with_controller:
        patches.append(mock.patch.object(replay_module, "Controller",
                                         instrumented(controller_module, CONTROLLER_METHODS, stamps).Controller))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(stamps.watching())
        stamped = replay()
    if counters(stamped) != counters(plain):
        raise AssertionError(f"{system}: the stamped replay's counters differ from the plain replay's")
    visits = stamped.summary["overhead"]["layer_visits"]
    table = stamps.table(visits)
    figures = {"visits": visits, "counted_us_per_visit": float(table["counted_us_per_visit"].sum()),
               "plain_overhead_us_median": plain.summary["overhead"]["overhead_cpu_us_median"],
               "stamped_overhead_us_median": stamped.summary["overhead"]["overhead_cpu_us_median"]}
    return table, figures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", required=True)
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="model preset of the synthetic decode trace")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32, help="generated tokens per sequence")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--scale", type=float, default=0.0625)
    ap.add_argument("--precision", default="bf16", help="the full model's weight format for the memory plan")
    ap.add_argument("--controller", action="store_true", help="stamp Controller.plan too")
    ap.add_argument("--tensor-work", action="store_true", help="keep the computes and copies (default: no-ops)")
    ap.add_argument("--top", type=int, default=25, help="statements printed (the JSON has all)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if min(a.batch_size, a.sequences, a.max_tokens, a.layers, a.top) < 1 or a.scale <= 0:
        ap.error("--batch-size, --sequences, --max-tokens, --layers, --top and --scale must be positive")
    if a.json is not None and not a.json.parent.is_dir():
        ap.error(f"--json {a.json}: no such directory {a.json.parent}")
    opts = ReplayOptions(layers=a.layers, scale=a.scale, sequences=a.sequences, max_tokens=a.max_tokens,
                         dtype="fp32", precision=a.precision)
    with tempfile.TemporaryDirectory() as tmp, (contextlib.nullcontext() if a.tensor_work else no_tensor_work()):
        path = Path(tmp) / "trace.parquet"
        try:
            synthesize(SynthConfig(model=a.shape, sequences=a.sequences, prompt_len=0, gen_len=a.max_tokens,
                                   seed=1, lookahead=LOOKAHEAD), path)
            table, figures = measure(read_trace(path), a.system, opts, a.batch_size, a.controller)
        except (KeyError, ValueError) as e:
            print(f"visit_statements.py: {e}", file=sys.stderr)
            return 2
    machine = {"cpu": cpu_name(), "cores": os.cpu_count(), "load_average": os.getloadavg()}
    print(f"{a.system} on a synthetic {a.shape} trace ({a.layers} MoE layers at scale {a.scale:g}, {a.sequences} x "
          f"{a.max_tokens} tokens, batch {a.batch_size}{'' if a.tensor_work else ', no tensor work'}); {machine}")
    print(f"median visit, thread CPU: {figures['plain_overhead_us_median']:.1f} us plain, "
          f"{figures['stamped_overhead_us_median']:.1f} us stamped; counted statements, wall: "
          f"{figures['counted_us_per_visit']:.1f} us per visit over {figures['visits']} visits")
    with pd.option_context("display.width", 200, "display.max_colwidth", 110):
        print(table.head(a.top).round(2).to_string(index=False))
    if a.json:
        a.json.write_text(json.dumps({"machine": machine, "settings": {k: str(v) for k, v in vars(a).items()},
                                      "figures": figures, "rows": table.to_dict("records")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
