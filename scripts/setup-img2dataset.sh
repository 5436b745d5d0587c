#!/usr/bin/env bash
# img2dataset in a virtual environment of its own (default .venv-img2dataset), run by the data
# stage as a command. Why separate: img2dataset pins webdataset<0.3, albumentations<2, pandas<3
# and pulls in wandb and OpenCV; in clipforge's environment those pins would hold back the
# webdataset that open_clip and our shard writer use. Nothing here is imported by clipforge.
# Idempotent: reruns only upgrade to the pins below.
set -euo pipefail

venv="${1:-.venv-img2dataset}"
python="${PYTHON:-python3}"
# The tool and the webdataset it writes shards with, pinned so shards are made the same way
# everywhere (img2dataset 1.47.0 allows webdataset>=0.2.5,<0.3).
pins=(img2dataset==1.47.0 webdataset==0.2.111)

test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "${pins[@]}"
NO_ALBUMENTATIONS_UPDATE=1 WANDB_MODE=disabled "$venv/bin/img2dataset" --help >/dev/null 2>&1 || {
  echo "setup-img2dataset: $venv/bin/img2dataset does not run" >&2
  exit 1
}
echo "setup-img2dataset: $("$venv/bin/python" -c "import importlib.metadata as m; print('img2dataset', m.version('img2dataset'), '/ webdataset', m.version('webdataset'))") in $venv"
