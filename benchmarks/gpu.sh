#!/usr/bin/env bash
# One command for a session with a GPU: the `cuda`-marked tests, then the GPU benchmarks in
# short GPU-sized configurations; each step's output and markdown tables land in the results
# directory, with a combined gpu_summary.md (command, device, status and tables of every step).
#
#   bash benchmarks/gpu.sh [RESULTS_DIR]    # default: $OUT if set, else benchmarks/results/gpu
#
# Environment: PYTHON (default python3), GPU_BUDGET_S (default 450: the whole run's wall-time
# budget; each step is bounded by `timeout`, by its own limit and by what is left of the
# budget; steps that no longer fit are recorded as skipped). A failing or timed-out step is
# recorded in the summary and the next step runs. GPU_STEPS (default: all) names the steps to
# run, e.g. GPU_STEPS="cuda_tests one_gpu_gpt2 one_gpu_llama tune"; the others are left out of the
# summary. Exit status: 2 without a CUDA device, 1 if any step failed, timed out or was skipped
# for time, 0 otherwise.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RES=${1:-${OUT:-benchmarks/results/gpu}}
BUDGET=${GPU_BUDGET_S:-450}
mkdir -p "$RES"
SUMMARY="$RES/gpu_summary.md"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
FAILED=0

# One interpreter start for every probe (importing torch takes seconds): versions, then the
# GPUs, or exit 1 without one.
PROBE=$($PY -c 'import sys, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}")
if not torch.cuda.is_available():
    sys.exit(1)
print(torch.cuda.device_count())
print(torch.cuda.get_device_name(0))' 2>&1)
OK=$?
{
  echo "# GPU run of fxpipe's cuda tests and benchmarks"
  echo
  echo "- command: \`bash benchmarks/gpu.sh $*\` (PYTHON=$PY, GPU_BUDGET_S=$BUDGET), $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "- versions: $(echo "$PROBE" | head -n 1)"
} > "$SUMMARY"
if [ $OK -ne 0 ]; then
  { echo "- device: none: torch.cuda.is_available() is False (or torch failed to import); nothing was run:"
    echo '```'; echo "$PROBE" | tail -n 3; echo '```'; } >> "$SUMMARY"
  echo "gpu.sh: no CUDA device is available (torch.cuda.is_available() is False under $PY); nothing to run." >&2
  echo "$PROBE" | tail -n 3 >&2
  echo "gpu.sh: summary in $SUMMARY" >&2
  exit 2
fi
GPUS=$(echo "$PROBE" | sed -n 2p)
DEVICE="$GPUS x $(echo "$PROBE" | sed -n 3p)"
echo "- device: $DEVICE" >> "$SUMMARY"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/- nvidia-smi: /' >> "$SUMMARY"
echo "gpu.sh: $DEVICE; results in $RES; budget ${BUDGET}s" >&2

# Markdown tables of a step's output: every line starting with '|', each table preceded by
# the last non-table line before it (its caption).
tables() {
  awk '/^\|/ { if (!intable && caption != "") print "\n" caption "\n"; intable = 1; print; next }
       { if (intable) { intable = 0 }; if ($0 != "") caption = $0 }' "$1"
}

# step NAME LIMIT_S COMMAND...: runs COMMAND under timeout, stdout to NAME.md, stderr to NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  if [ -n "${GPU_STEPS:-}" ] && [[ " $GPU_STEPS " != *" $name "* ]]; then
    return  # not selected
  fi
  local left=$((BUDGET - ($(date +%s) - START)))
  {
    echo
    echo "## $name"
    echo
    echo "\`$*\`"
    echo
  } >> "$SUMMARY"
  if [ "$left" -lt 20 ]; then
    FAILED=1
    echo "**skipped**: ${left}s left of the ${BUDGET}s budget" >> "$SUMMARY"
    echo "gpu.sh: $name skipped (budget)" >&2
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "gpu.sh: $name (limit ${limit}s): $*" >&2
  local t0=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$RES/$name.md" 2> "$RES/$name.log"
  local rc=$? took=$(($(date +%s) - t0))
  if [ $rc -eq 0 ]; then
    echo "status: ok, ${took}s" >> "$SUMMARY"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    FAILED=1
    echo "status: **timed out** after ${limit}s (rc $rc); partial output in $name.md / $name.log" >> "$SUMMARY"
  else
    FAILED=1
    echo "status: **failed**, rc $rc, ${took}s; its last lines:" >> "$SUMMARY"
    local last="$RES/$name.log"
    [ -s "$last" ] || last="$RES/$name.md"
    { echo '```'; tail -n 15 "$last" | awk 1; echo '```'; } >> "$SUMMARY"
  fi
  echo "gpu.sh: $name rc=$rc ${took}s" >&2
  if [ -s "$RES/$name.tables.md" ]; then
    cat "$RES/$name.tables.md" >> "$SUMMARY"
  elif grep -q '^|' "$RES/$name.md"; then
    tables "$RES/$name.md" >> "$SUMMARY"
  elif [ -s "$RES/$name.md" ]; then  # no markdown table: the end of its output as it is
    { echo; echo '```'; tail -n 12 "$RES/$name.md" | awk 1; echo '```'; } >> "$SUMMARY"
  fi
}

# 1. the cuda-marked tests (per-test timeout when pytest-timeout is installed)
PT_TIMEOUT=""
$PY -c 'import pytest_timeout' 2>/dev/null && PT_TIMEOUT="--timeout=120"
# (a test module that cannot be imported, e.g. without the graphviz package, must not stop the rest)
step cuda_tests 200 $PY -m pytest -m cuda -q -p no:cacheprovider -rfEs --continue-on-collection-errors $PT_TIMEOUT tests
if [ -f "$RES/cuda_tests.md" ]; then
  grep -E '(passed|failed|error|skipped)' "$RES/cuda_tests.md" | tail -n 1 | sed 's/^/result: /' >> "$SUMMARY"
  grep -E '^(FAILED|ERROR)' "$RES/cuda_tests.md" | head -n 20 | sed 's/^/- /' >> "$SUMMARY"
fi

# 1a. fxpipe.distributed on one GPU over NCCL: world size 1, two stages on the rank (zbv's V and
# interleaved 1F1B: no send between ranks), against torch.distributed.pipelining driven by hand
# on the same split; every contender checked exact against eager first
step distributed 60 $PY benchmarks/distributed.py --device cuda --nproc 1 --stages-per-rank 2 \
  --schedules zbv,interleaved1f1b --chunks 4 --quick --output "$RES/distributed.json"

# (never measured on a GPU before: the steps above and below come first; the earlier
# benchmarks from 2. on were measured on an H100 and get what is left of the budget)
# 1b. issue 21, one GPU measured: eager, accumulation, HF checkpointing, torch.compile (its
# CUDA-graphs floor) and fxpipe on one device, each row checked against eager, rows printed as
# measured (a timeout keeps those done). GPT-2 124M: the uncompiled rows, then the graph rows
# (fxpipe's reduce-overhead, the floor), torch.compile and compile=True; compiling costs most
# of its time. Then the 0.94B Llama's table, and a profile of its fxpipe chunks=1 'never' step
# by fxpipe frame (issue 21 §0).
step one_gpu_gpt2 180 $PY benchmarks/one_gpu.py --device cuda --model gpt2 --steps 6 --warmup 1 \
  --rows uncompiled pipe:4:never:ro ro_accum compiled pipe:4:never:compile --floor --out "$RES/one_gpu_gpt2.json"
step one_gpu_llama 110 $PY benchmarks/one_gpu.py --device cuda --model llama1b --steps 5 --warmup 1 \
  --out "$RES/one_gpu_llama.json" --profile "$RES/profile"

# 1c. issue 22, fxpipe.tune on one GPU: TinyGPT and the U-Net, 4 stages on the device, each
# configuration's predicted activation peak and step time against torch.cuda.max_memory_allocated
# and the measured step, and tune's first choice against the best measured
step tune 60 $PY benchmarks/tune.py --device cuda --chunks 1 4 8 --steps 5 --out "$RES/tune_cuda.json"
# 1d. issue 33, tune's defaults on the three unseen models on the GPU: the total peak per step
# against torch.cuda.max_memory_allocated, every "fits" honoured, the first choice side by side
step tune_unseen 90 $PY benchmarks/tune.py --unseen --device cuda --steps 3 --rounds 7 --out "$RES/tune_unseen_cuda.json"

# 2. the headline claims: throughput vs torchgpipe, and the ablation
step throughput 100 $PY benchmarks/throughput.py --device cuda --quick \
  --out "$RES/throughput.json" --markdown "$RES/throughput.tables.md"

# 3. skip connections: portals vs the sequential form, GPU-sized U-Net
step skip_portals 40 $PY benchmarks/skip_portals.py --device cuda --depth 4 --base 32 --image 128 \
  --batch 32 --chunks 8 --steps 6 --warmup 2 --output "$RES/skip_portals.json"

# 4. activation memory against its floor
step activation_memory 75 $PY benchmarks/activation_memory.py --device cuda --out "$RES/activation_memory.json"

# 5. per-task runtime overhead vs torchgpipe, stages on the GPU
step overhead 40 $PY benchmarks/overhead.py --device cuda --quick --out "$RES/overhead.json"

# 6. partition quality of 'time' balancing with GPU profiles
step partition_quality 35 $PY benchmarks/partition_quality.py --device cuda --quick \
  --out "$RES/partition_quality.json"

# 7. planner scaling (the profile phases on the GPU)
step planner_scaling 20 $PY benchmarks/planner_scaling.py --device cuda --quick --out "$RES/planner_scaling.json"

# 8. planning time: a GPT-2 124M build against one eager step on the GPU (the build is CPU work)
step planning 60 $PY benchmarks/planning.py --device cuda --models gpt2-12 --repeat 1 --out "$RES/planning.json"

# 9. compiled stages at chunks=1 (the goal row; inductor/Triton compile time dominates, so last: it gets what is left)
step compiled 90 $PY benchmarks/compiled.py --device cuda --chunks 1 --repeat 5 --warmup 2 --out "$RES/compiled.json"

echo >> "$SUMMARY"
echo "total: $(($(date +%s) - START))s of the ${BUDGET}s budget" >> "$SUMMARY"
echo "gpu.sh: done in $(($(date +%s) - START))s; summary: $SUMMARY" >&2
exit $FAILED
