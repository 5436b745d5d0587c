"""The supervisor's keeper: a parent that only waits, and starts a new supervisor when one dies.

  python -m clipforge.launcher.host.keeper NODE_DIR   (what `supervisor launch` starts, detached)

The keeper leads the detached session `supervisor launch` makes, starts `supervisor run NODE_DIR`
as its child and waits. A supervisor that ends having written an end state (finished, stopped,
failed) ends the keeper too. One that dies without one (SIGKILL, the OOM killer, a crash of the
interpreter) is noticed at once, by wait(), and replaced after REPLACE_DELAY_SECONDS: the new
supervisor adopts the attempt the dead one left running, or the status it ended with, and never
starts a phase beside it (clipforge.launcher.host.supervisor, "adopted"). At most
MAX_REPLACEMENTS times in a launch: a supervisor that dies at every start is a bug no
replacement fixes (`fab status` then says `lost`).

It is a child subreaper, so the dead supervisor's attempt (and any of its orphans) becomes its
child: it writes each orphan's exit status to NODE_DIR/reaped/<pid> before reaping it
(clipforge.launcher.host.processes), which tells the adopting supervisor whether the phase it
adopted succeeded. What it saw goes to NODE_DIR/keeper.json (its only writer), which `fab status`
reads: which supervisors died, when, and how. SIGTERM or SIGINT to the keeper is passed to the
supervisor (a graceful stop), after which nothing is replaced. It does nothing else, so there is
little in it to fail; a keeper killed too leaves the run as before (`fab status`: the supervisor
gone, and whether its trainer still runs; `fab train --resume` adopts it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from clipforge.fsutil import atomic_write_text, restrict_umask
from clipforge.launcher.host.processes import (
    KEEPER_MODULE,
    SUPERVISOR_MODULE,
    become_subreaper,
    record_reaped,
)
from clipforge.launcher.host.run_dirs import NodeLayout, node_dir_argument
from clipforge.launcher.host.state import StateFileError, read_state

MAX_REPLACEMENTS = 10
REPLACE_DELAY_SECONDS = 1.0


def read_keeper_record(layout: NodeLayout) -> dict:
    """keeper.json: {"keeper_pid": N, "replaced": [{"supervisor_pid", "gone_at", "how"}...]};
    empty when there is none (a supervisor run without a keeper) or it cannot be read."""
    try:
        with open(layout.keeper_record, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def describe_status(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class Keeper:
    def __init__(self, layout: NodeLayout) -> None:
        self.layout = layout
        self.stopping = False
        self.supervisor: subprocess.Popen | None = None
        self.record: dict = {"keeper_pid": os.getpid(), "replaced": []}

    def _log(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"=== clipforge keeper {stamp}: {message} ===", flush=True)  # supervisor.log

    def _start(self) -> None:
        self.supervisor = subprocess.Popen(
            [sys.executable, "-m", SUPERVISOR_MODULE, "run", self.layout.node_dir],
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )

    def _on_signal(self, signum, frame) -> None:
        self.stopping = True
        if self.supervisor is not None and self.supervisor.returncode is None:
            self.supervisor.send_signal(signal.SIGTERM)

    def _ended_on_purpose(self) -> bool:
        """The supervisor wrote an end state before it exited (or was asked to stop)."""
        try:
            state = read_state(self.layout.state)
        except StateFileError:
            return False
        return self.stopping or (state is not None and state.state.terminal)

    def run(self) -> int:
        become_subreaper()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        atomic_write_text(self.layout.keeper_pid_file, f"{os.getpid()}\n")
        atomic_write_text(self.layout.keeper_record, json.dumps(self.record, indent=2) + "\n")
        self._start()
        while True:
            try:
                # The status first, the reap after (WNOWAIT): an orphan's status is on disk before
                # its pid is gone, so whoever watches that pid finds the status once it is.
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                return 0
            if info is None:
                continue
            pid = info.si_pid
            code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            assert self.supervisor is not None
            if pid != self.supervisor.pid:
                record_reaped(self.layout, pid, code)
                os.waitpid(pid, 0)
                continue
            self.supervisor.wait()
            if self._ended_on_purpose():
                return 0
            if len(self.record["replaced"]) >= MAX_REPLACEMENTS:
                self._log(
                    f"supervisor pid {pid} died ({describe_status(code)}); {MAX_REPLACEMENTS} "
                    f"replaced already: giving up (`fab train --resume` starts one again)"
                )
                return 1
            self.record["replaced"].append(
                {"supervisor_pid": pid, "gone_at": time.time(), "how": describe_status(code)}
            )
            atomic_write_text(self.layout.keeper_record, json.dumps(self.record, indent=2) + "\n")
            self._log(
                f"supervisor pid {pid} died without finishing ({describe_status(code)}); "
                f"starting a new one, which adopts the run's live attempt"
            )
            time.sleep(REPLACE_DELAY_SECONDS)
            if self.stopping:
                return 0
            self._start()


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {KEEPER_MODULE}")
    parser.add_argument("node_dir", type=node_dir_argument, metavar="NODE_DIR")
    args = parser.parse_args(argv)
    restrict_umask()
    return Keeper(args.node_dir).run()


if __name__ == "__main__":
    raise SystemExit(main())
