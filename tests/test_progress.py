"""Per-rank heartbeats and the hang rule the supervisor applies to them (pure, fed clocks)."""

from __future__ import annotations

from clipforge.progress import (
    PROGRESS_DIR_ENV,
    ProgressFile,
    RankProgress,
    SetUpProgress,
    collective_timeout_seconds,
    find_hang,
    read_progress,
)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def beat(rank: int, at: float, *, step: int = 5, closed: bool = False) -> RankProgress:
    return RankProgress(rank, 100 + rank, step, at, stall_timeout_seconds=60.0, closed=closed)


def test_a_rank_silent_for_its_timeout_is_a_hang_and_every_rank_is_dumped():
    """Rank 1 last beat 60 s ago (its timeout): a hang naming rank 1; both ranks get dumps."""
    hang = find_hang([beat(0, 995.0), beat(1, 940.0)], now=1000.0, since=900.0)
    assert hang is not None
    assert [p.rank for p in hang.silent] == [1] and [p.rank for p in hang.everyone] == [0, 1]
    assert hang.idle_seconds == 60.0 and "rank 1 (pid 101, last step 5)" in hang.describe()


def test_just_under_the_timeout_is_no_hang():
    assert find_hang([beat(0, 940.5)], now=1000.0, since=900.0) is None


def test_a_closed_rank_and_beats_from_before_the_attempt_are_not_watched():
    """A rank that left its loop (exporting, finished) and a file older than this attempt's
    start (the last attempt's) never make a hang."""
    progress = [beat(0, 100.0, closed=True), beat(1, 800.0)]
    assert find_hang(progress, now=1000.0, since=900.0) is None


def test_beats_are_written_at_most_once_a_second_and_read_back(tmp_path):
    """Steps within a second write nothing new; after it the file holds the newest step; a
    garbled file counts as no beat."""
    clock, wall = Clock(0.0), Clock(5000.0)
    progress = ProgressFile(tmp_path, 3, 30.0, clock=clock, wall_clock=wall)
    progress.beat(1)
    clock.now = 0.5
    progress.beat(2)
    assert [(p.rank, p.step, p.time) for p in read_progress(tmp_path)] == [(3, 1, 5000.0)]
    clock.now, wall.now = 1.5, 5001.5
    progress.beat(3)
    progress.close(3)
    (tmp_path / "rank-7.json").write_text("{not json")
    (read,) = read_progress(tmp_path)
    assert (read.step, read.time, read.closed, read.stall_timeout_seconds) == (
        3,
        5001.5,
        True,
        30.0,
    )


def test_from_the_environment_only_under_a_supervisor(tmp_path):
    """No CLIPFORGE_PROGRESS_DIR, no file; with it, the folder is made. The collective timeout
    is doubled under the watchdog, so that the watchdog acts first."""
    assert ProgressFile.from_environment(0, 10.0, environ={}) is None
    made = ProgressFile.from_environment(0, 10.0, environ={PROGRESS_DIR_ENV: str(tmp_path / "p")})
    assert made is not None and (tmp_path / "p").is_dir()
    assert collective_timeout_seconds(10.0, environ={}) == 10.0
    assert collective_timeout_seconds(10.0, environ={PROGRESS_DIR_ENV: "x"}) == 20.0


def test_a_beat_without_a_timeout_is_watched_on_the_default_and_says_what_it_did(tmp_path):
    """Set-up beats name their own budget (alerts.setup_timeout_seconds); the eval stage's name
    none and take the watcher's default; with no default they are not watched."""
    clock, wall = Clock(0.0), Clock(900.0)
    ProgressFile(tmp_path, 0, None, clock=clock, wall_clock=wall).beat(None, "evaluating")
    SetUpProgress(ProgressFile(tmp_path, 1, 5.0, wall_clock=wall), 5.0).part("building the model")
    evaluating, building = read_progress(tmp_path)
    assert (evaluating.stall_timeout_seconds, evaluating.doing) == (None, "evaluating")
    assert (building.budget, building.doing) == (
        "alerts.setup_timeout_seconds",
        "building the model",
    )
    assert find_hang([evaluating], now=1000.0, since=800.0) is None
    hang = find_hang([evaluating, building], now=1000.0, since=800.0, default_timeout=60.0)
    assert hang is not None and [p.rank for p in hang.silent] == [0, 1]
    assert "no progress while building the model for 100 s" in hang.describe()
    assert "(alerts.setup_timeout_seconds=5)" in hang.describe()
