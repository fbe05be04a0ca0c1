"""Shared pieces of the experiment scripts: traces (built once, cached), a simulation grid, and the
writers of ``<name>.csv``, ``<name>.png``, ``<name>.md`` and ``<name>.manifest.json``.

Trace calibration (stated once here; every result's manifest repeats it):

* Models: the DALI paper's three (Mixtral-8x7B, DeepSeek-V2-Lite, Qwen3-30B-A3B) as synthetic traces,
  plus the real GPT-OSS-20B decode trace ``traces/gpt-oss-20b.parquet`` (no lookahead columns, no
  prefill: only systems without a prefetcher run on it, decode only).
* Temporal/cross-layer knobs: the generator's defaults (fitted to the real GPT-OSS-20B trace,
  docs/synthetic-traces.md). For Mixtral the popularity is calibrated from the OLMoE project's
  Mixtral routing counts (all 5 domains summed, ``routing_counts/mistral/expert_counts``) when the
  shared folder is present, and ``topic_spread`` is lowered to 1.0 (the doc notes Mixtral's real
  popularity is nearly uniform; 1.0 is our guess, not a fit).
* Lookahead predictors (their top-k recall; the generator makes errors independent, real ones are
  correlated): ``residual`` 0.90 (DALI's residual-based predictor), ``next-gate`` 0.75 (layer l+1's
  gate on layer l's input, mixtral-offloading / HybriMoE), ``gate2`` 0.60 @ 2 layers and ``gate3``
  0.50 @ 3 layers (HybriMoE's further lookahead). DALI's claim is residual > next-gate; the exact
  values are our assumption, not measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

import dali_sim  # noqa: E402
from dali_sim.policies import resolve_system  # noqa: E402
from dali_sim.runtime.future import future_path, write_future  # noqa: E402
from dali_sim.sim import simulate  # noqa: E402
from dali_sim.trace.reader import Trace, read_trace  # noqa: E402
from dali_sim.trace.synth import SynthConfig, synthesize  # noqa: E402
from dali_sim.workload.profiling import apply_profile, total_sequences  # noqa: E402
from dali_sim.workload.builder import WorkloadConfig  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "experiments" / "results"  # committed: only full runs write here
RESULTS_QUICK = REPO / "experiments" / "results-quick"  # --quick's default (gitignored)
SWEEPS = REPO / "experiments" / "sweeps"  # the figures' sweep specs; quick/ holds their --quick versions
SHARED = REPO.parent / "shared"
MISTRAL_COUNTS = SHARED / "validation-traces" / "OLMoE" / "routing_counts" / "mistral" / "expert_counts"
GPT_OSS_TRACE = REPO / "traces" / "gpt-oss-20b.parquet"
HARDWARE = "rtx3090-epyc7532"  # the paper's testbed, the simulator's default

PAPER_MODELS = ("mixtral-8x7b", "deepseek-v2-lite", "qwen3-30b-a3b")
ACCURACY = {"residual": 0.90, "next-gate": 0.75, "gate2": 0.60, "gate3": 0.50}
LOOKAHEAD = (f"residual={ACCURACY['residual']}", f"next-gate={ACCURACY['next-gate']}",
             f"gate2={ACCURACY['gate2']}@2", f"gate3={ACCURACY['gate3']}@3")
MODEL_KNOBS: dict[str, dict[str, Any]] = {"mixtral-8x7b": {"topic_spread": 1.0}}


def cache_dir() -> Path:
    """Where synthetic traces are cached (outside the repository): ``$DALI_EXP_CACHE`` or
    ``~/.cache/dali-experiments``."""
    d = Path(os.environ.get("DALI_EXP_CACHE", Path.home() / ".cache" / "dali-experiments"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@dataclass(frozen=True)
class TraceSpec:
    """A synthetic trace of one of the paper's models (or ``gpt-oss-20b`` = the shipped real trace)."""
    model: str
    sequences: int
    prompt_len: int
    gen_len: int
    seed: int = 0

    @property
    def real(self) -> bool:
        return self.model == "gpt-oss-20b"

    def synth_config(self) -> SynthConfig:
        kw: dict[str, Any] = dict(MODEL_KNOBS.get(self.model, {}))
        if self.model == "mixtral-8x7b" and MISTRAL_COUNTS.is_dir():
            kw["popularity_from"] = str(MISTRAL_COUNTS)
        return SynthConfig(self.model, sequences=self.sequences, prompt_len=self.prompt_len,
                           gen_len=self.gen_len, seed=self.seed, lookahead=LOOKAHEAD, **kw)

    def describe(self) -> dict[str, Any]:
        if self.real:
            return {"model": self.model, "source": str(GPT_OSS_TRACE.relative_to(REPO)), "real": True}
        cfg = self.synth_config()
        return {"model": self.model, "real": False, "synth": {
            "sequences": cfg.sequences, "prompt_len": cfg.prompt_len, "gen_len": cfg.gen_len, "seed": cfg.seed,
            "lookahead": list(LOOKAHEAD), "popularity_from": cfg.popularity_from, **MODEL_KNOBS.get(self.model, {})}}


def get_trace(spec: TraceSpec, *, quiet: bool = True) -> Trace:
    """Read the trace of ``spec``, generating it into :func:`cache_dir` the first time."""
    if spec.real:
        return read_trace(GPT_OSS_TRACE)
    cal = "cal" if spec.synth_config().popularity_from else "nocal"
    acc = "-".join(f"{k}{v}" for k, v in ACCURACY.items())
    knobs = "-".join(f"{k}{v}" for k, v in sorted(MODEL_KNOBS.get(spec.model, {}).items()))
    name = (f"{spec.model}_n{spec.sequences}_p{spec.prompt_len}_g{spec.gen_len}_s{spec.seed}_{cal}_{acc}"
            f"{'_' + knobs if knobs else ''}_v{dali_sim.__version__}.parquet")
    path = cache_dir() / name
    if not path.exists():
        t0 = time.perf_counter()
        # a private name, moved into place when complete: concurrent runs sharing the cache never
        # write the same file (the trace writer's own .partial name is per output path)
        private = path.with_name(f"{path.stem}.{os.getpid()}.parquet")
        synthesize(spec.synth_config(), private)
        os.replace(private, path)
        if not quiet:
            print(f"  synthesized {path.name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return read_trace(path)


def next_uses(trace: Trace, system: str, batch_size: int, overrides: dict | None) -> Path | None:
    """The next-use file (`dali trace enrich`) of a system with a Belady cache, made once into
    :func:`cache_dir`; None for systems that do not read the future."""
    if not resolve_system(system, overrides, trace.model).needs_future:
        return None
    path = cache_dir() / future_path(trace.path, WorkloadConfig(batch_size)).name
    if not path.exists() or path.stat().st_mtime < Path(trace.path).stat().st_mtime:
        private = path.with_name(f"{path.stem}.{os.getpid()}.parquet")
        write_future(trace, WorkloadConfig(batch_size), private)
        os.replace(private, path)
    return path


def batch_fits(trace: Trace, batch_size: int) -> bool:
    """Whether the trace's evaluated sequences (after the default split) fill a batch of ``batch_size``;
    a larger batch is an error (the real GPT-OSS trace has 12 sequences, 9 evaluated)."""
    return batch_size <= apply_profile(trace).evaluated.num_sequences


def run_sim(trace: Trace, system: str, batch_size: int, overrides: dict | None = None, *,
            seed: int = 0) -> dict[str, Any]:
    """One simulation; returns the summary (plus per-token MoE-layer time) as a flat dict."""
    t0 = time.perf_counter()
    r = simulate(trace, system, batch_size=batch_size, overrides=overrides, seed=seed,
                 future=next_uses(trace, system, batch_size, overrides))
    s = r.summary
    layer_time = float(r.per_layer["time_s"].sum()) if "time_s" in r.per_layer else float("nan")
    pre_tok = int(r.per_step.loc[r.per_step["phase"] == "prefill", "tokens"].sum())
    dec_tok = int(r.per_step.loc[r.per_step["phase"] == "decode", "tokens"].sum())
    keys = ("makespan_s", "prefill_s", "decode_s", "prefill_tokens_per_s", "decode_tokens_per_s",
            "prefill_throughput", "decode_throughput", "hit_rate", "gpu_fraction", "on_demand",
            "prefetch_issued", "prefetch_used", "prefetch_precision", "prefetch_recall", "swaps", "transfers")
    out = {k: s.get(k, float("nan")) for k in keys}
    out |= {"prefill_tokens": pre_tok, "decode_tokens": dec_tok, "moe_layer_s": layer_time,
            # a bound (an exact optimum or the time bound) only without an oracle heuristic beside it
            "bound": bool(s.get("bounds")) and not s.get("oracles"), "oracle": bool(s.get("oracles")),
            "sim_wall_s": time.perf_counter() - t0}
    return out


# ---- output ----------------------------------------------------------------------------------
def fmt(x: Any, digits: int = 3) -> str:
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else ""
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    if isinstance(x, (float, np.floating)):
        if np.isnan(x):
            return "-"
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:.0f}"
    return str(x)


def markdown_table(df: pd.DataFrame, digits: int = 3) -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(map(str, cols)) + " |", "|" + "---|" * len(cols)]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(fmt(v, digits) for v in row) + " |")
    return "\n".join(lines)


def write_outputs(out: Path, name: str, df: pd.DataFrame, fig, md_sections: Sequence[str],
                  manifest: dict[str, Any], show: pd.DataFrame | None = None) -> dict[str, Path]:
    """Write ``<name>.csv``, ``<name>.png``, ``<name>.md`` and ``<name>.manifest.json`` into ``out``;
    print ``show`` (the script's summary table) and the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {ext: out / f"{name}.{ext}" for ext in ("csv", "png", "md")}
    paths["manifest"] = out / f"{name}.manifest.json"
    df.to_csv(paths["csv"], index=False)
    fig.savefig(paths["png"], dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)
    paths["md"].write_text("\n\n".join(s.strip() for s in md_sections) + "\n")
    paths["manifest"].write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    if show is not None:
        print(show.to_string(index=False))
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return paths


def base_manifest(script: str, args: argparse.Namespace, traces: Iterable[TraceSpec], **extra) -> dict[str, Any]:
    return {
        "script": script,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "dali_version": dali_sim.__version__,
        "hardware": HARDWARE,
        "traces": [t.describe() for t in traces],
        "predictor_accuracy": ACCURACY,
        "model_knobs": MODEL_KNOBS,
        "mixtral_popularity_calibrated": MISTRAL_COUNTS.is_dir(),
        "python": platform.python_version(),
        "created_unix": int(time.time()),
        **extra,
    }


class ExperimentParser(argparse.ArgumentParser):
    """The scripts' common options; ``--out`` defaults to experiments/results (full runs) or
    experiments/results-quick (``--quick``), and a quick run into the committed results is refused."""

    def parse_args(self, args=None, namespace=None):  # noqa: D102
        ns = super().parse_args(args, namespace)
        if ns.out is None:
            ns.out = RESULTS_QUICK if ns.quick else RESULTS
        elif ns.quick and Path(ns.out).resolve() == RESULTS.resolve():
            self.error(f"--quick would overwrite the committed full results in {RESULTS}; "
                       f"give another --out (default {RESULTS_QUICK})")
        return ns


def parser(description: str) -> argparse.ArgumentParser:
    p = ExperimentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny run (seconds), for tests and smoke checks")
    p.add_argument("--out", type=Path, default=None,
                   help=f"output folder (default {RESULTS}; with --quick {RESULTS_QUICK})")
    p.add_argument("--seed", type=int, default=0, help="trace and simulation seed")
    p.add_argument("--workers", type=int, default=None,
                   help="sweep worker processes (default: every usable core; 1 = in this process)")
    return p


# ---- sweeps ----------------------------------------------------------------------------------
def sweep_spec(name: str, quick: bool) -> Path:
    """The sweep spec of a figure: experiments/sweeps/NAME.toml (or quick/NAME.toml)."""
    return SWEEPS / "quick" / f"{name}.toml" if quick else SWEEPS / f"{name}.toml"


def run_grid(name: str, args: argparse.Namespace) -> pd.DataFrame:
    """Run (or resume) the sweep ``name`` into ``<out>/sweeps/<name>`` with local workers and return the rows
    of this spec's configurations (a store keeps rows of configurations a spec no longer names; they are
    left out here). A failed configuration stops the script with its error."""
    from dali_sim.sweep.engines import make_engine
    from dali_sim.sweep.run import run_sweep
    from dali_sim.sweep.spec import load_spec, plan_runs

    spec_path, store = sweep_spec(name, args.quick), Path(args.out) / "sweeps" / name
    t0 = time.perf_counter()
    run_sweep(spec_path, store, lambda: make_engine(args.workers), progress=False, log=progress)
    hashes = [r.hash for r in plan_runs(load_spec(spec_path), store)]
    df = pd.read_parquet(store / "results.parquet").set_index("config_hash").loc[hashes].reset_index()
    bad = df[df.status != "ok"]
    if len(bad):
        first = bad.iloc[0]
        raise SystemExit(f"{spec_path}: {len(bad)} configuration(s) failed, e.g. {first.trace} {first.system} "
                         f"batch {first.batch_size}: {first.error} (see {store / 'manifests'})")
    progress(f"{name}: {len(df)} configurations in {store} ({time.perf_counter() - t0:.0f} s)")
    return df


def sweep_manifest(names: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    """Where a script's numbers come from: each spec (path, text) and its store."""
    return {"sweeps": {n: {"spec": str(sweep_spec(n, args.quick).relative_to(REPO)),
                           "spec_text": sweep_spec(n, args.quick).read_text(),
                           "store": str(Path(args.out) / "sweeps" / n)} for n in names}}


def write_sweep_outputs(name: str, specs: Sequence[str], args: argparse.Namespace, df: pd.DataFrame, fig,
                        md_sections: list[str], t0: float, show: pd.DataFrame | None = None, **extra) -> dict[str, Path]:
    """:func:`write_outputs` for a script drawn from sweeps: its run time closes the markdown, and the
    manifest names the specs and stores (:func:`sweep_manifest`)."""
    runtime = time.perf_counter() - t0
    md = [*md_sections, f"Runtime of this script (sweeps resumed from their stores where stored): {runtime:.0f} s."]
    manifest = base_manifest(name, args, [], runtime_s=round(runtime, 1), **extra, **sweep_manifest(specs, args))
    return write_outputs(args.out, name, df, fig, md, manifest, show=show)


def speed_ratio(df: pd.DataFrame, metric: str, ours: str, keys: Sequence[str]) -> np.ndarray:
    """Per row: ``ours``' metric / the row's metric, matched on ``keys`` (a rate metric: > 1 = ours faster)."""
    keys = list(keys)
    mine = df[df.system == ours].set_index(keys)[metric]
    where = pd.MultiIndex.from_frame(df[keys]) if len(keys) > 1 else pd.Index(df[keys[0]])
    return mine.reindex(where).to_numpy() / df[metric].to_numpy()


def reading(system: str) -> str:
    """A competitor preset's reading: ``paper`` (NAME) or ``best`` (NAME-best); docs/policies.md."""
    return "best" if system.endswith("-best") else "paper"


def competitor(system: str) -> str:
    return system.removesuffix("-best")


def geomean(v) -> float:
    v = np.asarray(v, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    return float(np.exp(np.log(v).mean())) if v.size else float("nan")


def int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def str_list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    return fn(), time.perf_counter() - t0
