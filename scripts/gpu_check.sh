#!/usr/bin/env bash
# GPU check: on a machine with one NVIDIA GPU and its own python3 with torch, from a copy of the repository
# (nothing installed, no internet): calibrate, replay offloading systems on a Mixtral-8x7B-shaped and a
# DeepSeek-V2-Lite-shaped synthetic workload at a realistic GPU memory budget, validate each against the
# simulator (`dali exec validate`), and print one summary table last. docs/validation.md explains it.
#
#   scripts/gpu_check.sh                          # the GPU run (about 5 minutes; budget 420 s)
#   scripts/gpu_check.sh --device cpu --quick     # the same, tiny, on the CPU (20-30 s on 2 cores)
#
# Options:
#   --device cuda|cpu   accelerator (default: cuda; it must be present)
#   --quick             tiny workloads (for a CPU-only machine or a smoke test)
#   --out DIR           results (at most 8 files): summary.md, summary.csv, per_step.csv, log.txt,
#                       <workload>.png, and the executor's and simulator's timelines of dali on the first
#                       workload (Perfetto JSON); default: $OUT if set, else ./gpu-check-out
#   --work DIR          intermediate files: traces, profiles, timelines (default: a new folder in /tmp)
#   --systems A,B,...   systems to run (default: cpu-only,gpu-lru,dali,llamacpp,ktransformers,hybrimoe,dali-plus,
#                       moe-lightning-best: the last, dense parts on the CPU lane, runs where the budget allows)
#   --workloads A,B     any of: mixtral, deepseek (default: both)
#   --budget SECONDS    wall-clock budget of the whole check; systems that would not fit are skipped
#                       (default: 420, quick: 300)
#   --max-total-error X fail a system whose |total time error| exceeds X (default: 0.15)
#   --order-margin Y    fail two systems whose measured times differ by more than Y but whose simulated
#                       order is the other way round (default: 0.10)
#   --python PY         interpreter (default: $PYTHON, else python3, else python)
#   --no-runtime        skip the runtime step (host overhead per MoE layer, generate speed against plain
#                       transformers: benchmarks/exec_overhead.py and generate_speed.py, after
#                       benchmarks/cold_host.py --quick and, on CUDA, cuda_host_calls.py and exec_overhead.py
#                       --sync-sites; 90 s, quick: 30 s, printed to the log only)
#   --tests             first run the GPU tests (python -m pytest -m gpu: the executor on CUDA, generate on
#                       CUDA, cuda_host_calls.py; 150 s, quick: 60 s, from the budget); a failure fails the check
#   --dry-run           check the environment and print the commands, run nothing, write nothing
#   -h, --help          this text
# Exit status: 0 when every workload ran at least one system, every counter matched where it must and
# every verdict is OK (the thresholds above); 1 otherwise (each problem printed as a FAIL line); 2 for
# bad arguments or a missing dependency.

set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEVICE=cuda
QUICK=0
OUT_DIR=${OUT:-./gpu-check-out}
WORK=""
SYSTEMS=cpu-only,gpu-lru,dali,llamacpp,ktransformers,hybrimoe,dali-plus,moe-lightning-best
WORKLOADS=mixtral,deepseek
BUDGET=""
PY=${PYTHON:-}
DRY=0
MAX_TOTAL=0.15
ORDER_MARGIN=0.10
RUNTIME=1
TESTS=0

usage() { sed -n '2,/^# Exit status/{s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; sed -n '/^# 1 otherwise/{s/^# //;p}' "${BASH_SOURCE[0]}"; }
die() { echo "gpu_check: $*" >&2; exit 2; }
need_value() { [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || die "$1 needs a value (see --help)"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) need_value "$@"; DEVICE=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --out) need_value "$@"; OUT_DIR=$2; shift 2 ;;
    --work) need_value "$@"; WORK=$2; shift 2 ;;
    --systems) need_value "$@"; SYSTEMS=$2; shift 2 ;;
    --workloads) need_value "$@"; WORKLOADS=$2; shift 2 ;;
    --budget) need_value "$@"; BUDGET=$2; shift 2 ;;
    --python) need_value "$@"; PY=$2; shift 2 ;;
    --max-total-error) need_value "$@"; MAX_TOTAL=$2; shift 2 ;;
    --order-margin) need_value "$@"; ORDER_MARGIN=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --no-runtime) RUNTIME=0; shift ;;
    --tests) TESTS=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ "$DEVICE" == cuda || "$DEVICE" == cpu ]] || die "--device must be cuda or cpu, got '$DEVICE'"
[[ -z "$BUDGET" || "$BUDGET" =~ ^[0-9]+$ ]] || die "--budget must be a whole number of seconds, got '$BUDGET'"
[[ "$MAX_TOTAL" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--max-total-error must be a number >= 0, got '$MAX_TOTAL'"
[[ "$ORDER_MARGIN" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--order-margin must be a number >= 0, got '$ORDER_MARGIN'"
[[ -n "$BUDGET" ]] || BUDGET=$(( QUICK ? 300 : 420 ))
[[ "$SYSTEMS" =~ ^[a-z0-9,-]+$ ]] || die "--systems must be comma-separated preset names, got '$SYSTEMS'"
IFS=, read -r -a WL <<< "$WORKLOADS"
for w in "${WL[@]}"; do [[ "$w" == mixtral || "$w" == deepseek ]] || die "unknown workload '$w' (mixtral, deepseek)"; done
[[ ${#WL[@]} -gt 0 ]] || die "--workloads is empty"

# ---- the workloads: synthetic trace arguments | replay and budget arguments of `dali exec validate` ----
# (--profile-share 0: executor and simulator are compared on every sequence, no profiling split is needed;
# --precision bf16: the full model's memory plan in bf16, as these workloads were sized before the 4-bit defaults)
LOOKAHEAD=(--lookahead residual=0.9 --lookahead next-gate=0.7 --lookahead gate2=0.6@2 --lookahead gate3=0.5@3)
if (( QUICK )); then
  SYNTH_mixtral=(--model mixtral-8x7b -n 2 --prompt-len 8 --gen-len 4 --seed 1)
  REPLAY_mixtral=(--scale 0.0625 --layers 4 --batch-size 2 --gpu-memory 24 --repeats 1 --profile-share 0 --precision bf16)
  SYNTH_deepseek=(--model deepseek-v2-lite -n 2 --prompt-len 8 --gen-len 4 --seed 2)
  REPLAY_deepseek=(--scale 0.0625 --layers 3 --batch-size 2 --gpu-memory 12 --repeats 1 --profile-share 0 --precision bf16)
else
  # Mixtral-8x7B at half width (experts of 88 MB), 8 MoE layers, on a 24 GiB consumer-GPU budget;
  # DeepSeek-V2-Lite at full width (experts of 17 MB), 6 MoE layers, on a 12 GiB budget
  SYNTH_mixtral=(--model mixtral-8x7b -n 8 --prompt-len 64 --gen-len 32 --seed 1)
  REPLAY_mixtral=(--scale 0.5 --layers 8 --batch-size 4 --gpu-memory 24 --repeats 3 --profile-share 0 --precision bf16)
  SYNTH_deepseek=(--model deepseek-v2-lite -n 8 --prompt-len 64 --gen-len 32 --seed 2)
  REPLAY_deepseek=(--scale 1 --layers 6 --batch-size 4 --gpu-memory 12 --repeats 3 --profile-share 0 --precision bf16)
fi

# ---- the interpreter and what it lacks ----
if [[ -z "$PY" ]]; then
  if command -v python3 >/dev/null 2>&1; then PY=python3; elif command -v python >/dev/null 2>&1; then PY=python; fi
fi
[[ -n "$PY" ]] && command -v "$PY" >/dev/null 2>&1 || die "no python3 found (give --python PY)"
"$PY" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null || die "$PY is older than Python 3.10"
# which modules the interpreter lacks (found without importing them: one quick call)
missing_of() {
  "$PY" - "$@" <<'EOF'
import importlib.util, sys
def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:
        return False
print(" ".join(m for m in sys.argv[1:] if not found(m)))
EOF
}
LACKS=$(missing_of torch numpy pandas pyarrow scipy matplotlib)
[[ -z "$LACKS" ]] || die "$PY cannot import: $LACKS (needed; not carried as wheels)"
# the executor's dense part calls F.scaled_dot_product_attention(..., enable_gqa=...), new in torch 2.5
TORCH_OLD=$("$PY" -c 'import torch; v = torch.__version__; print("" if tuple(int(x) for x in v.split("+")[0].split(".")[:2]) >= (2, 5) else v)' 2>&1) \
  || die "$PY cannot import torch: $(tail -n 1 <<< "$TORCH_OLD")"
[[ -z "$TORCH_OLD" ]] || die "$PY has torch $TORCH_OLD; the executor needs torch >= 2.5"
read -r -a MISSING <<< "$(missing_of simpy click tqdm)"
SITE=${DALI_SITE:-/tmp/dali-site}
EXTRA=""
if (( ${#MISSING[@]} )); then
  WHEELS=()
  for mod in "${MISSING[@]}"; do
    f=("$REPO"/scripts/wheels/"$mod"-*-py3-none-any.whl)
    [[ -f "${f[0]}" ]] || die "$PY cannot import $mod and scripts/wheels has no wheel for it"
    WHEELS+=("${f[0]}")
  done
  if (( DRY )); then
    echo "+ $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target $SITE ${WHEELS[*]}" >&2
    EXTRA=$SITE
  elif "$PY" -m pip --version >/dev/null 2>&1 && PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 \
       "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${WHEELS[@]}"; then
    EXTRA=$SITE
  else  # pure-Python wheels are zip files Python imports from directly
    EXTRA=$(IFS=:; echo "${WHEELS[*]}")
  fi
fi
export PYTHONPATH="$REPO${EXTRA:+:$EXTRA}${PYTHONPATH:+:$PYTHONPATH}"
export MPLBACKEND=Agg PYTHONUNBUFFERED=1 TQDM_DISABLE=1
if (( ! DRY )); then
  "$PY" -c 'import dali_sim.cli.main, simpy, click, tqdm' || die "the project does not import with PYTHONPATH=$PYTHONPATH"
  if [[ "$DEVICE" == cuda ]]; then
    "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || \
      die "CUDA is not available to $PY: run with --device cpu (and --quick for a short run)"
  fi
fi

DALI=("$PY" -m dali_sim)
if (( DRY )); then
  run() { { printf '+'; printf ' %q' "$@"; printf '\n'; } >&2; }  # stderr: outside the commands' redirections
  WORK=${WORK:-/tmp/dali-gpu-check.DRYRUN}
else
  run() { "$@"; }
  WORK=${WORK:-$(mktemp -d /tmp/dali-gpu-check.XXXXXX)}
  mkdir -p "$WORK" "$OUT_DIR" || die "cannot create $WORK or $OUT_DIR"
fi

main() {
START=$SECONDS
echo "== dali GPU check ($( ((QUICK)) && echo quick || echo full ), device $DEVICE, budget ${BUDGET} s)"
echo "repository $REPO; work $WORK; out $OUT_DIR; python $(command -v "$PY")"
if (( ! DRY )); then
  "$PY" - <<'EOF'
import os, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} cores, "
      f"cuda {torch.version.cuda if torch.cuda.is_available() else 'not available'}"
      + (f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
EOF
  (( ${#MISSING[@]} )) && echo "carried wheels for: ${MISSING[*]} (PYTHONPATH has $EXTRA)"
fi

# a step's seconds: QUICK_S or FULL_S, at most the budget / PARTS (step_share QUICK_S FULL_S PARTS)
step_share() { local s=$(( QUICK ? $1 : $2 )); (( s > BUDGET / $3 )) && s=$(( BUDGET / $3 )); echo "$s"; }

STATUS="$WORK/status.txt"   # one line per step: name, exit status, seconds (scripts/gpu_check_summary.py reads it)
(( DRY )) || : > "$STATUS"

# ---- tests step (--tests): the GPU tests, whose failures fail the check ----
if (( TESTS )); then
  t_share=$(step_share 60 150 3)
  echo
  echo "== tests: python -m pytest -m gpu (${t_share} s)"
  t0=$SECONDS
  if [[ -n "$(missing_of pytest)" ]]; then
    echo "tests: skipped, $PY cannot import pytest"
  else
    (cd "$REPO" && run timeout --signal=INT --kill-after=10 "$t_share" "$PY" -m pytest -m gpu -q -rfE --tb=line \
      -p no:cacheprovider tests/test_exec_gpu.py tests/test_exec_generate_gpu.py tests/test_exec_overhead_bench.py)
    rc=$?
    (( DRY )) || echo "tests $rc $(( SECONDS - t0 ))" >> "$STATUS"
    echo "tests: exit $rc after $(( SECONDS - t0 )) s"
  fi
fi

# ---- runtime step (issue "a real offloading runtime"): host overhead per layer and generate speed ----
# Separate from the validation below and before it, with its own share of the budget (the workloads get
# what is left); results go to the log (and $WORK/runtime-*.json), never into --out.
if (( RUNTIME )); then
  rt_share=$(step_share 30 90 4)
  echo
  echo "== runtime: host overhead per MoE layer and generate speed (${rt_share} s)"
  rt0=$SECONDS
  if (( QUICK )); then
    RT_OVERHEAD=(--shape qwen3-30b-a3b --batch-size 8 --sequences 8 --max-tokens 4 --layers 2 --scale 0.0625 --repeats 1)
    RT_GENERATE=(--prompts 4 --batch-size 2 --max-new-tokens 8 --repeats 1)
  else
    RT_OVERHEAD=(--shape qwen3-30b-a3b --batch-size 32 --sequences 32 --max-tokens 16 --layers 4 --scale 0.25 --repeats 2)
    RT_GENERATE=(--prompts 8 --batch-size 4 --max-new-tokens 32 --repeats 2)
  fi
  IFS=, read -r -a RT_SYS <<< "$SYSTEMS"
  RT_LOOK=(); RT_PLAIN=()
  for s in "${RT_SYS[@]}"; do
    case "$s" in dali|dali-plus|hybrimoe|mixtral-offloading) RT_LOOK+=("$s") ;; *) RT_PLAIN+=("$s") ;; esac
  done
  rt_plain=$(IFS=,; echo "${RT_PLAIN[*]}"); rt_look=$(IFS=,; echo "${RT_LOOK[*]}")
  # does time alone empty this machine's caches (a shared core)? Then the overhead below reads the machine
  run timeout --signal=INT --kill-after=5 10 "$PY" "$REPO/benchmarks/cold_host.py" --quick --json "$WORK/runtime-cold-host.json"
  echo "runtime cold host: exit $? after $(( SECONDS - rt0 )) s"
  if [[ "$DEVICE" == cuda ]]; then  # the lane's CUDA calls per visit, each beside a cheaper form
    run timeout --signal=INT --kill-after=5 20 "$PY" "$REPO/benchmarks/cuda_host_calls.py" --json "$WORK/runtime-cuda-calls.json"
    echo "runtime CUDA host calls: exit $? after $(( SECONDS - rt0 )) s"
    # the calls that make the host wait for the GPU inside a step, for a system without and one with a CPU lane,
    # and what waking that CPU lane's worker costs the host (--handoffs)
    run timeout --signal=INT --kill-after=5 30 "$PY" "$REPO/benchmarks/exec_overhead.py" --device cuda --quick \
      --shape qwen3-30b-a3b --systems gpu-lru,fiddler --lookahead-systems "" --sync-sites --handoffs \
      --json "$WORK/runtime-sync-sites.json"
    echo "runtime sync sites: exit $? after $(( SECONDS - rt0 )) s"
  fi
  run timeout --signal=INT --kill-after=5 "$(( rt_share / 2 ))" "$PY" "$REPO/benchmarks/exec_overhead.py" \
    --device "$DEVICE" "${RT_OVERHEAD[@]}" --systems "$rt_plain" --lookahead-systems "$rt_look" \
    --json "$WORK/runtime-overhead.json"
  echo "runtime overhead: exit $? after $(( SECONDS - rt0 )) s"
  left=$(( rt_share - (SECONDS - rt0) ))
  if (( left >= 5 )); then
    run timeout --signal=INT --kill-after=5 "$left" "$PY" "$REPO/benchmarks/generate_speed.py" \
      --device "$DEVICE" "${RT_GENERATE[@]}" --systems "cpu-only,dali" --json "$WORK/runtime-generate.json"
    echo "runtime generate: exit $? after $(( SECONDS - rt0 )) s"
  else
    echo "runtime generate: skipped, the step's share is spent"
  fi
fi

n=${#WL[@]}
i=0
for w in "${WL[@]}"; do
  left=$(( BUDGET - (SECONDS - START) ))
  share=$(( left / (n - i) - 15 ))   # the summary and the next workload's trace need a little
  i=$(( i + 1 ))
  synth="SYNTH_${w}[@]"; replay="REPLAY_${w}[@]"
  echo
  echo "== $w: ${share} s"
  if (( share < 20 )); then
    echo "$w: skipped, the budget is spent"; (( DRY )) || echo "$w 124 0 budget" >> "$STATUS"; continue
  fi
  t0=$SECONDS
  run "${DALI[@]}" trace synth "${!synth}" "${LOOKAHEAD[@]}" -q -o "$WORK/$w.parquet"
  rc=$?
  if (( rc == 0 )); then
    # validate stops starting systems (and further rounds of its 3 replays per system) at its budget;
    # timeout is the backstop (the tables it wrote stay)
    # (its budget leaves 5 s for starting Python and importing torch)
    run timeout --signal=INT --kill-after=10 "$(( share + 30 ))" "${DALI[@]}" exec validate \
      --trace "$WORK/$w.parquet" --systems "$SYSTEMS" --device "$DEVICE" "${!replay}" \
      --time-budget "$(( share - (SECONDS - t0) - 5 ))" --replays 3 --max-total-error "$MAX_TOTAL" \
      --order-margin "$ORDER_MARGIN" -o "$WORK/$w" > /dev/null
    rc=$?
  fi
  (( DRY )) || echo "$w $rc $(( SECONDS - t0 ))" >> "$STATUS"
  echo "$w: exit $rc after $(( SECONDS - t0 )) s"
done

echo
run "$PY" "$REPO/scripts/gpu_check_summary.py" --work "$WORK" --out "$OUT_DIR" --workloads "$WORKLOADS" \
  --elapsed "$(( SECONDS - START ))"
}

if (( DRY )); then
  main
else
  main 2>&1 | tee "$OUT_DIR/log.txt"
  exit "${PIPESTATUS[0]}"
fi
