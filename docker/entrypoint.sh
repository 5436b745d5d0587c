#!/usr/bin/env bash
# clipforge image entry point: report what this container runs (versions, git commit, visible
# GPUs) on stderr, start sshd when asked, then exec the given command, which so becomes the
# process that receives the container's signals (tini, PID 1, forwards them).
#
# Environment:
#   CLIPFORGE_SSHD=1                 start sshd before the command (default: off)
#   CLIPFORGE_SSHD_PORT              its port (default 2222)
#   CLIPFORGE_SSH_AUTHORIZED_KEYS    the public keys allowed to log in (default
#                                    /etc/clipforge/ssh/authorized_keys, a mounted Secret)
#   CLIPFORGE_SSH_HOST_KEY           optional private host key to use (a mounted Secret, for a
#                                    stable host identity); default: a new key per container
#   CLIPFORGE_SSHD_DIR               sshd's private working directory (default ~/.clipforge-sshd)
#   CLIPFORGE_GIT_COMMIT             the commit the image was built from (set by the image)
#   CLIPFORGE_ENV_FROM_STDIN=A,B     read the values of A and B from stdin, one line each (empty:
#                                    left unset), before the command; the command's stdin is then
#                                    /dev/null. Secrets (alert webhooks) arrive this way: a value
#                                    given with `docker run --env` stays in `docker inspect`.
# sshd runs as the container's (non-root) user, accepts only that user and only public keys.
set -euo pipefail

die() {
  echo "clipforge-entrypoint: error: $*" >&2
  exit 1
}

report() {
  echo "clipforge image: git commit ${CLIPFORGE_GIT_COMMIT:-unknown}"
  if ! command -v python >/dev/null 2>&1; then
    echo "python: not found on PATH"
  else
    # Versions from package metadata (fast); torch is imported for CUDA and the GPU count.
    python - <<'EOF' || echo "python: the version report failed (see above)"
import importlib.metadata as md
import sys

def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"

print(f"python {sys.version.split()[0]} | deepspeed {version('deepspeed')} | "
      f"open_clip {version('open_clip_torch')} | clipforge {version('clipforge')}")
try:
    import torch
except Exception as exc:  # report and go on: the command may be a debugging shell
    print(f"torch: import failed: {exc}")
else:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"torch {torch.__version__} | CUDA {torch.version.cuda} | "
          f"cuDNN {torch.backends.cudnn.version()} | GPUs visible to torch: {gpus}")
EOF
  fi
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>&1 || echo "nvidia-smi -L failed: no NVIDIA driver reachable"
  else
    echo "nvidia-smi: not found (no NVIDIA driver mounted into this container)"
  fi
}

start_sshd() {
  local port="${CLIPFORGE_SSHD_PORT:-2222}"
  local keys="${CLIPFORGE_SSH_AUTHORIZED_KEYS:-/etc/clipforge/ssh/authorized_keys}"
  local dir="${CLIPFORGE_SSHD_DIR:-$HOME/.clipforge-sshd}"
  local user sshd
  user="$(id -un)"
  [ "$(id -u)" -ne 0 ] || die "refusing to start sshd as root: run the container as its non-root user (uid 1000, the image default)"
  sshd="$(command -v sshd || echo /usr/sbin/sshd)"
  [ -x "$sshd" ] || die "CLIPFORGE_SSHD=1 but sshd is not installed"
  [ -s "$keys" ] || die "CLIPFORGE_SSHD=1 but $keys is missing or empty: mount the authorized_keys Secret there (or set CLIPFORGE_SSH_AUTHORIZED_KEYS); login is by public key only"
  [[ "$port" =~ ^[0-9]+$ ]] && [ "$port" -ge 1024 ] && [ "$port" -le 65535 ] \
    || die "CLIPFORGE_SSHD_PORT=$port: need a number from 1024 to 65535 (a non-root sshd cannot bind lower ports)"

  mkdir -p "$dir"
  chmod 700 "$dir"
  # sshd refuses keys in files or directories others may write (StrictModes), and the modes of a
  # mounted Secret vary by platform: it reads a private copy (a restart picks up rotated keys).
  install -m 600 "$keys" "$dir/authorized_keys"
  if [ -n "${CLIPFORGE_SSH_HOST_KEY:-}" ]; then
    install -m 600 "$CLIPFORGE_SSH_HOST_KEY" "$dir/host_key"
  elif [ ! -s "$dir/host_key" ]; then
    ssh-keygen -q -t ed25519 -N '' -C "clipforge-$(hostname)" -f "$dir/host_key"
  fi
  # An ssh session starts with sshd's minimal environment; DeepSpeed's multi-node launcher runs
  # its per-node command over ssh and needs the container's PATH (the venv) and CUDA settings.
  local setenv=() name
  for name in PATH LD_LIBRARY_PATH PYTHONUNBUFFERED CLIPFORGE_GIT_COMMIT $(compgen -e | grep -E '^(NVIDIA|CUDA|NCCL)_' || true); do
    [[ -n "${!name:-}" && "${!name}" != *[\"[:space:]]* ]] && setenv+=("$name=${!name}")
  done
  cat >"$dir/sshd_config" <<EOF
Port $port
HostKey $dir/host_key
PidFile $dir/sshd.pid
AuthorizedKeysFile $dir/authorized_keys
AllowUsers $user
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin no
UsePAM no
PermitUserEnvironment no
AllowAgentForwarding no
AllowTcpForwarding no
X11Forwarding no
PrintMotd no
Subsystem sftp internal-sftp
${setenv:+SetEnv ${setenv[*]}}
EOF
  # -E: there is no syslog in a container. sshd detaches once it listens; a bad config or a
  # taken port fails here, before the command starts.
  "$sshd" -f "$dir/sshd_config" -E "$dir/sshd.log" \
    || die "sshd did not start: $(tail -n 3 "$dir/sshd.log" 2>/dev/null)"
  echo "clipforge-entrypoint: sshd listening on port $port for $user (keys: $keys; log: $dir/sshd.log)" >&2
}

env_from_stdin() {
  local names name value
  IFS=',' read -ra names <<<"$CLIPFORGE_ENV_FROM_STDIN"
  for name in "${names[@]}"; do
    [[ "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "CLIPFORGE_ENV_FROM_STDIN: '$name' is not a variable name"
    IFS= read -r value || true
    if [ -n "$value" ]; then export "$name=$value"; fi
  done
  unset CLIPFORGE_ENV_FROM_STDIN
}

[ $# -gt 0 ] || die "no command given (the image's default is bash)"
# What the command writes is group-readable at most, as in every process of a run
# (clipforge.fsutil.RUN_UMASK: 027 added to the umask; a stricter one stays).
umask "$(printf %o $(( 0$(umask) | 027 )))"
report >&2
if [ "${CLIPFORGE_SSHD:-0}" = 1 ]; then
  start_sshd
elif [ "${CLIPFORGE_SSHD:-0}" != 0 ]; then
  die "CLIPFORGE_SSHD=${CLIPFORGE_SSHD}: use 1 (start sshd) or 0 (default, off)"
fi
if [ -n "${CLIPFORGE_ENV_FROM_STDIN:-}" ]; then
  env_from_stdin
  exec "$@" </dev/null
fi
exec "$@"
