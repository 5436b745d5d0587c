#!/usr/bin/env bash
# The GPU benchmark (bench/gpu.py) on an offline GPU machine.
#
#   bench/gpu-run.sh OUT_DIR [--dry-run] [--total-seconds N] [--skip SECTION...]
#
# The machine needs Python >= 3.10 with a CUDA build of torch and torchvision (tested for
# Python 3.12, torch 2.11+cu130). What it lacks of clipforge's stack (DeepSpeed, open_clip and
# their small dependencies) is installed from bench/wheels/ only, never from a network, into a
# folder of its own (CLIPFORGE_BENCH_SITE) that leaves the machine's environment untouched. Fill
# bench/wheels/ on a machine with PyPI first: `make bench-wheels`.
# open_clip_train (reference (2), shipped in the open_clip_torch wheel) also needs pandas, which
# such a machine carries; without it that one row records the ImportError and the rest runs.
# Writes OUT_DIR/gpu-bench.json and OUT_DIR/gpu-bench.md after every row (ViT-B/32 on an H200:
# at most 430 s, each section within its own budget: bench/gpu.py). Without DeepSpeed (no wheel,
# or one that does not import) it still runs the rows that need none.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:?usage: bench/gpu-run.sh OUT_DIR [--dry-run] [--total-seconds N] [--skip SECTION...]}"
shift
python="${PYTHON:-python3}"
wheels="${CLIPFORGE_WHEELS:-$root/bench/wheels}"
site="${CLIPFORGE_BENCH_SITE:-${TMPDIR:-/tmp}/clipforge-bench-site}"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"

# The modules of clipforge's stack that do not import, one line each: "NAME: why".
not_importing() {
    "$python" -c '
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        print(f"{name}: {type(exc).__name__}: {exc}".splitlines()[0])
' deepspeed open_clip webdataset
}

missing="$(not_importing)"
if [ -n "$missing" ] && compgen -G "$wheels/*.whl" >/dev/null; then
    echo "installing $(ls "$wheels"/*.whl | wc -l) wheels from $wheels into $site"
    "$python" -m pip install --quiet --no-index --no-deps --no-compile --upgrade \
        --target "$site" "$wheels"/*.whl
    export PYTHONPATH="$site:$PYTHONPATH"
    missing="$(not_importing)"
fi
# open_clip and webdataset are needed by every row that measures the model; DeepSpeed only by
# clipforge's own rows, which record why it does not import while the others run.
if grep -q -e '^open_clip:' -e '^webdataset:' <<<"$missing"; then
    echo "bench/gpu-run.sh: open_clip or webdataset does not import and $wheels holds no wheels" \
        "that make it: run \`make bench-wheels\` on a machine with PyPI and copy bench/wheels/ here" >&2
    exit 2
fi
if grep -q '^deepspeed:' <<<"$missing"; then
    echo "bench/gpu-run.sh: DeepSpeed does not import ($(grep '^deepspeed:' <<<"$missing" | cut -d' ' -f2-)):" \
        "clipforge's rows will say so; plain PyTorch, open_clip_train and the loader still run" >&2
fi

mkdir -p "$out"
exec "$python" "$root/bench/gpu.py" --out "$out" "$@"
