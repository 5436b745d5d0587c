"""A rank ends with its own exit code, every time: the train stage's ranks leave their process
group before the interpreter exits (clipforge.train.dist.exit_leaving_process_group). Left to
interpreter shutdown, gloo's threads can be destroyed while joinable and a rank whose work is
done aborts (SIGABRT: DeepSpeed's launcher then fails a finished run with exit 250; CI saw it in
the two-rank run). It is a race between two ranks ending side by side, so the test ends many
pairs: with torch 2.14 and no leaving, about 1 pair in 7 aborted, and 24 clean pairs in a row
would come about 2 times in 100. A pair is two fresh interpreters (each imports torch, ~2 s of
CPU): tier2, beside the two-rank runs of make test, which end this way too."""

from __future__ import annotations

import pytest

from tests.conftest import subprocess_env
from tests.support.sshd import free_port
from tests.support.workers import ranks_of

PAIRS = 24


def _end_a_pair(**env: str) -> list[tuple[int, str]]:
    """Two ranks of tests.support.ending_rank, started together: (exit code, stderr) of each."""
    base = subprocess_env() | {"MASTER_PORT": str(free_port()), **env}
    return [
        (r.returncode, r.stderr[-2000:]) for r in ranks_of("tests.support.ending_rank", 2, base)
    ]


@pytest.mark.tier2
def test_two_ranks_ending_side_by_side_exit_0_every_time():
    for pair in range(PAIRS):
        ended = _end_a_pair()
        assert [code for code, _ in ended] == [0, 0], f"pair {pair + 1} of {PAIRS}: {ended}"


def test_a_rank_that_stops_keeps_its_exit_code():
    """A stop ends the train stage through SystemExit (clipforge.train.stage.EXIT_STOPPED), whose
    code the supervisor reads: leaving the group keeps it."""
    from clipforge.train.stage import EXIT_STOPPED

    ended = _end_a_pair(ENDING_CODE=str(EXIT_STOPPED))
    assert [code for code, _ in ended] == [EXIT_STOPPED] * 2, ended
