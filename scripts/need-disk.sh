#!/usr/bin/env bash
# Refuses an install that cannot fit, before its downloads: pip's "No space left on device" comes
# minutes in and leaves a half-made environment behind.
# usage: scripts/need-disk.sh GIB DIR WHAT   (DIR: where the install writes; WHAT: what it makes)
set -euo pipefail
need_gib=$1 dir=$2 what=$3
free_kib=$(df --output=avail -k "$dir" | tail -n 1)
free_gib=$((free_kib / 1024 / 1024))
if ((free_gib < need_gib)); then
  echo "error: $what needs about $need_gib GB free on the disk of $(realpath "$dir"), which has $free_gib GB." >&2
  echo "  free some space there (old test folders under ${TMPDIR:-/tmp}/pytest-of-$(id -un), pip's cache: pip cache purge), then run it again." >&2
  exit 1
fi
