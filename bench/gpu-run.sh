#!/usr/bin/env bash
# The GPU benchmark (bench/gpu.py) on an offline GPU machine.
#
#   bench/gpu-run.sh OUT_DIR [--dry-run] [--skip SECTION...]
#
# The machine needs Python >= 3.10 with a CUDA build of torch and torchvision (tested for
# Python 3.12, torch 2.11+cu130). What it lacks of clipforge's stack (DeepSpeed, open_clip and
# their small dependencies) is installed from bench/wheels/ only, never from a network, into a
# folder of its own (CLIPFORGE_BENCH_SITE) that leaves the machine's environment untouched. Fill
# bench/wheels/ on a machine with PyPI first: `make bench-wheels`.
# open_clip_train (reference (2), shipped in the open_clip_torch wheel) also needs pandas, which
# such a machine carries; without it that one row records the ImportError and the rest runs.
# Writes OUT_DIR/gpu-bench.json and OUT_DIR/gpu-bench.md after every row (ViT-B/32 on an H200:
# at most 430 s, each section within its own budget: bench/gpu.py).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:?usage: bench/gpu-run.sh OUT_DIR [--dry-run] [--skip SECTION...]}"
shift
python="${PYTHON:-python3}"
wheels="${CLIPFORGE_WHEELS:-$root/bench/wheels}"
site="${CLIPFORGE_BENCH_SITE:-${TMPDIR:-/tmp}/clipforge-bench-site}"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"

if ! "$python" -c "import deepspeed, open_clip, webdataset" 2>/dev/null; then
    if ! compgen -G "$wheels/*.whl" >/dev/null; then
        echo "bench/gpu-run.sh: DeepSpeed or open_clip is missing and $wheels holds no wheels;" \
            "run \`make bench-wheels\` on a machine with PyPI and copy bench/wheels/ here" >&2
        exit 2
    fi
    echo "installing $(ls "$wheels"/*.whl | wc -l) wheels from $wheels into $site"
    "$python" -m pip install --quiet --no-index --no-deps --no-compile --upgrade \
        --target "$site" "$wheels"/*.whl
    export PYTHONPATH="$site:$PYTHONPATH"
    "$python" -c "import deepspeed, open_clip, webdataset" || {
        echo "bench/gpu-run.sh: the wheels in $wheels did not make DeepSpeed and open_clip importable" >&2
        exit 2
    }
fi

mkdir -p "$out"
exec "$python" "$root/bench/gpu.py" --out "$out" "$@"
