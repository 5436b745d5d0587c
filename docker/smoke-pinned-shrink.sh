#!/usr/bin/env bash
# Fewer GPUs, same run, on the image's pinned stack (DeepSpeed 0.14.5, torch 2.1.2): the smoke's
# data trained on 2 CPU ranks (gloo) for its 6 steps, uninterrupted (reference/); then the same
# run again (lost/), killed after the checkpoint of step 3, as a rank lost with its GPU kills it,
# and resumed on 1 rank (CLIPFORGE_RANKS_PER_NODE=1, what the supervisor sets after a GPU
# is lost): the checkpoint of 2 ranks loads through DeepSpeed's universal checkpoint
# (ds_to_universal), and the run ends. tests/docker/test_pinned_stack.py compares the two as
# tests/launcher/host/test_fewer_gpus.py does on the newest DeepSpeed (losses step by step, weights).
#
#   docker/smoke-pinned-shrink.sh VENV PROJECT OUT
#
# VENV: the pinned environment; PROJECT: the smoke's project (params.yaml and the data stage's
# data/); OUT: made afresh, holds reference/ and lost/ (each: checkpoints, models, metrics,
# train.log). Called by docker/smoke-pinned-stack.sh after its single-rank run.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="$(realpath "$1")" project="$(realpath "$2")" out="$(realpath -m "$3")"
rm -rf "$out"
mkdir -p "$out"

# The smoke's data and batch (6 steps of 32 = 16 micro x 2 ranks), a checkpoint every 3 steps,
# the loss of every step in metrics/train.tsv.
overrides=(
  --set data.num_train=192 --set data.num_val=32 --set data.num_test_images=24
  --set data.image_size=32 --set data.samples_per_shard=50 --set model.image_size=32
  --set train.device=cpu --set train.global_batch_size=32 --set train.micro_batch_size=16
  --set train.epochs=1 --set train.warmup_steps=2 --set train.num_workers=0
  --set train.save_every_steps=3 --set train.log_every_steps=1 --set train.ranks_per_node=2
)
train() {  # train DIR [env...]: the train stage writing under DIR, its log in DIR/train.log
  local dir="$1"
  shift
  mkdir -p "$dir"
  env PYTHONPATH="$repo/src" DS_ACCELERATOR=cpu "$@" "$venv/bin/python" -m clipforge.train \
    --params "$project/params.yaml" --data "$project/data" --checkpoints "$dir/checkpoints" \
    --model-out "$dir/models/clip" --logs "$dir/logs" --metrics "$dir/metrics" \
    "${overrides[@]}" >>"$dir/train.log" 2>&1
}
latest() { cat "$1"/checkpoints/run-*/latest 2>/dev/null || true; }

started=$SECONDS
echo "smoke-pinned: shrink: 2 ranks, uninterrupted"
train "$out/reference" || { tail -n 40 "$out/reference/train.log"; exit 1; }
echo "smoke-pinned: shrink: reference done in $((SECONDS - started)) s"

mark=$SECONDS
lost="$out/lost"
release="$lost/never"  # step 5 waits for this file, which never comes: the run is killed there
mkdir -p "$lost"
# Its own session, so the launcher and both ranks are killed together, as a lost GPU ends them.
setsid bash -c "$(declare -f train); $(declare -p repo venv project overrides); \
  train '$lost' CLIPFORGE_FAULTS=wait@5=$release" &
session=$!
until [ "$(latest "$lost")" = step-00000003 ]; do
  if ! kill -0 "$session" 2>/dev/null; then
    echo "smoke-pinned: shrink: the 2-rank run ended before its checkpoint of step 3" >&2
    tail -n 40 "$lost/train.log" >&2
    exit 1
  fi
  sleep 0.5
done
kill -KILL -- "-$session"
wait "$session" || true
echo "smoke-pinned: shrink: 2 ranks killed after step 3's checkpoint ($((SECONDS - mark)) s)"

mark=$SECONDS
train "$lost" CLIPFORGE_RANKS_PER_NODE=1 || { tail -n 40 "$lost/train.log"; exit 1; }
echo "smoke-pinned: shrink: resumed on 1 rank and finished in $((SECONDS - mark)) s"
echo "smoke-pinned: shrink: passed in $((SECONDS - started)) s"
