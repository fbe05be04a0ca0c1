"""The simulator against published measurements of real MoE inference (docs/validation.md).

    python experiments/published_validation.py [--out DIR] [--only ID,...]

Every row of ``experiments/published/rows.toml`` is a published tokens/s figure (llama.cpp, ik_llama.cpp
and others, cited with a verbatim quote) and the dali setup that simulates it: a model preset at the
file's weight format, a hardware profile of the machine, a system preset with the implementation
that ran it, and a llama-bench-shaped workload (one sequence; routing from the calibrated synthetic
generator). Every parameter comes from the profiles and implementations, shared by all rows; there is
no per-row factor. The table gives published and simulated tokens/s, their ratio, whether it lies in
[0.75, 1.33] and the exact ``dali`` commands that reproduce each row.
"""

from __future__ import annotations

import shlex
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402
from dali_sim.policies.systems import parse_overrides  # noqa: E402
from dali_sim.sim import simulate  # noqa: E402
from dali_sim.trace.reader import read_trace  # noqa: E402
from dali_sim.trace.synth import SynthConfig, synthesize  # noqa: E402
from dali_sim.workload.profiling import ProfileSpec  # noqa: E402

ROWS = Path(__file__).resolve().parent / "published" / "rows.toml"
BAND = (0.75, 1.33)  # the acceptance band for simulated / published
MISS = 2.0  # no row may be off by more than this factor
METRICS = ("decode", "prefill", "request")


@dataclass(frozen=True)
class Row:
    id: str
    source: str
    url: str
    quote: str
    engine: str
    machine: str
    offload: str
    test: str
    published: float
    metric: str  # decode | prefill | request (generated tokens / the whole request: prefill + decode)
    model: str
    precision: str
    hardware: str
    system: str
    implementation: str
    prompt: int
    gen: int
    chunk: int = 0
    set: tuple[str, ...] = ()
    precision_source: str = ""
    notes: str = ""
    extra: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path = ROWS) -> list["Row"]:
        rows = []
        for i, raw in enumerate(tomllib.loads(path.read_text(encoding="utf-8"))["row"]):
            known = set(cls.__dataclass_fields__) - {"extra"}
            unknown = sorted(set(raw) - known)
            if unknown:
                raise ValueError(f"{path}: row {i} ({raw.get('id')}): unknown field(s) {unknown}")
            if raw["metric"] not in METRICS:
                raise ValueError(f"{path}: row {raw['id']}: metric must be one of {list(METRICS)}, "
                                 f"got {raw['metric']!r}")
            if raw["metric"] == "request" and raw.get("gen", 0) <= 0:
                raise ValueError(f"{path}: row {raw['id']}: metric request needs gen > 0")
            rows.append(cls(**{**raw, "set": tuple(raw.get("set", ()))}))
        ids = [r.id for r in rows]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{path}: duplicate row ids")
        return rows

    def synth(self) -> SynthConfig:
        return SynthConfig(self.model, sequences=1, prompt_len=self.prompt, gen_len=self.gen, seed=0,
                           precision=self.precision)

    def overrides(self) -> dict:
        return parse_overrides([*self.set, f"system.implementation={self.implementation}"])

    def commands(self, trace: str) -> str:
        synth = ["dali", "trace", "synth", "--model", self.model, "--precision", self.precision, "--sequences", "1",
                 "--prompt-len", str(self.prompt), "--gen-len", str(self.gen), "--seed", "0", "-o", trace]
        run = ["dali", "sim", "run", "--trace", trace, "--system", self.system, "--hardware", self.hardware,
               "--profile-share", "0"]
        if self.chunk:
            run += ["--prefill-chunk", str(self.chunk)]
        for item in (*self.set, f"system.implementation={self.implementation}"):
            run += ["--set", item]
        return f"{shlex.join(synth)} && {shlex.join(run)}"


def trace_for(row: Row):
    cfg = row.synth()
    name = f"published_{row.model}_{row.precision.replace('/', '-')}_p{row.prompt}_g{row.gen}.parquet"
    path = C.cache_dir() / name
    if not path.exists():
        private = path.with_name(f"{path.stem}.partial-{id(cfg)}.parquet")
        synthesize(cfg, private, command="experiments/published_validation.py")
        private.replace(path)
    return read_trace(path)


def simulate_row(row: Row) -> dict:
    # one synthetic sequence: no profiling split (the rows' layer splits make no frequency choice)
    r = simulate(trace_for(row), row.system, hardware=row.hardware, batch_size=1, prefill_chunk=row.chunk,
                 overrides=row.overrides(), profiling=ProfileSpec(share=0.0))
    s = r.summary
    if row.metric == "request":  # a client's rate: generated tokens over the whole request (one sequence)
        sim = row.gen / float(s["makespan_s"])
    else:
        sim = float(s[f"{row.metric}_tokens_per_s"])
    ratio = sim / row.published
    return {
        "id": row.id, "machine": row.machine, "model": row.model, "weights": row.precision, "offload": row.offload,
        "test": row.test, "engine": row.engine, "published_tok_s": row.published, "simulated_tok_s": sim,
        "ratio": ratio, "in_band": BAND[0] <= ratio <= BAND[1], "within_2x": 1 / MISS <= ratio <= MISS,
        "gpu_busy": s["busy"]["gpu"], "cpu_busy": s["busy"]["cpu"], "pcie_busy": s["busy"]["pcie"],
        "host_busy": s["busy"]["host"], "source": row.source, "url": row.url,
        "command": row.commands(f"{row.id}.parquet"),
    }


def figure(df: pd.DataFrame):
    fig, ax = plt.subplots(figsize=(7.5, 0.42 * len(df) + 1.2))
    y = np.arange(len(df))
    colors = ["#2b8a3e" if b else ("#e67700" if w else "#c92a2a") for b, w in zip(df["in_band"], df["within_2x"])]
    ax.barh(y, df["ratio"], color=colors)
    ax.axvline(1.0, color="black", lw=1)
    for x in BAND:
        ax.axvline(x, color="grey", ls="--", lw=0.8)
    ax.set_yticks(y, df["id"], fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("simulated / published tokens/s (log); dashed: 0.75 and 1.33")
    ax.invert_yaxis()
    ax.set_title("dali against published measurements")
    return fig


def main(argv=None) -> int:
    p = C.parser(__doc__.split("\n\n")[0])
    p.add_argument("--only", type=C.str_list, default=None, help="comma-separated row ids")
    args = p.parse_args(argv)
    rows = Row.load()
    if args.quick and not args.only:  # a smoke run: two short rows (a GPU one and a CPU one)
        args.only = [rows[0].id, next(r.id for r in rows if r.system == "cpu-only" and r.metric == "decode")]
    if args.only:
        unknown = set(args.only) - {r.id for r in rows}
        if unknown:
            p.error(f"unknown row ids {sorted(unknown)}")
        rows = [r for r in rows if r.id in args.only]
    records = []
    for row in rows:
        C.progress(f"  {row.id}")
        records.append(simulate_row(row))
    df = pd.DataFrame(records)
    n_band, n = int(df["in_band"].sum()), len(df)
    worst = df.loc[(df["ratio"].apply(lambda r: max(r, 1 / r))).idxmax()]
    summary = (f"{n_band} of {n} rows ({100 * n_band / n:.0f}%) within [{BAND[0]}, {BAND[1]}]; "
               f"{int(df['within_2x'].sum())} of {n} within a factor {MISS:g}; "
               f"geometric mean ratio {float(np.exp(np.log(df['ratio']).mean())):.3f}; "
               f"worst {worst['id']} at {worst['ratio']:.2f}.")
    show = df[["id", "test", "published_tok_s", "simulated_tok_s", "ratio", "in_band"]]
    table = df[["id", "machine", "model", "weights", "offload", "test", "published_tok_s", "simulated_tok_s",
                "ratio", "in_band"]]
    commands = "\n".join(f"- `{r['id']}`: `{r['command']}`" for r in records)
    what = ("## What this shows\n\nFor each published measurement, the tokens/s dali predicts for the same model, "
            "weight format, machine and implementation, with every parameter taken from the shared hardware profiles "
            "and implementations (docs/hardware.md): the ratio is how far the cost model is from a real machine. The "
            "acceptance band is [0.75, 1.33]; docs/validation.md explains each miss.")
    md = ["# Simulated against published tokens/s", summary, what, C.markdown_table(table),
          "Sources (verbatim quotes in experiments/published/rows.toml):\n\n"
          + "\n".join(f"- `{r['id']}`: {r['source']}, {r['url']}" for r in records),
          "Commands (each row, from a fresh shell):\n\n" + commands]
    manifest = C.base_manifest("published_validation", args, [], rows=str(ROWS.relative_to(C.REPO)), band=BAND,
                               miss_factor=MISS, summary=summary, row_ids=[r.id for r in rows],
                               hardware_per_row={r.id: r.hardware for r in rows}, quick=args.quick)
    C.write_outputs(args.out, "published_validation", df, figure(df), md, manifest, show)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
