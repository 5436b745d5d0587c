"""When a run's host is gone, and what the recovery controller did about it: the pure core.

The controller (clipforge.launcher.controller, the thin shell: SSH, clock, files) probes every
training host of a run from a machine that is not one of them, and feeds the probes to `decide`,
which says: keep watching, move the run from a gone host to a spare, or end (the run finished or
stopped; or `run_failed`, with the reason). Nothing here does I/O, so the rule is tested as a
function from probe history to decision.

The rule (docs/launcher.md, "A box dies, the run goes on"). A probe is one SSH command on the
host that reads the node's supervisor state and whether its supervisor process lives. It
*misses* when SSH fails (refused, timed out, authentication), or when the host answers but its
supervisor is not running while its state says it should be, or the state cannot be read. A
host is gone only when its probes since the last answered one are at least `gone_after_misses`
misses in a row AND span at least `gone_after_seconds`, first miss to last. One answered probe
wipes the slate. Never one probe: the
top complaint of SkyPilot's and Kubeflow's users is a healthy job killed after one status
time-out. Both conditions, because each alone is fooled: k fast misses fit inside a 10-second
network blip, and one slow probe can span N seconds on its own.

A move is bounded: `max_moves` moves (started or failed) per run, then `run_failed`; a spare is
used once (a spare that failed to start the run is not tried again, a gone host never comes
back into the run).

The records are what crosses machines (the controller's host, the run's new host, the run
store): typed, with one reader that says what is wrong with a damaged file
(as clipforge.launcher.host.state).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clipforge.errors import LauncherError
from clipforge.fields import Section, knob
from clipforge.launcher.host.state import RunState
from clipforge.store.remote import LAUNCHES
from clipforge.util import record_json, typed_fields

RECOVERY_FILE = "recovery.json"
"""The controller's record, in the run directory of the run's current host, in the controller's
own directory, and as launches/<launch id>.recovery.json in the run store."""


def store_record_path(launch_id: str) -> str:
    """The record's place in the run store, beside the launch's own (clipforge.store.remote)."""
    return f"{LAUNCHES}/{launch_id}.{RECOVERY_FILE}"


# -- the rule ------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ProbeTimings(Section):
    """When a host is gone: fabric.yaml settings (clipforge.launcher.session.Settings holds
    them), carried in the controller's plan."""

    SECTION = "clipforge"
    ERROR = LauncherError

    probe_every_seconds: float = knob(
        30.0, "`train --spare`: how often the recovery controller probes each training host", gt=0
    )
    gone_after_misses: int = knob(
        4,
        "`train --spare`: a host is gone after this many missed probes in a row (never one)...",
        ge=2,
    )
    gone_after_seconds: float = knob(
        120.0, "...spanning at least this long, first miss to last", gt=0
    )


@dataclass(frozen=True, kw_only=True)
class RecoveryRule(ProbeTimings):
    max_moves: int = knob(
        2,
        "moves to a spare (started or failed) before the controller gives up: `run_failed`",
        ge=0,
    )

    @classmethod
    def key_of(cls, name: str) -> str:
        return "--max-moves" if name == "max_moves" else super().key_of(name)  # fab train's


class ProbeResult(str, enum.Enum):
    ANSWERED = "answered"  # reachable, its supervisor alive and not done
    MISSED = "missed"  # see the module's docstring
    ENDED = "ended"  # reachable, the node's supervisor is done: finished, stopped or failed

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Probe:
    at: float
    result: ProbeResult
    detail: str = ""
    """Why it missed ("ssh: connection refused"), or the supervisor's reason when it failed."""
    state: RunState | None = None
    """The node's supervisor state, when it could be read."""


def missed_run(probes: Sequence[Probe]) -> list[Probe]:
    """The misses at the end of `probes` (oldest first), back to the last probe that answered."""
    run: list[Probe] = []
    for probe in reversed(probes):
        if probe.result is not ProbeResult.MISSED:
            break
        run.append(probe)
    return run[::-1]


def host_gone(probes: Sequence[Probe], rule: RecoveryRule) -> bool:
    """Whether the probes since the last answered one are at least `gone_after_misses` misses
    spanning at least `gone_after_seconds`, first to last."""
    misses = missed_run(probes)
    if len(misses) < rule.gone_after_misses:
        return False
    return misses[-1].at - misses[0].at >= rule.gone_after_seconds


def gone_reason(host: str, probes: Sequence[Probe]) -> str:
    misses = missed_run(probes)
    span = misses[-1].at - misses[0].at
    return (
        f"{host} gone: {len(misses)} probes missed in a row over {span:.0f} s "
        f"(the last: {misses[-1].detail})"
    )


class Action(str, enum.Enum):
    WATCH = "watch"
    MOVE = "move"
    FINISH = "finish"  # the run finished or was stopped: nothing more to watch
    FAIL = "fail"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""
    host: str | None = None  # MOVE: the gone host
    to_host: str | None = None  # MOVE: the spare
    state: RunState | None = None  # FINISH: finished or stopped


def decide(
    probes: Mapping[str, Sequence[Probe]],
    spares: Sequence[str],
    moves_made: int,
    rule: RecoveryRule,
) -> Decision:
    """What to do now, from each current training host's probes (oldest first; hosts in node
    order), the spares not yet used, and the moves already made (started or failed)."""
    latest = {host: history[-1] for host, history in probes.items() if history}
    for host, probe in latest.items():
        if probe.result is ProbeResult.ENDED and probe.state is RunState.FAILED:
            # The supervisor spent its own restarts: the same code and data would fail the same
            # way elsewhere, so moving the run would only repeat it.
            why = probe.detail or "no reason recorded"
            return Decision(Action.FAIL, f"{host}: the supervisor gave up: {why}", host=host)
    if probes and len(latest) == len(probes):
        ended = [p for p in latest.values() if p.result is ProbeResult.ENDED]
        if len(ended) == len(probes):
            state = (
                RunState.FINISHED
                if all(p.state is RunState.FINISHED for p in ended)
                else RunState.STOPPED
            )
            return Decision(Action.FINISH, f"the run {state}", state=state)
    for host, history in probes.items():
        if not host_gone(history, rule):
            continue
        why = gone_reason(host, history)
        if moves_made >= rule.max_moves:
            return Decision(
                Action.FAIL,
                f"{why}; the move budget is spent ({moves_made} of {rule.max_moves} moves)",
                host=host,
            )
        if not spares:
            return Decision(Action.FAIL, f"{why}; no spare host left", host=host)
        return Decision(Action.MOVE, why, host=host, to_host=spares[0])
    return Decision(Action.WATCH)


# -- the record ----------------------------------------------------------------------------------
class ControllerState(str, enum.Enum):
    WATCHING = "watching"
    MOVING = "moving"
    FINISHED = "finished"  # the run finished (or was stopped); the controller is done
    STOPPED = "stopped"
    RUN_FAILED = "run_failed"

    def __str__(self) -> str:
        return self.value


class RecordError(LauncherError, ValueError):
    """A recovery record that exists but is not one; the message names the file and the field.
    A user error (the launcher's): the file is the user's to look at."""


@dataclass(frozen=True)
class Move:
    from_host: str
    to_host: str
    at: float
    reason: str
    outcome: str = "started"
    """`started`, or `failed: <why>` (the spare could not start the run)."""

    @property
    def started(self) -> bool:
        return self.outcome == "started"


@dataclass(frozen=True, kw_only=True)
class RecoveryRecord:
    launch_id: str
    state: ControllerState
    controller: str
    """The host the controller runs on."""
    hosts: list[str]
    """The run's training hosts now, in node order."""
    spares: list[str]
    """Spares not used yet."""
    max_moves: int
    moves: list[Move] = field(default_factory=list)
    reason: str | None = None
    """Why it gave up (state run_failed), or how the run ended."""
    updated_at: float | None = None

    def to_dict(self) -> dict:
        raw = dataclasses.asdict(self)
        raw["state"] = self.state.value
        return raw

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def changed(self, **changes: Any) -> RecoveryRecord:
        return dataclasses.replace(self, **changes, updated_at=time.time())


_RECORD_TYPES: dict[str, type | tuple[type, ...]] = {
    "launch_id": str,
    "controller": str,
    "hosts": list,
    "spares": list,
    "max_moves": int,
    "moves": list,
    "reason": (str, type(None)),
    "updated_at": (int, float, type(None)),
}
_MOVE_TYPES: dict[str, type | tuple[type, ...]] = {
    "from_host": str,
    "to_host": str,
    "at": (int, float),
    "reason": str,
    "outcome": str,
}


_OPTIONAL_KEYS = ("reason", "updated_at", "moves")


def record_from_dict(raw: object, source: str = RECOVERY_FILE) -> RecoveryRecord:
    """The one reader: parsed JSON to a RecoveryRecord, or RecordError naming the field."""
    if not isinstance(raw, dict):
        raise RecordError(f"{source}: not a JSON object but {type(raw).__name__}")
    try:
        state = ControllerState(raw.get("state"))
    except ValueError:
        allowed = ", ".join(s.value for s in ControllerState)
        raise RecordError(
            f"{source}: state is {raw.get('state')!r}, not one of {allowed}"
        ) from None
    missing = [key for key in _RECORD_TYPES if key not in raw and key not in _OPTIONAL_KEYS]
    if missing:
        raise RecordError(f"{source}: {missing[0]} is None, of the wrong type")
    values: dict[str, Any] = {
        "state": state,
        **typed_fields(raw, _RECORD_TYPES, source, RecordError),
    }
    moves = []
    for index, move in enumerate(values.get("moves", [])):
        if not isinstance(move, dict):
            raise RecordError(f"{source}: moves[{index}] is {move!r}, not an object")
        for key, kinds in _MOVE_TYPES.items():
            if not isinstance(move.get(key), kinds) or isinstance(move.get(key), bool):
                raise RecordError(f"{source}: moves[{index}].{key} is {move.get(key)!r}")
        moves.append(Move(**{key: move[key] for key in _MOVE_TYPES}))
    values["moves"] = moves
    return RecoveryRecord(**values)


def parse_record(text: str, source: str = RECOVERY_FILE) -> RecoveryRecord:
    return record_from_dict(record_json(text, source, RecordError), source)


def status_rows(record: RecoveryRecord) -> list[tuple[str, str]]:
    """`fab status` rows: the controller, and each move (from → to, when, why)."""
    used = len(record.moves)
    rows = [
        (
            "recovery",
            f"{record.state} (controller on {record.controller}, moves {used} of "
            f"{record.max_moves}, spares left: {', '.join(record.spares) or 'none'})"
            + (f": {record.reason}" if record.state is ControllerState.RUN_FAILED else ""),
        )
    ]
    for move in record.moves:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(move.at))
        what = "moved" if move.started else "move failed"
        rows.append(
            (what, f"{move.from_host} -> {move.to_host} at {when}: {move.reason}")
            if move.started
            else (what, f"{move.from_host} -> {move.to_host} at {when}: {move.outcome}")
        )
    return rows
