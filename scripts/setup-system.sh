#!/usr/bin/env bash
# System packages the local stack needs (Debian/Ubuntu):
#   numactl         DeepSpeed's launcher binds CPU ranks with it
#   openssh-server  the launcher tests run a real sshd on 127.0.0.1
#   iproute2        the multi-node tests give each "host" a network namespace (`ip netns`)
#   docker.io       the docker-runtime tests start a private Docker engine
#   debootstrap     makes the Debian base of the CPU image (make image-cpu)
# Idempotent: installs only what is missing.
set -euo pipefail

missing=()
command -v numactl >/dev/null 2>&1 || missing+=(numactl)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
[ -x /usr/sbin/dockerd ] || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
[ ${#missing[@]} -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup-system: missing ${missing[*]}; install them with your package manager" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "setup-system: need root (or sudo) to apt-get install ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
echo "setup-system: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
