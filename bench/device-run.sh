#!/usr/bin/env bash
# The one command for the project's device tool on a lent GPU machine, from the repository root:
#
#   bash bench/device-run.sh                     (carry: bench/wheels; timeout_s 500)
#   bash bench/device-run.sh --total-seconds 150 --skip losses zero23 compile loader train_run
#                                                (the fallback, <= 200 s: env, the ZeRO-1 step
#                                                rows, both references, end to end)
#   bash bench/device-run.sh --dry-run           (the same code on the box's CPU)
#
# Runs bench/gpu-run.sh under an 8-minute limit and leaves gpu-bench.json, gpu-bench.md and the
# log in $OUT, whatever happens: the benchmark rewrites its results after every row, and budgets
# its own sections to end before the limit (bench/gpu.py: FULL.total_seconds, 430 s; with the
# machine's start about 10 of a task's 15 device minutes, leaving room for the fallback). The
# machine's facts go to the log first, so even a run that cannot start Python says what it ran
# on.
set -uo pipefail

out="${OUT:?bench/device-run.sh: OUT (the folder whose files come back) is not set}"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
export PYTHONUNBUFFERED=1
{
    echo "nproc: $(nproc)"
    df -h /dev/shm 2>&1 | tail -n 1
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit \
        --format=csv 2>&1 || true
    "${PYTHON:-python3}" -c 'import sys, torch, torchvision; print(sys.version.split()[0], torch.__version__, torchvision.__version__)' 2>&1 || true
} >"$out/gpu-bench.log"
timeout --signal=TERM --kill-after=15 470 bash bench/gpu-run.sh "$out" "$@" 2>&1 | tee -a "$out/gpu-bench.log"
status=${PIPESTATUS[0]}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv >>"$out/gpu-bench.log" 2>&1 || true
exit "$status"
