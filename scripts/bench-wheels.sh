#!/usr/bin/env bash
# Fill a folder with the wheels bench/gpu-run.sh installs on an offline GPU machine (Python 3.12,
# CUDA torch + torchvision, no DeepSpeed or open_clip): `make bench-wheels` -> bench/wheels/.
#
# DeepSpeed has no wheel on PyPI: it is built here from its sdist, with no ops compiled (pure
# Python; its CUDA ops compile on first use, and the benchmark uses torch's AdamW, needing none).
# 0.19.8 is the DeepSpeed this project runs locally on torch 2.14 and supports Python 3.12 and
# torch 2.11. The rest are the pure-Python or cp312 manylinux wheels of open_clip and DeepSpeed
# dependencies that such a machine does not carry (it has torch, torchvision, timm, numpy,
# pillow, regex, safetensors, huggingface_hub, tensorboard, ninja, psutil, msgpack, py-cpuinfo,
# einops, nvidia-ml-py, pyyaml, tqdm). typing-extensions comes along: pydantic needs a recent one.
set -euo pipefail

dest="${1:?usage: scripts/bench-wheels.sh DEST_DIR}"
python="${PYTHON:-.venv/bin/python}"
rm -rf "$dest"
mkdir -p "$dest"

DEEPSPEED=deepspeed==0.19.8
PURE=(
    open_clip_torch==3.3.0 ftfy==6.3.1 wcwidth==0.9.4 webdataset==1.0.2 braceexpand==0.1.7
    hjson==3.1.0 pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0
)
CP312=(pydantic-core==2.50.5)

DS_BUILD_OPS=0 "$python" -m pip wheel --quiet --no-deps --no-build-isolation -w "$dest" "$DEEPSPEED"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation py --platform any -d "$dest" "${PURE[@]}"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" "${CP312[@]}"

size_kib=$(du -sk "$dest" | cut -f1)
if ((size_kib > 64 * 1024)); then
    echo "scripts/bench-wheels.sh: $dest holds ${size_kib} KiB, over the 64 MiB a device run carries" >&2
    exit 1
fi
ls -1 "$dest"
echo "$dest: ${size_kib} KiB"
