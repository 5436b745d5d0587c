"""Which hosts a task acts on, and verified SSH connections to run commands on them.

Which hosts a task acts on, SSH connections to them with host keys verified, and commands run
over those connections: quiet, never reading the local terminal, failures made clear.

Hosts come from Fabric's `-H user@host:port[,...]` (with `-i key`), or else from the stack
outputs of `make up`. Host keys are checked against known_hosts (~/.ssh/known_hosts, or the
UserKnownHostsFile of the host's ssh config) and, for stack workers, against the key the stack
published. Fabric itself would accept any key (paramiko's AutoAddPolicy); every connection made
here replaces that. The documented opt-out for a fresh host is `--accept-new-host-key` (as
OpenSSH's StrictHostKeyChecking=accept-new: a new key is recorded, a changed key still refused).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import shlex
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import paramiko
from fabric import Config, Connection
from invoke.exceptions import ThreadException

from clipforge.errors import LauncherError
from clipforge.fsutil import RUN_UMASK
from clipforge.launcher.stack import StackOutputs

# Outside the cluster, stack workers are reached through a port-forward to the entry worker:
#   kubectl -n <ns> port-forward pod/clipforge-worker-0 2222:2222
# This names the jump host (HOST:PORT), or `none` when running inside the cluster.
GATEWAY_ENV = "CLIPFORGE_SSH_GATEWAY"


@dataclass(frozen=True)
class HostSpec:
    host: str  # a name or address, or an alias of the ssh config
    user: str | None = None  # None: from the ssh config, else the local user
    port: int | None = None
    pinned_key: str | None = None  # "ssh-ed25519 AAAA..." published by the stack
    gateway: HostSpec | None = None


def spec_of(cxn: Connection) -> HostSpec:
    """The host of a Connection that Fabric made for one -H entry (not opened)."""
    return HostSpec(host=cxn.original_host, user=cxn.user, port=cxn.port)


def targets(cli_hosts: list[HostSpec], stack_loader) -> tuple[list[HostSpec], StackOutputs | None]:
    """-H hosts when given, else the stack's workers; `stack_loader()` raises a clear error."""
    if cli_hosts:
        return list(cli_hosts), None
    stack = stack_loader()
    gateway = _stack_gateway(stack)
    return [
        HostSpec(
            host=h,
            user=stack.ssh_user,
            port=stack.ssh_port,
            pinned_key=stack.host_public_key,
            gateway=gateway,
        )
        for h in stack.worker_hosts
    ], stack


def _stack_gateway(stack: StackOutputs) -> HostSpec | None:
    value = os.environ.get(GATEWAY_ENV, f"127.0.0.1:{stack.ssh_port}")
    if value.lower() == "none":
        return None
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise LauncherError(
            f"{GATEWAY_ENV}={value!r}: expected HOST:PORT (the local end of "
            f"`kubectl port-forward`) or `none`"
        )
    return HostSpec(
        host=host, user=stack.ssh_user, port=int(port), pinned_key=stack.host_public_key
    )


class _Reject(paramiko.MissingHostKeyPolicy):
    def missing_host_key(self, client, hostname, key):
        raise UnknownHostKey(hostname, key)


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """Record a key never seen for this host in known_hosts; a changed key is still refused
    (paramiko raises BadHostKeyException before asking a policy)."""

    def __init__(self, known_hosts: Path):
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        self.known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.known_hosts, "a", encoding="utf-8") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


class UnknownHostKey(paramiko.SSHException):
    def __init__(self, hostname: str, key):
        super().__init__(f"unknown host key for {hostname}")
        self.hostname = hostname
        self.key = key


def connect(spec: HostSpec, config: Config, accept_new_host_key: bool) -> Connection:
    """An open, verified connection; LauncherError saying what went wrong and what to do."""
    gateway = connect(spec.gateway, config, accept_new_host_key) if spec.gateway else None
    kwargs = {"config": config}
    if spec.user:
        kwargs["user"] = spec.user
    if spec.port:
        kwargs["port"] = spec.port
    cxn = Connection(spec.host, gateway=gateway, **kwargs)
    known_hosts = _known_hosts_file(cxn)
    client = cxn.client
    if known_hosts.is_file():
        client.load_host_keys(str(known_hosts))
    if spec.pinned_key:
        _pin(client, cxn, spec.pinned_key)
    client.set_missing_host_key_policy(
        _AcceptNew(known_hosts) if accept_new_host_key else _Reject()
    )
    _open(cxn, known_hosts)
    return cxn


# What a tunnel's thread meets when the client at the local end goes away mid-exchange (a browser
# dropping a response): that client's business, no error of the forward.
_DROPPED_BY_CLIENT = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


@contextlib.contextmanager
def forward_local(cxn: Connection, local_port: int, remote_port: int) -> Iterator[None]:
    """127.0.0.1:LOCAL_PORT here reaching 127.0.0.1:REMOTE_PORT on the host, inside the context.

    Fabric raises what any tunnel's thread met when the context ends, as a ThreadException: after
    Ctrl-C on `fab tensorboard`, a browser's reset connection became a traceback. Those are left
    out (the context's own error, if any, is raised); any other error of a tunnel is raised as
    Fabric raises it."""
    inside: BaseException | None = None
    try:
        with cxn.forward_local(local_port, remote_port=remote_port, remote_host="127.0.0.1"):
            try:
                yield
            except BaseException as exc:
                inside = exc
                raise
    except ThreadException as exc:
        if not all(isinstance(w.value, _DROPPED_BY_CLIENT) for w in exc.exceptions):
            raise
        if inside is not None:
            raise inside from None


def label(cxn: Connection) -> str:
    return f"{cxn.user}@{cxn.host}:{cxn.port}"


def _known_hosts_file(cxn: Connection) -> Path:
    configured = cxn.ssh_config.get("userknownhostsfile")
    first = configured.split()[0] if configured else "~/.ssh/known_hosts"
    return Path(os.path.expanduser(first))


def _pin(client: paramiko.SSHClient, cxn: Connection, public_key: str) -> None:
    try:
        kind, blob = public_key.split()[:2]
        key = paramiko.PKey.from_type_string(kind, base64.b64decode(blob))
    except (ValueError, paramiko.SSHException) as exc:
        raise LauncherError(
            f"the stack's ssh.host_public_key is not a public key ({exc}); rerun `make up`"
        ) from None
    name = cxn.host if cxn.port == 22 else f"[{cxn.host}]:{cxn.port}"
    client.get_host_keys().add(name, kind, key)


def _open(cxn: Connection, known_hosts: Path) -> None:
    where = label(cxn)
    try:
        cxn.open()
    except UnknownHostKey as exc:
        raise LauncherError(
            f"{where}: host key not known ({exc.key.get_name()} "
            f"{_sha256_fingerprint(exc.key)}), so the host cannot be verified. Check that "
            f"fingerprint with the host's owner (`ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub` on "
            f"the host), then add it to {known_hosts} (`ssh-keyscan -p {cxn.port} {cxn.host} >> "
            f"{known_hosts}`), or pass --accept-new-host-key once to record it"
        ) from None
    except paramiko.BadHostKeyException as exc:
        raise LauncherError(
            f"{where}: host key CHANGED: expected {_sha256_fingerprint(exc.expected_key)}, got "
            f"{_sha256_fingerprint(exc.key)}. Someone may be intercepting the connection, or the "
            f"host was reinstalled; if you know it was, remove the old key with `ssh-keygen -f "
            f"{known_hosts} -R '[{cxn.host}]:{cxn.port}'`"
        ) from None
    except paramiko.AuthenticationException as exc:
        raise LauncherError(
            f"{where}: SSH authentication failed ({exc}): is the user right and its "
            f"key in the host's authorized_keys? Pass the key with -i PATH"
        ) from None
    except TimeoutError:
        raise LauncherError(
            f"{where}: connection timed out: is the host up and the port right?"
        ) from None
    except paramiko.ssh_exception.NoValidConnectionsError as exc:
        raise LauncherError(
            f"{where}: cannot connect ({_first_error(exc)}): is sshd running there "
            f"and the port right (-H user@host:port)?"
        ) from None
    except socket.gaierror as exc:
        raise LauncherError(f"{where}: unknown host name ({exc.strerror})") from None
    except (paramiko.SSHException, OSError, EOFError) as exc:
        raise LauncherError(f"{where}: SSH failed: {exc or type(exc).__name__}") from None


def _sha256_fingerprint(key) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def _first_error(exc: paramiko.ssh_exception.NoValidConnectionsError) -> str:
    errors = list(exc.errors.values())
    return errors[0].strerror if errors and getattr(errors[0], "strerror", None) else str(exc)


# -- commands on a connection ---------------------------------------------------------------------
def q(value: str) -> str:
    return shlex.quote(str(value))


# The launcher's commands that make a run's folders on a host start with this: the SSH session's
# umask with clipforge.fsutil.RUN_UMASK added, as the run's own processes have it.
RESTRICT_UMASK = f'umask "$(printf %o $(( 0$(umask) | 0{RUN_UMASK:o} )))"'
# What a file sent over SFTP (made with the server's umask) loses: no more than group-readable.
RESTRICT_MODE = "g-wx,o-rwx"


def join(argv: Iterable[str]) -> str:
    return " ".join(q(a) for a in argv)


def run(cxn: Connection, command: str, *, what: str, **kwargs):
    """Run `command`; LauncherError naming `what` failed, with the tail of its output."""
    result = probe(cxn, command, **kwargs)
    if not result.ok:
        output = (result.stderr.strip() or result.stdout.strip()).splitlines()[-8:]
        raise LauncherError(
            f"{label(cxn)}: {what} failed (exit {result.exited}):\n  "
            + "\n  ".join(output or ["(no output)"])
        )
    return result


def probe(cxn: Connection, command: str, **kwargs):
    """Run `command` and return its result whatever its exit code."""
    kwargs.setdefault("hide", True)
    kwargs.setdefault("in_stream", False)
    return cxn.run(command, warn=True, **kwargs)
