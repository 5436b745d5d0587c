"""Keeps one node's run going, detached from the SSH session that started it.

  python -m clipforge.launcher.host.supervisor launch|run|stop NODE_DIR

  launch  start a detached supervisor under its keeper (secrets on stdin)
  run     the supervisor itself (what the keeper starts)
  stop    ask it to stop the run gracefully

NODE_DIR is <root>/runs/<run>/node-<rank>, as clipforge.launcher.host.run_dirs lays it out.

The supervisor runs the phases of NODE_DIR/plan.json in order. A phase that exits non-zero (a
crash, a GPU falling off the bus, an OOM kill) is started again after a back-off delay, up to
`max_restarts` restarts in all; the train stage resumes from its latest checkpoint by itself, so a
restart is just the same command again. Exit 0 moves on; a stop request (the `stop` file, or
SIGTERM/SIGINT to the supervisor) asks the phase to checkpoint and exit and restarts nothing.
Two attempts in a row that end on the same rendezvous error (the nodes cannot connect: a wrong
address, a link down, a firewall) are a fault no restart fixes: the supervisor gives up at once.
A phase that failed on a fault its stage recorded as one that repeats the same way (a full disk,
a permission, a refused input, a software stack that cannot run it: clipforge.fault_record) is
not restarted at all: the supervisor gives up at once with the stage's line, and the run's last
step when the stage knew it, in its state (`fab status`).
Whenever it gives up, it says why in the log and sends a `run_failed` alert to the webhooks.

Before each attempt it counts the node's GPUs (clipforge.launcher.host.gpus): with some gone
the attempt runs on fewer ranks, keeping the global batch. The nodes of a multi-node run must
all run the same number, so before each attempt of their train phase every node writes its
count to the run's shared storage and node 0's supervisor, where the process group meets,
decides for all (`_agreed`); the others wait for that decision.

A hang is a crash. Every rank writes a heartbeat (clipforge.progress) into
NODE_DIR/progress; a rank silent for its `alerts.stall_timeout_seconds` makes the supervisor
dump the stacks of every rank into the run's log (py-spy when installed, else each rank's
faulthandler on SIGUSR1), send a `hang` alert, and kill the attempt: the restart resumes from
the latest checkpoint like any other. NCCL's own watchdog and flight recorder are switched on
for the ranks too (TORCH_NCCL_* below), dumping into the same folder on a collective timeout.

The supervisor is supervised: `launch` starts its keeper (clipforge.launcher.host.keeper), a
parent that only waits and starts a new supervisor when one dies without finishing (SIGKILL, the
OOM killer). A supervisor started on a node whose state names an attempt that still runs (its
process recognised by its environment, clipforge.launcher.host.processes), or one its keeper saw
end, adopts it: it watches it where it stands (hangs, stop requests), takes its exit status from
the keeper, and goes on from there; the phases before it are done. It never starts an attempt
beside a live one, so a `fab train --resume` of a run whose supervisor is gone adopts its trainer
too, rather than racing it for the run folder and DVC's lock.

Detached = a new session (setsid) with no terminal and stdin/stdout away from the SSH channel, so
closing the connection sends it nothing. It makes itself a child subreaper, so processes orphaned
by a crashed attempt (ranks, loader workers) are reaped here even where PID 1 does not reap (a
container running `sleep infinity`), and an attempt is over only when its whole process group is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from clipforge.alerts import events
from clipforge.alerts.config import AlertsConfig
from clipforge.fault_record import FAULT_RECORD_ENV, clear_fault, read_fault
from clipforge.fsutil import atomic_write_text, restrict_umask
from clipforge.ids import run_ids_in
from clipforge.launcher.host.alert import send_alert, send_run_failed
from clipforge.launcher.host.gpus import (
    Agreement,
    GpuDecision,
    GpuRecordError,
    GpuReport,
    Inventory,
    attempt_argv,
    attempt_env,
    decide,
    default_min_gpus,
    judge,
    read_decision,
    read_inventory,
    read_report,
    spanning_attempt_argv,
)
from clipforge.launcher.host.plan import PASSTHROUGH_ENV, Phase, PhasePlan
from clipforge.launcher.host.processes import (
    KEEPER_MODULE,
    SUPERVISOR_MODULE,
    attempt_end,
    attempt_running,
    become_subreaper,
    group_alive,
    keeper_pid,
    reaped_code,
    supervisor_pid,
)
from clipforge.launcher.host.record import RunRecord, RunRecordError, read_record
from clipforge.launcher.host.run_dirs import NodeLayout, node_dir_argument
from clipforge.launcher.host.state import (
    TERMINAL_STATES,  # noqa: F401  (re-exported: readers of the state import it from here)
    RunState,
    StateFileError,
    SupervisorState,
    read_state,
)
from clipforge.progress import (
    JOINING_PROCESS_GROUP,
    PROGRESS_DIR_ENV,
    STACK_DUMP_SIGNAL,
    Hang,
    collective_timeout_seconds,
    find_hang,
    read_progress,
)

MODULE = SUPERVISOR_MODULE  # as `python -m` runs it: how its process is found
POLL_SECONDS = 0.5
REMNANT_GRACE_SECONDS = 30.0  # after an attempt ended, leftovers get this long before SIGKILL
MAX_EXITS_KEPT = 50
# Errors of setting up the process group across nodes (torch.distributed's store, gloo, NCCL
# bootstrap): the same one twice in a row means the next restart would meet it again.
RENDEZVOUS_ERRORS = re.compile(
    r"[^\n]*(?:Gloo connectFullMesh failed|DistNetworkError|DistStoreError|"
    r"failed to connect to|timed out connecting|Timed out waiting for clients|"
    r"Socket Timeout|No route to host|Network is unreachable)[^\n]*"
)
LIVE_EXIT = 3  # `launch` on a node whose supervisor or keeper runs: refused, naming it
OUTPUT_SCANNED_BYTES = 256 * 1024  # of an attempt's output, the end: where its fatal error is
# How long one rank's stack dump may take before the next (and then the kill).
STACK_DUMP_MAX_SECONDS = 30.0
STACK_DUMP_SETTLE_SECONDS = 0.2
_FAULTHANDLER_HEADER = re.compile(
    rb"(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):"
)


# NCCL's watchdog and flight recorder (torch >= 2.2): on a collective timeout each rank dumps its
# last collectives there. Inert under gloo (CPU). A value already in the environment wins.
def nccl_debug_env(progress_dir: str) -> dict[str, str]:
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(progress_dir, "nccl_trace_rank_"),
    }


def read_json(path: str | Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def rendezvous_error(output: str) -> tuple[str, str] | None:
    """The last rendezvous error line of an attempt's output, and its signature (digits blanked:
    ports and pids differ between attempts, the fault does not); None when there is none."""
    lines = RENDEZVOUS_ERRORS.findall(output)
    if not lines:
        return None
    line = lines[-1].strip()
    return re.sub(r"\d+", "#", line), line


def stall_timeout_of(record: RunRecord | None) -> float:
    """The run's alerts.stall_timeout_seconds, from the params of its record (else the default):
    the watchdog's budget for a beat that names none (the eval stage's)."""
    alerts = record.params.get("alerts") if record else None
    stall = (alerts if isinstance(alerts, dict) else {}).get("stall_timeout_seconds")
    try:
        return float(stall) if stall is not None else AlertsConfig().stall_timeout_seconds
    except (TypeError, ValueError):
        return AlertsConfig().stall_timeout_seconds


class Supervisor:
    def __init__(self, layout: NodeLayout):
        self.layout = layout
        self.plan = PhasePlan.from_json(Path(layout.plan).read_text(encoding="utf-8"))
        self.signalled = False
        self._damaged_previous = None
        try:
            previous = read_state(layout.state)
        except StateFileError as exc:  # said in the log once the run's log is open
            previous, self._damaged_previous = None, str(exc)
        # A supervisor started again on the same node (`fab train --resume`) keeps the count.
        self.state = SupervisorState(
            state=RunState.STARTING,
            supervisor_pid=os.getpid(),
            started_at=previous.started_at if previous else time.time(),
            max_restarts=self.plan.policy.max_restarts,
            restarts=previous.restarts if previous else 0,
            exits=previous.exits if previous else [],
            # the GPUs the last attempt ran on: a change (one lost, or back) is said once
            gpus=previous.gpus if previous else None,
            passed_env=sorted(name for name in PASSTHROUGH_ENV if name in os.environ),
        )
        # A live attempt a dead supervisor of this node left, or the status it ended with: taken
        # over where it stands, never raced by a second attempt (clipforge.launcher.host.keeper).
        self._adopted = previous if _adoptable(previous, self.plan, layout) else None
        if self._adopted is not None:  # named in the state from the first write: a supervisor
            # killed before it adopted leaves the attempt to its successor just the same
            self.state = dataclasses.replace(
                self.state,
                state=RunState.RUNNING,
                phase=self._adopted.phase,
                attempt=self._adopted.attempt,
                child_pid=self._adopted.child_pid,
                attempt_started_at=self._adopted.attempt_started_at,
            )
        self._child_status: int | None = None
        self._hang: Hang | None = None  # the current attempt's, when the watchdog found one
        self._attempt_log_start = 0  # where the current attempt's output begins in train.log

    # -- state -------------------------------------------------------------------------------
    def _set(self, **changes) -> None:
        self.state = dataclasses.replace(self.state, **changes, updated_at=time.time())
        atomic_write_text(self.layout.state, self.state.to_json())

    def _log(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        line = f"=== clipforge supervisor {stamp}: {message} ==="
        print(line, flush=True)  # supervisor.log
        with open(self.layout.train_log, "a", encoding="utf-8") as log:  # and the run's own log
            log.write(line + "\n")

    def stop_requested(self) -> bool:
        return self.signalled or os.path.exists(self.layout.stop_request)

    # -- main loop ---------------------------------------------------------------------------
    def run(self) -> int:
        become_subreaper()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        atomic_write_text(self.layout.pid_file, f"{os.getpid()}\n")
        if self._damaged_previous:
            self._log(
                f"the previous state is unreadable ({self._damaged_previous}); restarts count from 0"
            )
        self._set(state=self.state.state)  # starting, or running the adopted attempt
        phases, adopted = self.plan.phases, self._adopted
        if adopted is not None:  # the phases before the adopted one are done
            phases = phases[[p.name for p in phases].index(str(adopted.phase)) :]
        for i, phase in enumerate(phases):
            outcome = self._run_phase(phase, adopted if i == 0 else None)
            if outcome != "done":
                return 0 if outcome == "stopped" else 1
        self._log("all phases finished")
        self._set(state=RunState.FINISHED, child_pid=None, finished_at=time.time())
        return 0

    def _run_phase(self, phase: Phase, adopted: SupervisorState | None = None) -> str:
        """`adopted`: the state a dead supervisor left, whose attempt of this phase is the first."""
        attempt = 0
        last_rendezvous_error = None
        while True:
            if adopted is not None:
                attempt = adopted.attempt
                code = self._adopt(phase, adopted)
                adopted = None
            else:
                if self.stop_requested():
                    return self._stopped()
                attempt += 1
                lost, this_attempt = self._gpus_for_attempt(phase)
                if lost:
                    return self._give_up(phase, None, lost)
                if self.stop_requested():  # while the nodes agreed on their GPUs
                    return self._stopped()
                code = self._attempt(this_attempt, attempt)
            if self.state.state is RunState.STOPPING:
                return self._stopped()
            if code == 0 and self._hang is None:  # a hung attempt failed, whatever its exit
                return "done"
            exit_record = {"phase": phase.name, "attempt": attempt, "code": code, "at": time.time()}
            if self._hang is not None:
                exit_record["hang"] = self._hang.describe()
            fault = read_fault(self.layout.fault_record) if self._hang is None else None
            if fault is not None:
                exit_record["fault"] = fault.kind
            exits = (self.state.exits + [exit_record])[-MAX_EXITS_KEPT:]
            self._set(exits=exits)
            if fault is not None:  # the stage's own line; a restart would meet it again
                why = f"{fault.cause} (not restarted: it would fail the same way)"
                return self._give_up(phase, code, why, fault.step)
            restarts = self.state.restarts
            rendezvous = self._rendezvous_failure()
            if rendezvous and last_rendezvous_error == rendezvous[0]:
                return self._give_up(
                    phase,
                    code,
                    f"the same rendezvous error twice in a row: {rendezvous[1][:300]}; "
                    f"a restart cannot fix it: check that every node reaches the master "
                    f"(`fab check`, the network rows of `fab train`), then resume the run",
                )
            last_rendezvous_error = rendezvous[0] if rendezvous else None
            if not phase.restartable or restarts >= self.plan.policy.max_restarts:
                why = (
                    "not restartable"
                    if not phase.restartable
                    else f"{restarts} restarts used of {self.plan.policy.max_restarts}"
                )
                return self._give_up(phase, code, why)
            delay = self.plan.policy.delay_before(restarts + 1)
            how = "hung and was killed" if self._hang else f"exited with {_describe(code)}"
            self._log(
                f"phase {phase.name} {how}; restart "
                f"{restarts + 1}/{self.plan.policy.max_restarts} in {delay:g}s, from the "
                f"latest checkpoint"
            )
            self._set(state=RunState.BACKOFF, restarts=restarts + 1, child_pid=None)
            if not self._sleep(delay):
                return self._stopped()

    def _rendezvous_failure(self) -> tuple[str, str] | None:
        """This attempt's rendezvous failure (signature, line): an error in its output, or a hang
        while joining the process group (a peer or master it cannot reach: a link cut before
        torch's own timeout says so)."""
        if self._hang is not None and self._hang.in_rendezvous():
            return f"hung {JOINING_PROCESS_GROUP}", self._hang.describe()
        return rendezvous_error(self._attempt_output())

    def _gpus_for_attempt(self, phase: Phase) -> tuple[str | None, Phase]:
        """Before an attempt of a restartable phase: why it cannot run on the GPUs left (a
        `gpu_lost` alert is sent), or None and the phase as this attempt runs it: on fewer
        ranks when GPUs are gone (a `gpu_lost` alert when that is new), on all of them again
        once they are back. Unchanged when they are all there or nothing can tell. A phase
        spanning the nodes runs the ranks they agreed on (`_agreed`); a stop requested while
        waiting for that returns the phase unchanged (the caller then stops)."""
        if not phase.restartable:
            return None, phase
        try:
            record = read_record(self.layout.record)
        except RunRecordError as exc:  # the run goes on; the GPU check cannot
            self._log(f"no GPU check: {exc}")
            record = None
        planned = record.gpus_per_node if record else 0
        inventory = read_inventory(self.layout.node_dir, planned)
        spans = phase.spans_nodes and record is not None and record.num_nodes > 1 and planned > 0
        if spans and inventory is None:
            # The peers wait for every node's count: one that cannot tell counts as whole.
            inventory = Inventory(tuple(range(planned)), "nothing can tell: no nvidia-smi")
        if record is None or inventory is None or planned == 0:
            return None, phase
        min_gpus = self.plan.policy.min_gpus or default_min_gpus(planned)
        if record.num_nodes > 1 and not spans:
            # A multi-node run's GPU story (state, alerts, `fab status`) is its train phase's,
            # which every node runs together; a phase of this node alone (the data stage, node
            # 0's eval) just runs on the GPUs that answer, or gives up below --min-gpus.
            alone = judge(planned, inventory, min_gpus)
            if alone.lost:
                self._log(f"node {self.layout.node_rank}: phase {phase.name}: {alone.message}")
            if not alone.can_continue:
                return alone.message, phase
            return None, self._on_devices(phase, alone.ranks, alone.devices, planned, None)
        unseen = [
            r
            for r in range(record.num_nodes if spans else 0)
            if not os.path.isfile(self.layout.of_node(r).plan)
        ]
        decision, agreed = None, None
        if unseen:
            # Without the run root on shared storage the nodes cannot meet to agree (and their
            # checkpoints could not be resumed either): run as planned, or stop saying why.
            if not judge(planned, inventory, min_gpus).lost:
                return None, phase
            agreed = Agreement(
                0,
                f"the run root is not shared between the nodes (no "
                f"{self.layout.of_node(unseen[0]).plan} here), so they cannot agree on fewer "
                f"ranks each",
            )
        elif spans:
            decision = self._agreed(record, inventory, min_gpus)
            if decision is None:
                return None, phase  # stopped while waiting
            agreed = decision.agreement
        verdict = judge(planned, inventory, min_gpus, agreed)
        before = self.state.gpus or {}
        last = int(before.get("ranks") or planned)  # the last attempt's ranks
        # what the ranks were before their last change (`fab status`: 2 -> 1 while it lasts)
        ranks_before = last if last != verdict.ranks else int(before.get("ranks_before") or last)
        gpus = {
            "planned": planned,
            "usable": list(inventory.usable),
            "lost": list(verdict.lost),
            "source": inventory.source,
            "min_gpus": min_gpus,
            "ranks": verdict.ranks,
            "devices": list(verdict.devices),
            "ranks_before": ranks_before,
            "message": verdict.message,
        }
        if decision is not None:  # every node's GPUs, as the decision took them (`fab status`)
            gpus["nodes"] = {
                rank: {"host": decision.hosts.get(rank, ""), "usable": usable}
                for rank, usable in sorted(decision.usable.items(), key=lambda kv: int(kv[0]))
            }
        self._set(gpus=gpus)
        host = socket.gethostname()
        message = (
            f"node {self.layout.node_rank} ({host}): {verdict.message} "
            f"(ranks {last} -> {verdict.ranks})"
        )
        lost_changed = list(verdict.lost) != before.get("lost", [])  # lost now, or back
        if lost_changed or verdict.ranks != last or not verdict.can_continue:
            self._log(message)
        # The node whose GPU is gone says so; the others of a multi-node run only log it.
        if verdict.lost and (lost_changed or not verdict.can_continue):
            severity = "warning" if verdict.can_continue else "critical"
            self._log(
                send_alert(
                    events.GPU_LOST,
                    severity,
                    message,
                    self.layout.launch_id,
                    self._training_run_id(),
                )
            )
        if not verdict.can_continue:
            return verdict.message, phase
        nodes = record.num_nodes if spans else None
        return None, self._on_devices(phase, verdict.ranks, verdict.devices, planned, nodes)

    def _on_devices(
        self, phase: Phase, ranks: int, devices: tuple[int, ...], planned: int, nodes: int | None
    ) -> Phase:
        """The phase as an attempt on `ranks` ranks on `devices` runs it (as planned: itself);
        `nodes`: a phase spanning that many nodes, whose DeepSpeed launchers are told."""
        if ranks == planned:
            return phase
        argv = (
            spanning_attempt_argv(phase.argv, ranks, devices, self.layout.node_rank, nodes)
            if nodes
            else attempt_argv(phase.argv, ranks, devices)
        )
        return dataclasses.replace(
            phase, argv=argv, env={**phase.env, **attempt_env(ranks, devices)}
        )

    def _agreed(self, record: RunRecord, inventory: Inventory, min_gpus: int) -> GpuDecision | None:
        """The ranks per node every node runs in its next attempt of the phase that spans them
        (None: a stop was requested meanwhile).

        This node writes its usable GPUs to the run's shared storage (its report, numbered);
        node 0's supervisor waits until every node has reported since its last decision, since
        every node's attempt ends when one node's does, applies `gpus.agree`, and writes its
        decision, for which every other node waits (it names the report it took from each).
        A node silent for longer than a collective waits for a peer, plus a back-off (a node
        cut off, a supervisor that gave up) is decided on its last report, or by each node on
        the reports there are: the attempt then fails at the rendezvous as it would have."""
        rank, nodes, planned = self.layout.node_rank, record.num_nodes, record.gpus_per_node
        previous = self._gpu_record(read_report, self.layout.gpu_report())
        report = GpuReport(
            node_rank=rank,
            host=socket.gethostname(),
            seq=(previous.seq if previous else 0) + 1,
            usable=inventory.usable,
            source=inventory.source,
            at=time.time(),
        )
        os.makedirs(os.path.dirname(self.layout.gpu_report()), exist_ok=True)
        atomic_write_text(self.layout.gpu_report(), report.to_json())
        last = self._gpu_record(read_decision, self.layout.gpu_decision) if rank == 0 else None
        timeout = (
            collective_timeout_seconds(
                stall_timeout_of(record), {PROGRESS_DIR_ENV: self.layout.progress_dir}
            )
            + self.plan.policy.backoff_max_seconds
        )
        deadline = time.monotonic() + timeout
        waiting_said = False
        while True:
            reports = {
                r: self._gpu_record(read_report, self.layout.gpu_report(r)) for r in range(nodes)
            }
            if rank == 0:
                seen = last.seen if last else {}
                if all(p is not None and p.seq > seen.get(str(r), 0) for r, p in reports.items()):
                    decision = decide(planned, {r: p for r, p in reports.items() if p}, min_gpus)
                    atomic_write_text(self.layout.gpu_decision, decision.to_json())
                    return decision
            else:
                decision = self._gpu_record(read_decision, self.layout.gpu_decision)
                if decision is not None and decision.seen.get(str(rank), 0) >= report.seq:
                    return decision
            if self.stop_requested():
                return None
            if time.monotonic() > deadline:
                known = {r: p for r, p in reports.items() if p is not None}
                self._log(
                    f"no GPU decision of every node within {timeout:g}s: deciding on the "
                    f"reports there are, of node(s) {', '.join(map(str, sorted(known)))}"
                )
                return decide(planned, known, min_gpus)
            if not waiting_said:
                whom = "every node's GPU count" if rank == 0 else "node 0's GPU decision"
                self._log(f"waiting for {whom} before the next attempt")
                waiting_said = True
            self._reap()
            time.sleep(POLL_SECONDS)

    def _gpu_record(self, read, path: str):
        """A GPU report or decision; a damaged one (a torn write on shared storage) is said in
        the log and counts as none yet: it is written again before the next attempt."""
        try:
            return read(path)
        except GpuRecordError as exc:
            self._log(f"{exc}; taken as not written yet")
            return None

    def _record_or_none(self) -> RunRecord | None:
        try:
            return read_record(self.layout.record)
        except RunRecordError:
            return None

    def _give_up(
        self, phase: Phase, code: int | None, why: str, last_step: int | None = None
    ) -> str:
        """`last_step`: the run's last step, when the failed stage said it (its fault record)."""
        ended = "cannot start" if code is None else f"exited with {_describe(code)}"
        message = f"node {self.layout.node_rank}: phase {phase.name} {ended}; giving up ({why})"
        self._log(message)
        self._set(
            state=RunState.FAILED,
            child_pid=None,
            finished_at=time.time(),
            reason=why,
            last_step=last_step,
        )
        self._log(send_run_failed(message, self.layout.launch_id, self._training_run_id()))
        return "failed"

    def _training_run_id(self) -> str | None:
        """The run id of the training run this launch ran, from its checkpoints (none: None)."""
        found = {
            *run_ids_in(self.layout.output("checkpoints")),
            *run_ids_in(self.layout.shared_checkpoints),
        }
        return found.pop() if len(found) == 1 else None

    def _attempt_output(self) -> str:
        with open(self.layout.train_log, "rb") as log:
            log.seek(
                max(
                    self._attempt_log_start,
                    os.path.getsize(self.layout.train_log) - OUTPUT_SCANNED_BYTES,
                )
            )
            return log.read().decode("utf-8", errors="replace")

    def _stopped(self) -> str:
        self._log("stopped on request")
        self._set(state=RunState.STOPPED, child_pid=None, finished_at=time.time())
        return "stopped"

    def _attempt(self, phase: Phase, attempt: int) -> int:
        """Run the phase once; its exit code (negative: killed by that signal)."""
        if phase.cleanup_argv:
            subprocess.run(
                phase.cleanup_argv,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=False,
            )
        self._log(f"phase {phase.name} attempt {attempt}: {' '.join(phase.argv)}")
        self._attempt_log_start = os.path.getsize(self.layout.train_log)
        shutil.rmtree(self.layout.progress_dir, ignore_errors=True)  # the last attempt's beats
        shutil.rmtree(self.layout.reaped_dir, ignore_errors=True)  # an adopted one's status
        os.makedirs(self.layout.progress_dir, exist_ok=True)
        clear_fault(self.layout.fault_record)
        env = {
            **nccl_debug_env(self.layout.progress_dir),
            **os.environ,
            PROGRESS_DIR_ENV: self.layout.progress_dir,
            FAULT_RECORD_ENV: self.layout.fault_record,
            **phase.env,
        }
        self._child_status = None
        self._hang = None
        with open(self.layout.train_log, "ab") as log:
            child = subprocess.Popen(
                phase.argv,
                cwd=phase.cwd,
                env=env,
                stdin=subprocess.PIPE if phase.stdin_env else subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if phase.stdin_env and child.stdin is not None:
            values = "".join(f"{os.environ.get(name, '')}\n" for name in phase.stdin_env)
            try:
                child.stdin.write(values.encode())
                child.stdin.close()
            except BrokenPipeError:  # the command died at once; its exit code tells
                pass
        self._set(
            state=RunState.RUNNING,
            phase=phase.name,
            attempt=attempt,
            child_pid=child.pid,
            attempt_started_at=time.time(),
        )

        def ended() -> int | None:
            self._reap(child.pid)
            return None if self._child_status is None else _exit_code(self._child_status)

        # a new session: the child leads its own process group
        code = self._watch(phase, child.pid, time.time(), ended)
        child.returncode = code  # reaped here, not by Popen
        return code

    def _adopt(self, phase: Phase, previous: SupervisorState) -> int:
        """Watch the attempt a dead supervisor left, as if it were this one's; its exit code."""
        pid = previous.child_pid
        assert pid is not None  # _adoptable
        self._log(
            f"phase {phase.name} attempt {previous.attempt} (pid {pid}) adopted: supervisor pid "
            f"{previous.supervisor_pid} is gone, its attempt "
            f"{'runs on' if attempt_running(pid, self.layout) else 'has ended'}"
        )
        self._hang = None
        started = previous.attempt_started_at or time.time()
        self._set(
            state=RunState.RUNNING,
            phase=phase.name,
            attempt=previous.attempt,
            child_pid=pid,
            attempt_started_at=started,
        )

        def ended() -> int | None:
            self._reap()
            end = attempt_end(pid, self.layout)
            if end is None or end.code is not None:
                return None if end is None else end.code
            self._log(f"the adopted attempt (pid {pid}) ended with no status recorded: a failure")
            return 1

        return self._watch(phase, pid, started, ended)

    def _watch(self, phase: Phase, group: int, attempt_started: float, ended) -> int:
        """Until the attempt leading process group `group` has ended (`ended()`: its exit code,
        None before): its hangs handled, a stop request passed on; then its leftovers ended."""
        stop_deadline = None
        stall = stall_timeout_of(self._record_or_none())
        while (code := ended()) is None:
            if stop_deadline is None and self._hang is None:
                hang = find_hang(
                    read_progress(self.layout.progress_dir), time.time(), attempt_started, stall
                )
                if hang is not None:
                    self._handle_hang(hang, group)
            if stop_deadline is None and self.stop_requested():
                self._log(f"stop requested: asking phase {phase.name} to checkpoint and exit")
                self._set(state=RunState.STOPPING)
                self._ask_to_stop(phase, group)
                stop_deadline = time.monotonic() + self.plan.policy.stop_timeout_seconds
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                self._log("stop timeout: killing what is left")
                _signal_group(group, signal.SIGKILL)
                stop_deadline = float("inf")
            time.sleep(POLL_SECONDS)
        # Ranks and loader workers of the attempt may outlive its leader: a crashed attempt's are
        # killed now (they hold GPUs); after a stop they get time to finish writing the checkpoint.
        if self.state.state is RunState.STOPPING:
            self._wait_group_gone(group, self.plan.policy.stop_timeout_seconds)
        else:
            _signal_group(group, signal.SIGKILL)
        self._wait_group_gone(group, REMNANT_GRACE_SECONDS)
        if code != 0 and phase.cleanup_argv:
            subprocess.run(
                phase.cleanup_argv,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=False,
            )
        return code

    def _handle_hang(self, hang: Hang, group: int) -> None:
        """Stacks of every rank into the log, an alert, then the attempt is killed (a crash)."""
        self._hang = hang
        message = f"node {self.layout.node_rank}: {hang.describe()}"
        self._log(f"{message}; dumping the stacks of every rank, then restarting")
        # Frozen first: a rank woken for its dump must not carry the run on (a collective with
        # a peer that is stopped cannot complete), nor write a checkpoint the kill would tear.
        _signal_group(group, signal.SIGSTOP)
        self._dump_stacks(hang, group)
        self._log(
            send_alert(
                events.HANG, "critical", message, self.layout.launch_id, self._training_run_id()
            )
        )
        _signal_group(group, signal.SIGKILL)

    def _dump_stacks(self, hang: Hang, group: int) -> None:
        py_spy = shutil.which("py-spy")
        for rank in hang.everyone:
            if not _in_group(rank.pid, group):  # never signal a pid this attempt does not own
                self._log(f"rank {rank.rank}: pid {rank.pid} is not of this attempt; no dump")
                continue
            self._log(f"stacks of rank {rank.rank} (pid {rank.pid})")
            if py_spy:
                with open(self.layout.train_log, "ab") as log:
                    done = subprocess.run(
                        [py_spy, "dump", "--nonblocking", "--pid", str(rank.pid)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        timeout=STACK_DUMP_MAX_SECONDS,
                        check=False,
                    )
                if done.returncode == 0:
                    continue
            # faulthandler (registered by every supervised rank) writes to the rank's stderr,
            # the run's log, from its C handler: the rank is woken for it, then frozen again.
            offset = os.path.getsize(self.layout.train_log)
            try:
                os.kill(rank.pid, STACK_DUMP_SIGNAL)
                os.kill(rank.pid, signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                continue
            self._wait_for_dump(offset)
            try:
                os.kill(rank.pid, signal.SIGSTOP)
            except (ProcessLookupError, PermissionError):
                pass

    def _wait_for_dump(self, offset: int) -> None:
        """Until faulthandler's header shows in the log after `offset` (it writes the whole dump
        at once, from its handler), plus a moment for the rest; at most STACK_DUMP_MAX_SECONDS.
        Not "until the log is quiet": a woken rank may go on logging."""
        deadline = time.monotonic() + STACK_DUMP_MAX_SECONDS
        while time.monotonic() < deadline:
            with open(self.layout.train_log, "rb") as log:
                log.seek(offset)
                if _FAULTHANDLER_HEADER.search(log.read()):
                    time.sleep(STACK_DUMP_SETTLE_SECONDS)
                    return
            time.sleep(POLL_SECONDS / 10)

    def _ask_to_stop(self, phase: Phase, group: int) -> None:
        if phase.stop_argv:
            subprocess.run(
                phase.stop_argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False
            )
        else:
            _signal_group(group, signal.SIGINT)

    def _reap(self, attempt_pid: int | None = None) -> None:
        """Collect every exited child (orphans come to us as subreaper); note the attempt's own."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == attempt_pid:
                self._child_status = status

    def _wait_group_gone(self, group: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while group_alive(group):
            self._reap()
            if time.monotonic() > deadline:
                _signal_group(group, signal.SIGKILL)
                deadline = time.monotonic() + REMNANT_GRACE_SECONDS
            time.sleep(POLL_SECONDS / 5)

    def _sleep(self, seconds: float) -> bool:
        """Sleep unless a stop is requested; False when it was."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.stop_requested():
                return False
            self._reap()
            time.sleep(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))
        return not self.stop_requested()

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True


def _adoptable(previous: SupervisorState | None, plan: PhasePlan, layout: NodeLayout) -> bool:
    """Whether the state a supervisor left names an attempt of this plan that still runs, or
    that its keeper saw end (its status recorded): one to adopt rather than start again."""
    if previous is None or previous.state.terminal or previous.child_pid is None:
        return False
    if previous.phase not in [p.name for p in plan.phases]:
        return False
    pid = previous.child_pid
    return attempt_running(pid, layout) or reaped_code(layout, pid) is not None


def _exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _in_group(pid: int, group: int) -> bool:
    try:
        return os.getpgid(pid) == group
    except (ProcessLookupError, PermissionError):
        return False


# -- commands ------------------------------------------------------------------------------------
def launch(layout: NodeLayout) -> int:
    """Start `run` detached, under its keeper (clipforge.launcher.host.keeper), which starts a new
    one should it die; secrets arrive as a JSON object on stdin (never via argv or a file). A
    node whose supervisor or keeper is alive is refused in one line naming it: a second one
    would race the first. One that is gone is replaced; the new one adopts a live attempt."""
    for what, pid in (("supervisor", supervisor_pid(layout)), ("keeper", keeper_pid(layout))):
        if pid is not None:
            print(
                f"run {layout.launch_id} node {layout.node_rank} is live: its {what} (pid {pid}) "
                f"is running it; see `fab status`, or `fab stop` it first",
                file=sys.stderr,
            )
            return LIVE_EXIT
    secrets = json.loads(sys.stdin.read() or "{}")
    unknown = sorted(set(secrets) - set(PASSTHROUGH_ENV))
    if unknown:
        print(f"refusing to pass unknown environment variables: {unknown}", file=sys.stderr)
        return 2
    Path(layout.stop_request).unlink(missing_ok=True)
    env = dict(os.environ, **secrets)
    with open(layout.supervisor_log, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", KEEPER_MODULE, layout.node_dir],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    atomic_write_text(layout.keeper_pid_file, f"{process.pid}\n")
    print(json.dumps({"keeper_pid": process.pid}))
    return 0


def stop(layout: NodeLayout) -> int:
    """Ask for a graceful stop; prints whether a supervisor was there to hear it."""
    atomic_write_text(layout.stop_request, f"{time.time()}\n")
    pid = supervisor_pid(layout)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)  # wakes it now rather than at its next poll
    print(json.dumps({"supervisor_pid": pid}))
    return 0


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("command", choices=("launch", "run", "stop"))
    parser.add_argument("node_dir", type=node_dir_argument, metavar="NODE_DIR")
    args = parser.parse_args(argv)
    restrict_umask()  # the run's files, its stages' too: group-readable at most (fsutil)
    if args.command == "launch":
        return launch(args.node_dir)
    if args.command == "stop":
        return stop(args.node_dir)
    sys.stdout = os.fdopen(sys.stdout.fileno(), "w", buffering=1)
    return Supervisor(args.node_dir).run()


if __name__ == "__main__":
    raise SystemExit(main())
