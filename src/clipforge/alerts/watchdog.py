"""Stall watchdog: a thread that notices a run no longer completing steps.

A run that hangs (stuck collective, dead GPU) raises no exception, so a
separate thread watches the time since the last completed step.

It fires once per stall and re-arms when a step completes again (reported as a recovery).
PyTorch releases the GIL while it waits on a collective or a CUDA sync, so this thread keeps
running while the training thread is stuck there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

# How often the thread looks at the clock, as a fraction of the timeout: late by at most this.
_CHECKS_PER_TIMEOUT = 10
_MAX_CHECK_INTERVAL_SECONDS = 10.0


class StallWatchdog:
    def __init__(
        self,
        timeout_seconds: float,
        *,
        on_stall: Callable[[int | None, float], None],
        on_recover: Callable[[int, float], None],
        log: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`on_stall(last_step, seconds_since)` runs on the watchdog thread;
        `on_recover(step, stalled_seconds)` on the thread that calls `beat`."""
        self._timeout = timeout_seconds
        self._on_stall = on_stall
        self._on_recover = on_recover
        self._log = log
        self._clock = clock
        self._lock = threading.Lock()
        self._last_beat = clock()
        self._last_step: int | None = None
        self._stalled_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="alerts-stall-watchdog", daemon=True)

    def start(self) -> None:
        with self._lock:
            self._last_beat = self._clock()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def beat(self, step: int) -> None:
        with self._lock:
            now = self._clock()
            stalled_since = self._stalled_since
            self._last_beat, self._last_step, self._stalled_since = now, step, None
        if stalled_since is not None:
            self._on_recover(step, now - stalled_since)

    def check(self) -> bool:
        """Fire if the timeout has passed since the last beat and not fired yet for this stall."""
        with self._lock:
            now = self._clock()
            idle = now - self._last_beat
            if self._stalled_since is not None or idle < self._timeout:
                return False
            self._stalled_since = self._last_beat
            last_step = self._last_step
        self._on_stall(last_step, idle)
        return True

    def _run(self) -> None:
        interval = min(self._timeout / _CHECKS_PER_TIMEOUT, _MAX_CHECK_INTERVAL_SECONDS)
        while not self._stop.wait(interval):
            try:
                self.check()
            except Exception:  # the watchdog must outlive a failing alert path
                self._log.exception("alerts: stall watchdog check failed")
