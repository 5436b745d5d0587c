"""The recovery controller: moves a run off a lost host onto a spare, unattended.

Watches a run's hosts from a machine that is not one of them, and
moves the run to a spare when one is gone, with no one at the keyboard.

  fab -H a train --spare c [--controller d] ...       (laptop side: `open_recovery`, `start`)
  python -m clipforge.launcher.controller launch|run DIR      (on the controller's host)

The rule that says a host is gone, and the record of what was done, are the pure core
(clipforge.launcher.recovery); this is the shell around it: SSH probes, the clock, the files.
The move itself is `fab train --resume ID`'s (clipforge.launcher.launch.move): the launch as the
run store keeps it, started again on the spare under the same id, resuming from the store's
newest checkpoint. The controller runs that from a clone of the run's commit in its own
directory, `~/clipforge-controllers/<launch id>/` on its host (not under the run root: the run's
files are what a lost host takes with it).

What it needs on its host: the project's Python environment (`clipforge.python`, with the
launcher's dependencies), an SSH key there that the training hosts and spares authorize
(`--controller-key PATH`, default the path given with -i), and the run store's credentials and
alert webhooks, which `fab train` hands it over SSH's stdin like the supervisor's (never in a
file). Faults (CLIPFORGE_FAULTS) are not handed on: they belong to the launch that was given them.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import posixpath
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import paramiko
from fabric import Config, Connection
from invoke.exceptions import CommandTimedOut

from clipforge.alerts import events
from clipforge.errors import LauncherError, UserError
from clipforge.fsutil import atomic_write_text
from clipforge.launcher import connection
from clipforge.launcher import launch as launch_mod
from clipforge.launcher.connection import HostSpec, q, run, spec_of
from clipforge.launcher.host.alert import send_alert, send_run_failed
from clipforge.launcher.host.plan import PASSTHROUGH_ENV
from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.launcher.host.state import RunState, StateFileError, parse_state
from clipforge.launcher.host.supervisor import MODULE as SUPERVISOR_MODULE
from clipforge.launcher.options import TrainOptions
from clipforge.launcher.recovery import (
    RECOVERY_FILE,
    Action,
    ControllerState,
    Move,
    Probe,
    ProbeResult,
    RecoveryRecord,
    RecoveryRule,
    decide,
    store_record_path,
)
from clipforge.launcher.session import Host, Settings, open_host
from clipforge.launcher.source import write_bundle
from clipforge.store.remote import open_filesystem, read_launch
from clipforge.util import first_line

MODULE = "clipforge.launcher.controller"
CONTROLLERS_DIR = "clipforge-controllers"  # under the controller host's $HOME
START_TIMEOUT_SECONDS = 60.0
PROBE_TIMEOUT_SECONDS = 30.0  # an SSH connect, or the probe's command, taking longer is a miss
HISTORY_KEPT = 100  # probes kept per host: the rule looks at the last misses only
# Faults are injected into the launch they were given with; a run moved to a spare starts without.
CONTROLLER_ENV = tuple(name for name in PASSTHROUGH_ENV if name != "CLIPFORGE_FAULTS")


@dataclass(frozen=True, kw_only=True)
class ControllerPlan:
    """DIR/plan.json: everything the controller needs but its secrets."""

    launch_id: str
    store: str
    controller: str
    hosts: list[str]  # SSH targets user@host:port, in node order
    roots: list[str]  # the run root on each of them
    spares: list[str]
    key_filename: list[str]  # on the controller's host
    rule: dict
    settings: dict

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ControllerPlan:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Recovery:
    """What `fab train --spare` adds to a launch, checked before anything starts."""

    controller: Host
    spares: list[Host]
    key_filename: list[str]
    rule: RecoveryRule


# -- laptop side ---------------------------------------------------------------------------------
def parse_hosts(text: str, config: Config) -> list[HostSpec]:
    """`user@host[:port][,...]` as -H takes it (the ssh config applies)."""
    return [spec_of(Connection(item.strip(), config=config)) for item in text.split(",") if item]


def open_recovery(
    *,
    spare: str | None,
    controller: str | None,
    controller_key: str | None,
    max_moves: int,
    hosts: list[Host],
    from_stack: bool,
    options: TrainOptions,
    store: str | None,
    config: Config,
    settings: Settings,
    accept_new_host_key: bool,
) -> Recovery | None:
    """The spares and the controller's host, opened (so a typo fails before the run starts);
    None without --spare. LauncherError for what cannot work."""
    if not spare:
        if controller:
            raise LauncherError("--controller: needs --spare (where to move the run)")
        return None
    if from_stack:
        raise LauncherError(
            "--spare: for SSH hosts (-H); on the Kubernetes stack a lost node's worker is "
            "rescheduled by Kubernetes (docs/launcher.md, 'A box dies')"
        )
    if options.nodes > 1:
        raise LauncherError(
            "--spare: a multi-node run cannot move yet (its surviving nodes hold their part of "
            "the run); use it with --nodes 1"
        )
    if not store:
        raise LauncherError(
            "--spare: the run moves through its run store: set storage.remote (--set "
            "storage.remote=s3://...)"
        )
    rule = RecoveryRule(
        probe_every_seconds=settings.probe_every_seconds,
        gone_after_misses=settings.gone_after_misses,
        gone_after_seconds=settings.gone_after_seconds,
        max_moves=max_moves,
    )
    spares = [
        open_host(s, config, settings, None, accept_new_host_key)
        for s in parse_hosts(spare, config)
    ]
    chosen = (
        open_host(parse_hosts(controller, config)[0], config, settings, None, accept_new_host_key)
        if controller
        else spares[0]
    )
    training = {h.label for h in hosts}
    for host in spares:
        if host.label in training:
            raise LauncherError(f"--spare {host.label}: it is a training host (-H)")
    if chosen.label in training:
        raise LauncherError(
            f"--controller {chosen.label}: a training host; the controller must not be on a "
            "host it watches (it would die with it)"
        )
    key = controller_key or config.connect_kwargs.get("key_filename")
    if not key:
        raise LauncherError(
            "--controller-key PATH: the private key on the controller's host that reaches the "
            "training hosts and spares (default: the -i key's path)"
        )
    return Recovery(
        controller=chosen,
        spares=spares,
        key_filename=[key] if isinstance(key, str) else list(key),
        rule=rule,
    )


def start(
    recovery: Recovery,
    hosts: list[Host],
    launch_id: str,
    store: str,
    source,
    settings: Settings,
    say,
) -> None:
    """Ship the run's commit and the plan to the controller's host and start it, detached."""
    host = recovery.controller
    directory = run(
        host.cxn,
        f'mkdir -p "$HOME"/{CONTROLLERS_DIR}/{q(launch_id)} && '
        f'cd "$HOME"/{CONTROLLERS_DIR}/{q(launch_id)} && pwd -P',
        what="creating the controller's directory",
    ).stdout.strip()
    say(f"{host.label}: starting the recovery controller in {directory}")
    code = posixpath.join(directory, "code")
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "code.bundle"
        write_bundle(source, bundle)
        host.cxn.put(str(bundle), posixpath.join(directory, "code.bundle"))
        known = Path(tmp) / "known_hosts"
        keys = paramiko.HostKeys()
        for opened in (*hosts, *recovery.spares, host):
            for name, entry in opened.cxn.client.get_host_keys().items():
                for kind, key in entry.items():
                    keys.add(name, kind, key)
        keys.save(str(known))
        host.cxn.put(str(known), posixpath.join(directory, "known_hosts"))
    run(
        host.cxn,
        f"git clone --quiet {q(directory)}/code.bundle {q(code)} && "
        f"git -C {q(code)} -c advice.detachedHead=false checkout --quiet {q(source.commit)} && "
        f"rm {q(directory)}/code.bundle",
        what="cloning the run's commit for the controller",
    )
    plan = ControllerPlan(
        launch_id=launch_id,
        store=store,
        controller=host.label,
        hosts=[h.label for h in hosts],
        roots=[h.root for h in hosts],
        spares=[h.label for h in recovery.spares],
        key_filename=recovery.key_filename,
        rule=dataclasses.asdict(recovery.rule),
        settings={**dataclasses.asdict(settings), "stack_outputs": str(settings.stack_outputs)},
    )
    files = {
        "plan.json": plan.to_json(),
        # the controller's SSH: host keys as this machine knows them, nothing of its ssh config
        "ssh_config": f"Host *\n    UserKnownHostsFile {directory}/known_hosts\n",
    }
    for name, text in files.items():
        host.cxn.put(io.BytesIO(text.encode("utf-8")), posixpath.join(directory, name))
    secrets = {name: os.environ[name] for name in CONTROLLER_ENV if name in os.environ}
    bin_dir = posixpath.dirname(settings.python)
    path = f'PATH={q(bin_dir)}:"$PATH" ' if bin_dir else ""
    run(
        host.cxn,
        f"cd {q(directory)} && {path}PYTHONPATH={q(code)}/src {q(settings.python)} -m {MODULE} "
        f"launch {q(directory)}",
        what="starting the recovery controller",
        in_stream=io.StringIO(json.dumps(secrets)),
    )
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    record_path = posixpath.join(directory, RECOVERY_FILE)
    while time.monotonic() < deadline:
        result = connection.probe(host.cxn, f"cat {q(record_path)}")
        if result.ok and result.stdout.strip():
            say(
                f"recovery: the controller on {host.label} moves the run to "
                f"{', '.join(h.label for h in recovery.spares)} if "
                f"{', '.join(h.label for h in hosts)} is gone ({recovery.rule.gone_after_misses} "
                f"missed probes over {recovery.rule.gone_after_seconds:g} s), at most "
                f"{recovery.rule.max_moves} times"
            )
            return
        time.sleep(0.5)
    log = connection.probe(host.cxn, f"tail -n 20 {q(directory)}/controller.log").stdout
    raise LauncherError(f"{host.label}: the recovery controller did not start:\n{log}")


# -- on the controller's host --------------------------------------------------------------------
def _spec(label: str) -> HostSpec:
    user, _, rest = label.rpartition("@")
    host, _, port = rest.rpartition(":")
    return HostSpec(host=host, user=user or None, port=int(port))


class Controller:
    def __init__(self, directory: Path):
        self.directory = directory
        self.plan = ControllerPlan.from_json((directory / "plan.json").read_text(encoding="utf-8"))
        self.rule = RecoveryRule(**self.plan.rule)
        settings = dict(self.plan.settings)
        settings["stack_outputs"] = Path(settings["stack_outputs"])
        self.settings = Settings(**settings)
        self.config = Config(
            runtime_ssh_path=str(directory / "ssh_config"),
            overrides={
                "connect_kwargs": {
                    "key_filename": self.plan.key_filename,
                    "look_for_keys": False,
                    "allow_agent": False,
                },
                "timeouts": {"connect": PROBE_TIMEOUT_SECONDS},
            },
        )
        self.roots = dict(zip(self.plan.hosts, self.plan.roots))
        self.history: dict[str, list[Probe]] = {h: [] for h in self.plan.hosts}
        self.record = RecoveryRecord(
            launch_id=self.plan.launch_id,
            state=ControllerState.WATCHING,
            controller=self.plan.controller,
            hosts=list(self.plan.hosts),
            spares=list(self.plan.spares),
            max_moves=self.rule.max_moves,
            updated_at=time.time(),
        )
        self.signalled = False

    def log(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"=== clipforge controller {stamp}: {message} ===", flush=True)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self._publish(self.record)
        self.log(
            f"watching {', '.join(self.record.hosts)}; spares {', '.join(self.record.spares)}; "
            f"a host is gone after {self.rule.gone_after_misses} missed probes over "
            f"{self.rule.gone_after_seconds:g} s (one every {self.rule.probe_every_seconds:g} s)"
        )
        while not self.signalled:
            started = time.monotonic()
            for host in self.record.hosts:
                probe = self.probe(host)
                if probe.result is not ProbeResult.ANSWERED:
                    self.log(f"{host}: {probe.result} ({probe.detail or probe.state})")
                self.history[host] = [*self.history[host], probe][-HISTORY_KEPT:]
            decision = decide(
                {h: self.history[h] for h in self.record.hosts},
                self.record.spares,
                len(self.record.moves),
                self.rule,
            )
            if decision.action is Action.FINISH:
                state = (
                    ControllerState.FINISHED
                    if decision.state is RunState.FINISHED
                    else ControllerState.STOPPED
                )
                self.log(decision.reason)
                self._publish(self.record.changed(state=state, reason=decision.reason))
                return 0
            if decision.action is Action.FAIL:
                self._fail(decision.reason, alert=decision.host not in self._ended_failed())
                return 1
            if decision.action is Action.MOVE:
                assert decision.host and decision.to_host
                self._move(decision.host, decision.to_host, decision.reason)
                continue  # probe the run's new host at once
            self._sleep(self.rule.probe_every_seconds - (time.monotonic() - started))
        self.log("stopped (SIGTERM): the run is no longer watched")
        self._publish(self.record.changed(state=ControllerState.STOPPED, reason="SIGTERM"))
        return 0

    def _ended_failed(self) -> set[str]:
        """Hosts whose supervisor gave up: it sent the `run_failed` alert itself."""
        return {
            h
            for h, probes in self.history.items()
            if probes and probes[-1].state is RunState.FAILED
        }

    def _fail(self, reason: str, *, alert: bool) -> None:
        self.log(f"run_failed: {reason}")
        self._publish(self.record.changed(state=ControllerState.RUN_FAILED, reason=reason))
        if alert:
            self.log(
                send_run_failed(
                    f"run {self.plan.launch_id}: {reason}",
                    self.plan.launch_id,
                    self._training_run_id(),
                )
            )

    def _move(self, gone: str, spare: str, reason: str) -> None:
        attempt = len(self.record.moves) + 1
        self.log(f"{reason}: moving the run to {spare} (move {attempt} of {self.rule.max_moves})")
        self._publish(self.record.changed(state=ControllerState.MOVING))
        spares = [s for s in self.record.spares if s != spare]
        try:
            host = open_host(_spec(spare), self.config, self.settings, None, False)
            launch_mod.move(
                [host], self.plan.launch_id, self.plan.store, self.settings, None, self.log
            )
        except UserError as exc:  # the launcher's, a damaged record in the store, a bad image.env
            why = first_line(exc)
            self.log(f"the move to {spare} failed: {exc}")
            move = Move(gone, spare, time.time(), reason, outcome=f"failed: {why}")
            self._publish(
                self.record.changed(
                    state=ControllerState.WATCHING,
                    spares=spares,
                    moves=[*self.record.moves, move],
                )
            )
            send_alert(
                events.HOST_LOST,
                "critical",
                f"run {self.plan.launch_id}: {reason}; the move to {spare} failed: {why}",
                self.plan.launch_id,
                self._training_run_id(),
            )
            return
        self.roots[spare] = host.root
        self.history[spare] = []
        hosts = [spare if h == gone else h for h in self.record.hosts]
        move = Move(gone, spare, time.time(), reason)
        self._publish(
            self.record.changed(
                state=ControllerState.WATCHING,
                hosts=hosts,
                spares=spares,
                moves=[*self.record.moves, move],
            )
        )
        self.log(f"run {self.plan.launch_id} moved to {spare}")
        self.log(
            send_alert(
                events.HOST_LOST,
                "warning",
                f"run {self.plan.launch_id}: {reason}; moved to {spare} from the run store "
                f"(move {attempt} of {self.rule.max_moves})",
                self.plan.launch_id,
                self._training_run_id(),
            )
        )

    def _training_run_id(self) -> str | None:
        """The training run's id (run-<sha12>) for the alerts, as the run store's record of the
        launch names it; None when the store cannot tell (none yet, or unreachable)."""
        try:
            launch = read_launch(self.plan.store, self.plan.launch_id)
        except Exception as exc:  # any library's error: the alert goes out without it
            self.log(f"the run store did not say the training run's id: {first_line(exc)}")
            return None
        run_id = launch.get("training_run") if launch else None
        return run_id if isinstance(run_id, str) else None

    # -- probing -------------------------------------------------------------------------------
    def probe(self, label: str) -> Probe:
        """One probe of a training host: SSH, then its node's state and supervisor process."""
        layout = NodeLayout(
            root=self.roots[label],
            launch_id=self.plan.launch_id,
            node_rank=self.record.hosts.index(label),
        )
        marker = "@@clipforge-supervisor-alive="
        command = (
            f"cat {q(layout.state)} 2>/dev/null; echo; printf %s {marker}; "
            f"tr '\\0' ' ' < /proc/$(cat {q(layout.pid_file)} 2>/dev/null)/cmdline 2>/dev/null "
            f"| grep -c {q(SUPERVISOR_MODULE)}"
        )
        try:
            cxn = connection.connect(_spec(label), self.config, accept_new_host_key=False)
        except LauncherError as exc:
            return Probe(time.monotonic(), ProbeResult.MISSED, f"ssh: {first_line(exc)}")
        try:
            result = connection.probe(cxn, command, timeout=PROBE_TIMEOUT_SECONDS)
        except (CommandTimedOut, paramiko.SSHException, OSError, EOFError) as exc:
            return Probe(time.monotonic(), ProbeResult.MISSED, f"ssh: {first_line(exc)}")
        finally:
            cxn.close()
        at = time.monotonic()
        text, found, alive = result.stdout.rpartition(marker)
        if not found:
            return Probe(at, ProbeResult.MISSED, f"the probe's command failed: {result.stderr}")
        if not text.strip():
            return Probe(at, ProbeResult.MISSED, f"no supervisor state at {layout.state}")
        try:
            state = parse_state(text, f"{label}:{layout.state}")
        except StateFileError as exc:
            return Probe(at, ProbeResult.MISSED, str(exc))
        if state.state.terminal:
            return Probe(at, ProbeResult.ENDED, state.reason or "", state.state)
        if alive.strip() in ("", "0"):
            return Probe(
                at, ProbeResult.MISSED, f"its supervisor is not running (state {state.state})",
                state.state,
            )  # fmt: skip
        return Probe(at, ProbeResult.ANSWERED, state=state.state)

    # -- the record ----------------------------------------------------------------------------
    def _publish(self, record: RecoveryRecord) -> None:
        """The record here, in the run store, and in the run directory of the run's hosts."""
        self.record = record
        text = record.to_json()
        atomic_write_text(self.directory / RECOVERY_FILE, text)
        try:
            fs, root = open_filesystem(self.plan.store)
            fs.pipe_file(
                posixpath.join(root, store_record_path(self.plan.launch_id)), text.encode()
            )
        except Exception as exc:  # any library's error: the store may be down for a while
            self.log(f"the run store did not take the record: {first_line(exc)}")
        for label in record.hosts:
            if self.history.get(label) and self.history[label][-1].result is ProbeResult.MISSED:
                continue  # a host that does not answer: no need to wait for its time-out
            run_dir = NodeLayout(self.roots[label], record.launch_id, 0).run_dir
            try:
                cxn = connection.connect(_spec(label), self.config, accept_new_host_key=False)
                try:
                    cxn.put(
                        io.BytesIO(text.encode("utf-8")), posixpath.join(run_dir, RECOVERY_FILE)
                    )
                finally:
                    cxn.close()
            except (LauncherError, paramiko.SSHException, OSError, EOFError) as exc:
                self.log(f"{label}: the record was not written there: {first_line(exc)}")

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + max(seconds, 0.0)
        while not self.signalled and time.monotonic() < deadline:
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True


# -- commands ------------------------------------------------------------------------------------
def launch(directory: Path) -> int:
    """Start `run` detached; secrets arrive as a JSON object on stdin (never argv or a file)."""
    secrets = json.loads(sys.stdin.read() or "{}")
    unknown = sorted(set(secrets) - set(CONTROLLER_ENV))
    if unknown:
        print(f"refusing to pass unknown environment variables: {unknown}", file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k not in PASSTHROUGH_ENV}
    with open(directory / "controller.log", "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", MODULE, "run", str(directory)],
            cwd=directory / "code",  # the move ships the run's commit from this clone
            env={**env, **secrets},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    atomic_write_text(directory / "controller.pid", f"{process.pid}\n")
    print(json.dumps({"controller_pid": process.pid}))
    return 0


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("command", choices=("launch", "run"))
    parser.add_argument("directory", type=Path, metavar="DIR")
    args = parser.parse_args(argv)
    directory = args.directory.resolve()
    if args.command == "launch":
        return launch(directory)
    sys.stdout = os.fdopen(sys.stdout.fileno(), "w", buffering=1)
    return Controller(directory).run()


if __name__ == "__main__":
    raise SystemExit(main())
