"""The last step of scripts/gpu_check.sh: gather each workload's `dali exec validate` report into one table.

Reads WORK/<workload>/validation.json (written after every system, so a run cut short still counts
what finished) and WORK/status.txt (workload, exit code, seconds); writes into OUT at most 8 files:
summary.md, summary.csv, per_step.csv, <workload>.png and the executor's and simulator's timelines of
dali on the first workload; prints the summary table last. Exit status 0 when every workload ran at
least one system, every counter matched where it must and every workload's verdict (the thresholds
`dali exec validate` was given) is OK, else 1; each problem is printed as a FAIL line.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import pandas as pd

COLUMNS = [("workload", "workload"), ("system", "system"), ("exec_s", "exec s"), ("sim_s", "sim s"),
           ("total_rel_err", "total err"), ("step_abs_err_median", "step |err| med"),
           ("step_abs_err_p90", "step |err| p90"), ("decode_tokens_per_s_exec", "decode tok/s exec"),
           ("decode_tokens_per_s_sim", "decode tok/s sim"), ("hit_rate", "hit rate"), ("transfers", "copies"),
           ("overhead_us_per_layer", "overhead us/layer"), ("exact", "counters exact")]
DIGITS = {"exec_s": 3, "sim_s": 3, "decode_tokens_per_s_exec": 1, "decode_tokens_per_s_sim": 1,
          "overhead_us_per_layer": 0}
PERCENT = {"total_rel_err": "{:+.1%}", "step_abs_err_median": "{:.1%}", "step_abs_err_p90": "{:.1%}",
           "hit_rate": "{:.1%}"}


#: what an exit status of `dali exec validate` (under gpu_check.sh's timeout) means
EXIT_MEANING = {1: "the verdict failed: below", 124: "stopped by the time limit; the systems above finished before",
                137: "killed after the time limit; the systems above finished before"}


def _fmt(key: str, v) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if key in PERCENT:
        return PERCENT[key].format(v)
    if isinstance(v, float):
        return f"{v:,.{DIGITS.get(key, 3)}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def table(rows: list[dict]) -> str:
    head = [h for _, h in COLUMNS]
    body = [[_fmt(k, r.get(k)) for k, _ in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--workloads", default="mixtral,deepseek")
    ap.add_argument("--elapsed", type=float, default=float("nan"), help="seconds the check took so far")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    status = {}
    status_file = a.work / "status.txt"
    if status_file.exists():
        for line in status_file.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3:
                status[parts[0]] = (int(parts[1]), parts[2], " ".join(parts[3:]))
    rows, steps, notes, settings, fails = [], [], [], [], []
    ok = True
    workloads = [w for w in a.workloads.split(",") if w]
    for i, w in enumerate(workloads):
        rc, secs, why = status.get(w, (None, "?", ""))
        path = a.work / w / "validation.json"
        if not path.exists():
            ok = False
            how = "not run" if rc is None else f"exit {rc}{', ' + why if why else ''}"
            notes.append(f"- {w}: no results ({how}; see log.txt)")
            continue
        data = json.loads(path.read_text())
        st = data["settings"]
        settings.append(f"- **{w}**: {st['full_model']} as {st['replay_model']} (scale {st['scale']:g}, "
                        f"{st['layers']} MoE layers, {st['dtype']}), {st['steps']} steps / {st['tokens']:,} tokens, "
                        f"batch {st['batch_size']}, budget {st['gpu_memory_gib']:g} GiB full = "
                        f"{st['replay_budget_gib']:.2f} GiB replay; {st['device_name']}, CPU lane "
                        f"{st['cpu_threads']} threads; {secs} s (exit {rc})")
        if not data["systems"]:
            ok = False
        for s in data["systems"]:
            r = dict(s["row"])
            r["workload"] = w
            r["hit_rate"] = s["counters"]["hit_rate"]["exec"]
            r["transfers"] = s["counters"]["transfers"]["exec"]
            r["overhead_us_per_layer"] = s["overhead"].get("overhead_us_per_layer")
            if r["expected_exact"] and not r["exact"]:
                ok = False
            rows.append(r)
            st_rows = pd.DataFrame(s["steps"])
            st_rows.insert(0, "system", r["system"])
            st_rows.insert(0, "workload", w)
            steps.append(st_rows)
        for fl in data.get("failed", []):
            ok = False
            notes.append(f"- {w}: {fl['system']} FAILED: {fl['error']}")
        v = data.get("verdict") or {}
        if not v:
            ok = False
            fails.append(f"FAIL {w}: no verdict in {path} (an older dali?)")
        elif not v["ok"]:
            ok = False
            fails += [f"FAIL {w}: {f}" for f in v["failures"]]
        for sk in data.get("skipped", []):
            notes.append(f"- {w}: {sk['system']} skipped ({sk['reason']})")
        notes += [f"- {w}: WARNING {x}" for x in data.get("warnings", [])]  # (the machine's, not the verdict's)
        rk = data.get("ranking") or {}
        if rk.get("pairs"):
            notes.append(f"- {w}: order by total time, executor {', '.join(rk['exec_order'])}; simulator "
                         f"{', '.join(rk['sim_order'])} (Kendall tau {rk['kendall_tau']:.2f})")
        if (a.work / w / "validation.png").exists():
            shutil.copyfile(a.work / w / "validation.png", a.out / f"{w}.png")
        if i == 0:
            for which in ("exec", "sim"):
                tl = a.work / w / f"dali.{which}.timeline.json"
                if tl.exists():
                    shutil.copyfile(tl, a.out / f"{w}-dali.{which}.timeline.json")
        if rc not in (0, None):
            notes.append(f"- {w}: `dali exec validate` exited {rc} ({EXIT_MEANING.get(rc, 'an error: see log.txt')})")
    if "tests" in status:  # (--tests)
        rc, secs, _ = status["tests"]
        notes.append(f"- tests: `python -m pytest -m gpu` exited {rc} after {secs} s"
                     + ("" if rc == 0 else " (its failures are in log.txt)"))
        if rc != 0:
            ok = False
            why = {1: "a test failed", 124: "stopped by the time limit",
                   137: "killed after the time limit"}.get(rc, "an error")
            fails.append(f"FAIL tests: `python -m pytest -m gpu` exited {rc} ({why}; see log.txt)")
    frame = pd.DataFrame(rows)
    keep = [k for k, _ in COLUMNS] + [c for c in frame.columns if c not in dict(COLUMNS) and c != "counters_differ"]
    frame.reindex(columns=keep).to_csv(a.out / "summary.csv", index=False)
    (pd.concat(steps, ignore_index=True) if steps else pd.DataFrame()).to_csv(a.out / "per_step.csv", index=False)
    text = table(rows)
    md = ["# dali GPU check: executor vs simulator", "", *settings, "",
          "Errors are (simulated - executed) / executed; counters exact = every count of docs/metrics.md equal "
          "per layer. Method: docs/validation.md.", "", text, ""]
    if notes:
        md += ["", *notes, ""]
    md += ["## Verdict", "", "OK" if not fails else "FAIL", *[f"- {f}" for f in fails], ""]
    md += [f"Total {a.elapsed:.0f} s.", ""]
    (a.out / "summary.md").write_text("\n".join(md))
    print("\n".join(settings + notes))
    print(f"total {a.elapsed:.0f} s; {'OK' if ok else 'FAILED'}: results in {a.out}")
    print()
    print(text)
    for f in fails:
        print(f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
