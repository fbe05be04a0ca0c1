"""``run_sweep``: spec -> tasks -> engine -> result store, resumable and interruptible.

Order of work: the spec is read and checked completely (errors before anything else), the output
folder checked, the stored results read, the recipe traces synthesised; then every configuration not
yet stored (by hash) is grouped into tasks (one trace and batching each, so the workload is built once
for several systems) and handed to the engine, longest first. Results stream back into the store,
which is written every ``save_every`` seconds and at the end. Ctrl-C or SIGTERM stops the workers and
writes what finished; rerunning the same command runs only what is missing.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dali_sim.files import check_output, write_text_atomic
from dali_sim.sweep.spec import RunConfig, load_spec, plan_runs
from dali_sim.sweep.store import RESULTS_FILE, ResultStore
from dali_sim.sweep.worker import SweepTask
from dali_sim.trace.reader import Needs

#: tasks per engine slot the configurations are split into at most (load balance vs workloads rebuilt)
TASKS_PER_SLOT = 4


@dataclass
class SweepSummary:
    configurations: int  # in the spec
    stored: int  # already in the output folder before this run (and not rerun)
    ran: int = 0
    failed: int = 0
    interrupted: bool = False

    @property
    def remaining(self) -> int:
        return self.configurations - self.stored - self.ran


def make_tasks(todo: list[RunConfig], runs: list[RunConfig], slots: int) -> list[SweepTask]:
    """``todo`` grouped by (trace, batch size, prefill chunk, profile share) in the spec's order, groups split so that
    there are about :data:`TASKS_PER_SLOT` tasks per slot, longest (estimated) first. A trace is read
    with the columns every configuration of it in ``runs`` needs, the same for all its tasks."""
    from dali_sim.trace.reader import read_meta

    predictors: dict[str, set[str]] = {}
    for r in runs:
        predictors.setdefault(r.trace_path, set()).update(r.predictors)
    needs = {path: Needs(predictors=tuple(sorted(p))) for path, p in predictors.items()}
    size = {path: (m.num_rows, max(len(m.sequences), 1)) for path in needs for m in [read_meta(path)]}
    groups: dict[tuple, list[RunConfig]] = {}
    for r in todo:
        groups.setdefault((r.trace_path, r.batch_size, r.prefill_chunk, r.profile_share), []).append(r)
    per_task = max(1, math.ceil(len(todo) / (TASKS_PER_SLOT * max(slots, 1))))
    tasks = []
    for (path, batch, chunk, share), group in groups.items():
        rows, sequences = size[path]
        for i in range(0, len(group), per_task):
            part = tuple(group[i:i + per_task])
            cost = len(part) * rows / min(batch, sequences)  # ~ (step, layer) pairs simulated
            tasks.append(SweepTask(path, needs[path], batch, chunk, part, cost, share))
    return sorted(tasks, key=lambda t: (-t.cost, t.runs[0].index))


def run_sweep(spec_path: str | Path, out: str | Path, engine_factory: Callable[[], object], *,
              retry_failed: bool = False, save_every: float = 10.0, progress: bool = True,
              log: Callable[[str], None] = print) -> SweepSummary:
    """Run the configurations of ``spec_path`` not yet in ``out`` (see the module docstring).
    ``engine_factory`` makes the engine (:func:`dali_sim.sweep.engines.make_engine`) once the spec is
    known to be good. Ctrl-C / SIGTERM: what finished is written, then the interrupt propagates."""
    from tqdm import tqdm

    spec_path, out = Path(spec_path), Path(out)
    spec = load_spec(spec_path)
    check_output(out, [spec_path, *(t.path for t in spec.traces if t.path is not None)], "sweep folder", folder=True)
    store = ResultStore(out)
    runs = plan_runs(spec, out, log)
    order = [r.hash for r in runs]
    status = store.status()
    todo = [r for r in runs if r.hash not in status or (retry_failed and status[r.hash] == "error")]
    summary = SweepSummary(len(runs), len(runs) - len(todo))
    write_text_atomic(out / "spec.toml", spec_path.read_text(encoding="utf-8"))
    stored_order = [h for h in store.rows if h in set(order)]
    if not todo:
        store.flush(order, force=stored_order != order)  # the same results, in this spec's order
        log(f"all {len(runs)} configurations are already in {out / RESULTS_FILE}")
        return summary
    by_hash = {r.hash: r for r in runs}
    engine = engine_factory()
    tasks = make_tasks(todo, runs, engine.slots)
    log(f"{len(runs)} configurations: {summary.stored} already in {out}, {len(todo)} to run in {len(tasks)} tasks "
        f"on {engine.name}")
    bar = tqdm(total=len(todo), desc="sweep", unit="run", disable=not progress, dynamic_ncols=True)
    last_save = time.monotonic()
    try:
        with contextlib.closing(engine.run(tasks)) as outcomes:
            for outcome in outcomes:
                store.add(by_hash[outcome.config_hash], outcome)
                summary.ran += 1
                summary.failed += outcome.status != "ok"
                bar.update()
                if summary.failed:
                    bar.set_postfix(failed=summary.failed, refresh=False)
                if time.monotonic() - last_save >= save_every:
                    store.flush(order)
                    last_save = time.monotonic()
    except KeyboardInterrupt:
        summary.interrupted = True
        raise
    finally:
        bar.close()
        store.flush(order)
        close = getattr(engine, "close", None)
        if close is not None:
            close()
        if summary.interrupted:
            kept = (f"{summary.ran} of the {len(todo)} configurations to run finished and are stored in "
                    f"{out / RESULTS_FILE}" if summary.ran else "no configuration had finished")
            log(f"interrupted: {kept}; rerun the same command to run the remaining {summary.remaining}")
    log(f"done: {summary.ran} configurations run ({summary.failed} failed), {summary.stored} were already stored; "
        f"results in {out / RESULTS_FILE}")
    return summary


__all__ = ["SweepSummary", "make_tasks", "run_sweep"]
