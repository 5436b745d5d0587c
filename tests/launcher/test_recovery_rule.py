"""The recovery controller's rule (clipforge.launcher.recovery): from probe history to decision.
A host is gone only after k missed probes in a row spanning N seconds; an answered probe wipes
the slate; the move budget and the spares bound the moves; a run that ended ends the watch."""

from __future__ import annotations

import json

import pytest

from clipforge.errors import LauncherError
from clipforge.launcher.host.state import RunState
from clipforge.launcher.recovery import (
    Action,
    ControllerState,
    Move,
    Probe,
    ProbeResult,
    RecordError,
    RecoveryRecord,
    RecoveryRule,
    decide,
    host_gone,
    parse_record,
    status_rows,
)

RULE = RecoveryRule(probe_every_seconds=10, gone_after_misses=3, gone_after_seconds=30, max_moves=2)
OK = ProbeResult.ANSWERED
MISS = ProbeResult.MISSED


def probes(*results: ProbeResult, every: float = 10.0) -> list[Probe]:
    """One probe per result, `every` seconds apart; misses say the host refused SSH."""
    return [
        Probe(at=i * every, result=r, detail="ssh: connection refused" if r is MISS else "")
        for i, r in enumerate(results)
    ]


def test_one_missed_probe_is_never_a_lost_host():
    """A single miss, however long it took, leaves the run where it is."""
    assert not host_gone([Probe(0, OK), Probe(500, MISS, "ssh: timed out")], RULE)
    assert decide({"a": probes(OK, MISS)}, ["c"], 0, RULE).action is Action.WATCH


def test_k_misses_in_a_row_over_n_seconds_make_a_host_gone_and_move_the_run_to_the_spare():
    """Misses at 10, 20, 30 s are three in a row, but over 20 s (< 30): not yet; the fourth, at
    40 s, makes 30 s: the host is gone, and the run moves from it to the first spare, saying
    why."""
    history = probes(OK, MISS, MISS, MISS)
    assert decide({"a": history}, ["c", "d"], 0, RULE).action is Action.WATCH
    history = probes(OK, MISS, MISS, MISS, MISS)
    decision = decide({"a": history}, ["c", "d"], 0, RULE)
    assert decision.action is Action.MOVE
    assert (decision.host, decision.to_host) == ("a", "c")
    assert "a gone: 4 probes missed in a row over 30 s" in decision.reason
    assert "connection refused" in decision.reason


def test_fast_misses_within_n_seconds_are_not_enough():
    """Ten misses one second apart (a 9-second blip) do not reach N = 30 s."""
    assert not host_gone(probes(*[MISS] * 10, every=1.0), RULE)


def test_a_flapping_host_that_answers_between_misses_is_never_gone():
    """Miss, miss, answer, miss, miss, answer...: never k misses in a row, so never moved."""
    history = probes(*[MISS, MISS, OK] * 20)
    assert not host_gone(history, RULE)
    assert decide({"a": history}, ["c"], 0, RULE).action is Action.WATCH


def test_a_host_that_answers_again_wipes_its_misses():
    """Many misses, then one answer: it starts again from zero."""
    history = probes(*[MISS] * 2, OK, MISS, MISS)
    assert not host_gone(history, RULE)
    assert host_gone(probes(*[MISS] * 2, OK, MISS, MISS, MISS, MISS), RULE)


def test_a_spent_move_budget_ends_in_run_failed_with_the_reason():
    """Gone once more after max_moves moves: fail, naming the host and the budget."""
    decision = decide({"c": probes(*[MISS] * 5)}, ["d"], 2, RULE)
    assert decision.action is Action.FAIL
    assert "c gone" in decision.reason and "move budget is spent (2 of 2 moves)" in decision.reason


def test_no_spare_left_ends_in_run_failed():
    decision = decide({"a": probes(*[MISS] * 5)}, [], 0, RULE)
    assert decision.action is Action.FAIL and "no spare host left" in decision.reason


def test_a_supervisor_that_gave_up_ends_the_watch_without_a_move():
    """The supervisor spent its restarts (same code, same data): moving would repeat it."""
    ended = Probe(0, ProbeResult.ENDED, "loss is NaN", RunState.FAILED)
    decision = decide({"a": [ended]}, ["c"], 0, RULE)
    assert decision.action is Action.FAIL and "a: the supervisor gave up: loss is NaN" == (
        decision.reason
    )


def test_a_finished_or_stopped_run_ends_the_watch():
    finished = Probe(0, ProbeResult.ENDED, state=RunState.FINISHED)
    stopped = Probe(0, ProbeResult.ENDED, state=RunState.STOPPED)
    assert decide({"a": [finished]}, ["c"], 0, RULE).state is RunState.FINISHED
    assert decide({"a": [stopped]}, ["c"], 0, RULE).state is RunState.STOPPED
    assert decide({"a": [finished], "b": probes(OK)}, [], 0, RULE).action is Action.WATCH


@pytest.mark.parametrize(
    "change, message",
    [
        ({"gone_after_misses": 1}, "clipforge.gone_after_misses: got 1; must be >= 2"),
        ({"gone_after_seconds": 0}, "clipforge.gone_after_seconds: got 0.0; must be > 0"),
        ({"probe_every_seconds": 0}, "clipforge.probe_every_seconds: got 0.0; must be > 0"),
        ({"max_moves": -1}, "--max-moves: got -1; must be >= 0"),
    ],
)
def test_a_rule_that_would_act_on_one_probe_is_refused(change, message):
    with pytest.raises(LauncherError, match=message):
        RecoveryRule(**change)


def test_the_record_round_trips_and_status_shows_the_move():
    """What the controller writes reads back the same; `fab status` rows name from, to, when,
    why."""
    record = RecoveryRecord(
        launch_id="20261201-140000-abcdef1234",
        state=ControllerState.WATCHING,
        controller="u@c:22",
        hosts=["u@c:22"],
        spares=[],
        max_moves=2,
        moves=[Move("u@a:22", "u@c:22", 1764597792.0, "u@a:22 gone: 4 probes missed")],
        updated_at=1.0,
    )
    assert parse_record(record.to_json()) == record
    rows = dict(status_rows(record))
    assert rows["moved"] == (
        "u@a:22 -> u@c:22 at 2025-12-01 14:03:12 UTC: u@a:22 gone: 4 probes missed"
    )
    assert rows["recovery"].startswith("watching (controller on u@c:22, moves 1 of 2")


def test_a_damaged_record_names_the_field():
    raw = json.loads(
        RecoveryRecord(
            launch_id="x", state=ControllerState.WATCHING, controller="c", hosts=[], spares=[],
            max_moves=1,
        ).to_json()
    )  # fmt: skip
    with pytest.raises(RecordError, match="recovery.json: state is 'lost'"):
        parse_record(json.dumps({**raw, "state": "lost"}))
    with pytest.raises(RecordError, match=r"moves\[0\].to_host"):
        parse_record(json.dumps({**raw, "moves": [{"from_host": "a", "at": 1, "reason": ""}]}))
    with pytest.raises(RecordError, match="not JSON"):
        parse_record("{")
