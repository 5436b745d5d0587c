#!/usr/bin/env bash
# Debian/Ubuntu packages, each installed only when missing (with sudo when not root):
#   scripts/setup-system.sh numactl          the local stack: DeepSpeed's launcher binds CPU ranks
#                                            with it (make env, so make demo and make test)
#   scripts/setup-system.sh openssh-server   the launcher tests only: they run a real sshd on
#                                            127.0.0.1 (make test)
#   scripts/setup-system.sh iproute2         the multi-node tests give each "host" a network
#                                            namespace with `ip netns` (make test)
#   scripts/setup-system.sh fonts-wqy-microhei   a CJK font: the retrieval samples in TensorBoard
#                                            draw their Chinese captions with it (make demo,
#                                            make test)
#   scripts/setup-system.sh chromium          a headless browser: the test that `dvc plots show`'s
#                                            page draws its charts offline (make test)
#   scripts/setup-system.sh docker.io debootstrap   a private Docker engine and the Debian base of
#                                            the CPU image (make image-cpu, make test-integration)
set -euo pipefail

present() {
  case "$1" in
    numactl) command -v numactl >/dev/null 2>&1 ;;
    openssh-server) [ -x /usr/sbin/sshd ] ;;
    iproute2) command -v ip >/dev/null 2>&1 ;;
    fonts-wqy-microhei) [ -f /usr/share/fonts/truetype/wqy/wqy-microhei.ttc ] ;;
    chromium) command -v chromium >/dev/null 2>&1 ;;
    docker.io) [ -x /usr/sbin/dockerd ] ;;
    debootstrap) command -v debootstrap >/dev/null 2>&1 ;;
    *) echo "setup-system: unknown package $1 (known: numactl, openssh-server, iproute2, fonts-wqy-microhei, chromium, docker.io, debootstrap)" >&2; exit 2 ;;
  esac
}

missing=()
for package in "$@"; do
  present "$package" || missing+=("$package")
done
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
