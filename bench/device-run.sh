#!/usr/bin/env bash
# The one command for the project's device tool on a lent GPU machine, from the repository root:
#
#   bash bench/device-run.sh        (carry: bench/wheels)
#
# Runs bench/gpu-run.sh under an 8-minute limit and leaves gpu-bench.json, gpu-bench.md and the
# log in $OUT, whatever happens: the benchmark rewrites its results after every section.
set -uo pipefail

out="${OUT:?bench/device-run.sh: OUT (the folder whose files come back) is not set}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
timeout --signal=TERM --kill-after=15 470 bash bench/gpu-run.sh "$out" "$@" 2>&1 | tee "$out/gpu-bench.log"
status=${PIPESTATUS[0]}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >>"$out/gpu-bench.log" 2>&1 || true
exit "$status"
