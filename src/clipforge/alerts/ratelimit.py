"""De-duplication and rate limiting of webhook messages: a flapping rule sends a few, not 1000.

Pure: the caller passes the time, so the rules of the gate are tested without waiting.
Only webhook messages pass this gate; every alert still goes to the run log and TensorBoard.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Admission:
    send: bool
    num_suppressed_before: int
    """How many alerts of this rule and key were held back since the last one sent."""
    reason: str
    """Why it is held back; empty when sent."""


class AlertGate:
    """Per (rule, key): at most one message every `min_seconds_between_repeats`.
    All together: at most `max_messages_per_window` messages per `window_seconds`.
    Exempt messages (run lifecycle) always pass and do not use up the window.
    """

    def __init__(
        self,
        *,
        min_seconds_between_repeats: float,
        max_messages_per_window: int,
        window_seconds: float,
    ) -> None:
        self._min_repeat = min_seconds_between_repeats
        self._max_per_window = max_messages_per_window
        self._window = window_seconds
        self._last_sent: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}
        self._sent_times: deque[float] = deque()

    def admit(self, rule: str, key: str, now: float, *, exempt: bool = False) -> Admission:
        ident = (rule, key)
        if not exempt:
            reason = self._hold_back_reason(ident, now)
            if reason:
                self._suppressed[ident] = self._suppressed.get(ident, 0) + 1
                return Admission(False, self._suppressed[ident], reason)
            self._sent_times.append(now)
        self._last_sent[ident] = now
        return Admission(True, self._suppressed.pop(ident, 0), "")

    def _hold_back_reason(self, ident: tuple[str, str], now: float) -> str:
        last = self._last_sent.get(ident)
        if last is not None and now - last < self._min_repeat:
            return (
                f"repeat of {ident[0]} within {self._min_repeat:g} s "
                f"(alerts.min_seconds_between_repeats)"
            )
        while self._sent_times and now - self._sent_times[0] >= self._window:
            self._sent_times.popleft()
        if len(self._sent_times) >= self._max_per_window:
            return (
                f"{self._max_per_window} messages already sent in the last {self._window:g} s "
                f"(alerts.max_messages_per_window)"
            )
        return ""
