"""Stall watchdog: fires once when no step completes for T seconds, re-arms on progress."""

from __future__ import annotations

import logging
import threading
import time

from clipforge.alerts.watchdog import StallWatchdog
from tests.support.webhooks import WAIT_SECONDS

LOG = logging.getLogger("clipforge.alerts.test")


class Recorder:
    def __init__(self):
        self.stalls, self.recoveries = [], []
        self.fired = threading.Event()

    def on_stall(self, last_step, idle):
        self.stalls.append((last_step, idle))
        self.fired.set()

    def on_recover(self, step, stalled):
        self.recoveries.append((step, stalled))


def watchdog(recorder, timeout, clock=time.monotonic) -> StallWatchdog:
    return StallWatchdog(
        timeout, on_stall=recorder.on_stall, on_recover=recorder.on_recover, log=LOG, clock=clock
    )


def test_fires_once_per_stall_and_recovers_on_the_next_step():
    """Fake clock: past the timeout it fires once with the last step, not again while the stall
    lasts; the next beat reports the recovery and re-arms it."""
    now = [0.0]
    rec = Recorder()
    dog = watchdog(rec, timeout=10.0, clock=lambda: now[0])
    dog.beat(41)
    now[0] = 9.9
    assert not dog.check()
    now[0] = 10.5
    assert dog.check() and rec.stalls == [(41, 10.5)]
    now[0] = 100.0
    assert not dog.check(), "one alert per stall"
    dog.beat(42)
    assert rec.recoveries == [(42, 100.0)]
    now[0] = 111.0
    assert dog.check() and rec.stalls[-1] == (42, 11.0)


def test_thread_fires_when_no_heartbeat_comes():
    """Real thread, T = 0.5 s: with no heartbeat the stall callback runs by itself."""
    rec = Recorder()
    dog = watchdog(rec, timeout=0.5)
    dog.start()
    dog.beat(3)
    try:
        assert rec.fired.wait(WAIT_SECONDS)
    finally:
        dog.stop()
    assert rec.stalls[0][0] == 3 and rec.stalls[0][1] >= 0.5


def test_regular_heartbeats_keep_it_quiet():
    """Fake clock: a beat every T/2 over 100 T never looks like a stall."""
    now = [0.0]
    rec = Recorder()
    dog = watchdog(rec, timeout=10.0, clock=lambda: now[0])
    for step in range(200):
        now[0] += 5.0
        dog.beat(step)
        assert not dog.check()
    assert rec.stalls == []
