"""Per-rank progress heartbeats, and the rule that turns their silence into a hang.

A hung run (a wedged NCCL collective, a stuck filesystem, a stopped process) raises nothing;
the in-process stall watchdog can only alert, from inside the process that hangs. So every
rank of a run under the launcher's supervisor writes its progress to a small file,
`<node>/progress/rank-<r>.json`, and the supervisor (another process, on the same node) reads
them: no step on some rank for its `alerts.stall_timeout_seconds` is a hang, handled like a
crash (stack dump of every rank, alert, restart from the last checkpoint).

Every phase is watched, not only the steps: set-up (the process group's rendezvous, the model
and engine build, the checkpoint load) beats at each of its parts with a budget of its own,
`alerts.setup_timeout_seconds` (SetUpProgress); validation, a save and the export sit between
two beats of the training loop, under the stall timeout; the eval stage beats per batch without
a budget of its own (it reads no `alerts:`), and the supervisor applies the run's stall timeout.

Writing is cheap: the step number is a Python int the loop has anyway, and a rank rewrites its
file at most every `_WRITE_EVERY_SECONDS`. Standard library only: the supervisor imports this.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

# Set by the supervisor for the ranks it runs; without it a run writes no progress files.
PROGRESS_DIR_ENV = "CLIPFORGE_PROGRESS_DIR"
# The signal on which every rank writes the stacks of all its threads to stderr (the run's log).
STACK_DUMP_SIGNAL = signal.SIGUSR1
# Set-up's rendezvous part: a rank silent there waits on a peer or a master it cannot reach, so a
# hang there is a rendezvous failure (the supervisor's repeat rule), not only a slow start.
JOINING_PROCESS_GROUP = "joining the process group"
_WRITE_EVERY_SECONDS = 1.0
_PREFIX, _SUFFIX = "rank-", ".json"


@dataclass(frozen=True)
class RankProgress:
    rank: int
    pid: int
    step: int | None
    time: float
    """Wall-clock time of the last beat (Unix seconds): compared across processes."""
    stall_timeout_seconds: float | None
    """None: the watcher's default (the run's stall timeout)."""
    closed: bool = False
    """The rank left its training loop (finished, stopped or failed): nothing to watch."""
    doing: str | None = None
    """What the rank does outside the training steps (a part of set-up, the eval)."""
    budget: str = "alerts.stall_timeout_seconds"
    """The setting whose value `stall_timeout_seconds` is: what a hang message names."""


class ProgressFile:
    """One rank's heartbeat file; `beat` is cheap enough to call on every step."""

    def __init__(
        self,
        directory: str | Path,
        rank: int,
        stall_timeout_seconds: float | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(directory) / f"{_PREFIX}{rank}{_SUFFIX}"
        self._rank = rank
        self._timeout = stall_timeout_seconds
        self._clock, self._wall_clock = clock, wall_clock
        self._every = min(_WRITE_EVERY_SECONDS, (stall_timeout_seconds or 10.0) / 10)
        self._last_write: float | None = None

    @classmethod
    def from_environment(
        cls,
        rank: int,
        stall_timeout_seconds: float | None,
        environ: Mapping[str, str] = os.environ,
    ) -> ProgressFile | None:
        directory = environ.get(PROGRESS_DIR_ENV)
        if not directory:
            return None
        Path(directory).mkdir(parents=True, exist_ok=True)
        # faulthandler writes from its C signal handler, without the GIL: it dumps even a rank
        # whose main thread is stuck inside a collective.
        faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
        return cls(directory, rank, stall_timeout_seconds)

    def beat(self, step: int | None, doing: str | None = None) -> None:
        """Progress at `step` (and `doing` what, outside the training steps)."""
        now = self._clock()
        if self._last_write is not None and now - self._last_write < self._every:
            return
        self._last_write = now
        self._write(step, closed=False, doing=doing)

    def doing(self, what: str, timeout: float | None, budget: str, step: int | None = None) -> None:
        """A beat now (not rate-limited) saying what the rank starts, silent for at most
        `timeout` seconds (the value of the setting `budget`) before it is a hang."""
        self._last_write = self._clock()
        self._write(step, closed=False, doing=what, timeout=timeout, budget=budget)

    def close(self, step: int | None) -> None:
        self._write(step, closed=True)

    def _write(
        self,
        step: int | None,
        *,
        closed: bool,
        doing: str | None = None,
        timeout: float | None = None,
        budget: str | None = None,
    ) -> None:
        record = {
            "rank": self._rank,
            "pid": os.getpid(),
            "step": step,
            "time": self._wall_clock(),
            "stall_timeout_seconds": self._timeout if budget is None else timeout,
            "closed": closed,
            "doing": doing,
            "budget": budget or "alerts.stall_timeout_seconds",
        }
        temporary = self.path.with_suffix(".tmp")
        try:
            temporary.write_text(json.dumps(record), encoding="utf-8")
            os.replace(temporary, self.path)
        except OSError:  # a full disk must not stop training; the watchdog then sees silence
            pass


def read_progress(directory: str | Path) -> list[RankProgress]:
    """Every rank's last beat; a file half-written or garbled counts as no beat."""
    found = []
    try:
        paths = sorted(Path(directory).glob(f"{_PREFIX}*{_SUFFIX}"))
    except OSError:
        return []
    for path in paths:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            found.append(
                RankProgress(
                    rank=int(raw["rank"]),
                    pid=int(raw["pid"]),
                    step=None if raw["step"] is None else int(raw["step"]),
                    time=float(raw["time"]),
                    stall_timeout_seconds=_seconds(raw["stall_timeout_seconds"]),
                    closed=bool(raw.get("closed", False)),
                    doing=raw.get("doing"),
                    budget=str(raw.get("budget") or "alerts.stall_timeout_seconds"),
                )
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def _seconds(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


class SetUpProgress:
    """A rank's beats before its first step: each part of set-up (the process group, the model,
    the engine, the checkpoint load) may take `alerts.setup_timeout_seconds`; silent for longer,
    the supervisor handles it as a hang. Inert without the supervisor."""

    BUDGET = "alerts.setup_timeout_seconds"

    def __init__(self, file: ProgressFile | None, timeout_seconds: float) -> None:
        self._file, self._timeout = file, timeout_seconds

    @classmethod
    def from_environment(
        cls, timeout_seconds: float, environ: Mapping[str, str] = os.environ
    ) -> SetUpProgress:
        # Before the process group exists: the rank DeepSpeed's launcher gave this process.
        rank = int(environ.get("RANK", "0"))
        return cls(ProgressFile.from_environment(rank, timeout_seconds, environ), timeout_seconds)

    def part(self, what: str) -> None:
        if self._file is not None:
            self._file.doing(what, self._timeout, self.BUDGET)


@dataclass(frozen=True)
class Hang:
    silent: tuple[RankProgress, ...]
    """The ranks without a beat for their stall timeout."""
    everyone: tuple[RankProgress, ...]
    """Every rank that beat in this attempt: all of them get a stack dump."""
    idle_seconds: float

    def in_rendezvous(self) -> bool:
        return any(p.doing == JOINING_PROCESS_GROUP for p in self.silent)

    def describe(self) -> str:
        ranks = ", ".join(
            f"rank {p.rank} (pid {p.pid}, last step {'none' if p.step is None else p.step})"
            for p in self.silent
        )
        first = min(self.silent, key=lambda p: p.stall_timeout_seconds or 0.0)
        what = f"no progress while {first.doing}" if first.doing else "no training step"
        return (
            f"{what} for {self.idle_seconds:.0f} s on {ranks} "
            f"({first.budget}={first.stall_timeout_seconds:g}): a hang, handled as a crash"
        )


def find_hang(
    progress: Sequence[RankProgress],
    now: float,
    since: float,
    default_timeout: float | None = None,
) -> Hang | None:
    """A hang: some rank that beat since `since` (this attempt's start) and has not left its
    loop has been silent for its timeout (a beat without one: `default_timeout`, the run's stall
    timeout; neither: not watched). Pure: the supervisor passes the clock.

    Before a rank's first beat (the interpreter starting, DVC checking the pipeline) nothing is
    watched: set-up beats first thing (SetUpProgress)."""
    current = tuple(
        replace(p, stall_timeout_seconds=p.stall_timeout_seconds or default_timeout)
        for p in progress
        if p.time >= since
    )
    silent = tuple(
        p
        for p in current
        if not p.closed
        and p.stall_timeout_seconds is not None
        and now - p.time >= p.stall_timeout_seconds
    )
    if not silent:
        return None
    return Hang(silent, current, max(now - p.time for p in silent))


def collective_timeout_seconds(
    stall_timeout_seconds: float, environ: Mapping[str, str] = os.environ
) -> float:
    """How long a collective waits for a peer. Under the supervisor's watchdog it is twice the
    stall timeout: the watchdog acts first (with stack dumps of every rank), the collective's
    own timeout stays the backstop. Alone (no supervisor), the collective fails at the stall
    timeout and the caller's restart logic takes over."""
    if environ.get(PROGRESS_DIR_ENV):
        return 2 * stall_timeout_seconds
    return stall_timeout_seconds
