"""Small helpers with one home each.

Retry back-off, an exception's first line, a value as an error message quotes it, waiting for a
server to answer, durations, a run's step counts, the ranks a node runs now, reading the typed
records' JSON files, and nested dicts as dotted keys.

Standard library only, and cheap to import: the GPU host side (clipforge.launcher.host) uses it
under the host's own python3, and every stage imports it.
"""

from __future__ import annotations

import json
import os
import reprlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# Set by a node's supervisor (clipforge.launcher.host.supervisor) for an attempt on fewer GPUs
# than the run was planned with: how many ranks this node runs now. train.ranks_per_node keeps the
# planned number, so the params, and the run id that fingerprints them, stay the run's own.
RANKS_NOW_ENV = "CLIPFORGE_RANKS_PER_NODE"


def backoff_seconds(attempt: int, base_seconds: float, max_seconds: float | None = None) -> float:
    """The wait before retry `attempt` (1-based) of exponential back-off: base, 2 base, 4 base...,
    at most `max_seconds` when given."""
    delay = base_seconds * 2 ** (attempt - 1)
    return delay if max_seconds is None else min(delay, max_seconds)


def first_line(exc: BaseException) -> str:
    """The informative line of an exception's message: its first non-blank line, or the one after
    a heading that ends in `:` (torch's loader errors start so); its type's name when it has no
    message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return lines[1]
    return lines[0] if lines else type(exc).__name__


# The most of a value an error message quotes: a message is one line a person reads, whatever the
# value (a 10 MB string, a YAML alias bomb whose full repr would not fit in memory).
MAX_SHOWN_CHARS = 200


class _ShortRepr(reprlib.Repr):
    """reprlib cuts containers and strings as it goes, so the cost is bounded by its limits, not
    by the value."""

    def __init__(self) -> None:
        super().__init__()  # its limits set one by one: Repr() takes none before Python 3.12
        self.maxlevel, self.maxstring, self.maxother = 4, MAX_SHOWN_CHARS, MAX_SHOWN_CHARS
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = 20

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 600:  # repr() refuses ints over 4300 digits; none needs showing whole
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHORT = _ShortRepr()


def short_repr(value: object, max_chars: int = MAX_SHOWN_CHARS) -> str:
    """repr(value) for an error message: at most `max_chars` characters, ending in `...` where
    cut, computed without building the whole repr."""
    text = _SHORT.repr(value)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def exception_summary(exc: BaseException, max_chars: int = 300) -> str:
    """`Type: first line`, at most `max_chars`: what a status file or a log line says of a
    failure."""
    line = first_line(exc)
    text = type(exc).__name__ if line == type(exc).__name__ else f"{type(exc).__name__}: {line}"
    return text[:max_chars]


def wait_until_answering(
    url: str,
    timeout_seconds: float,
    alive: Callable[[], bool] | None = None,
    poll_seconds: float = 0.5,
) -> bool:
    """True once an HTTP GET of `url` answers; False after `timeout_seconds`, or at once when
    `alive()` (the server's process) says it is gone.

    Self-contained (its imports are inside): the launcher also runs its source on a GPU host,
    whose run checkout, of the run's own commit, need not hold this module."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_seconds
    while alive is None or alive():
        try:
            urllib.request.urlopen(url, timeout=5)
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_seconds)
    return False


def wait_script(url: str, timeout_seconds: float) -> str:
    """A `python -c` program that waits as wait_until_answering does (exit 0: it answered, 1: not),
    made of that function's own source: for a host whose checkout need not hold this module."""
    import inspect

    return (
        "from __future__ import annotations\n"
        + inspect.getsource(wait_until_answering)
        + f"raise SystemExit(0 if wait_until_answering({url!r}, {timeout_seconds!r}) else 1)\n"
    )


def format_duration(seconds: float) -> str:
    """`1h02m03s`, or `2m03s` under an hour; a negative duration is `0m00s`."""
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def steps_per_epoch(num_samples: int, global_batch_size: int) -> int:
    """Full global batches per epoch: the remainder of an epoch is dropped, as usual (0 when the
    batch is larger than the data; the train stage refuses that)."""
    return num_samples // global_batch_size


def total_steps(max_steps: int | None, epochs: int, steps_per_epoch: int) -> int:
    """The optimizer steps of a run: `train.max_steps` when set, else the epochs' steps."""
    return max_steps or epochs * steps_per_epoch


def ranks_per_node_now(planned: int, environ: Mapping[str, str] = os.environ) -> int:
    """The ranks this node runs: `planned` (train.ranks_per_node) unless its supervisor said
    fewer (RANKS_NOW_ENV). ValueError for a value that is not 1..planned (a supervisor's bug)."""
    value = environ.get(RANKS_NOW_ENV)
    if value is None:
        return planned
    if not value.isdigit() or not 1 <= int(value) <= planned:
        raise ValueError(f"{RANKS_NOW_ENV}={value!r}: expected 1..{planned} (train.ranks_per_node)")
    return int(value)


def record_json(text: str | bytes, source: str, error: type[Exception]) -> object:
    """A typed record's file parsed as JSON; `error` (the record's own type) names the file when
    it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(
            f"{source}: not JSON ({exc.msg} at line {exc.lineno}); a torn write or a hand edit"
        ) from None


def typed_fields(
    raw: Mapping[str, object],
    types: Mapping[str, type | tuple[type, ...]],
    source: str,
    error: type[Exception],
) -> dict[str, object]:
    """The keys of `types` that `raw` holds, each checked against its JSON types; `error` (the
    record's own type) names the field at fault. A bool is an int to isinstance: a count given
    as true is damage, not 1, unless bool is among the field's types."""
    values: dict[str, object] = {}
    for key, kinds in types.items():
        if key not in raw:
            continue
        value = raw[key]
        allowed = kinds if isinstance(kinds, tuple) else (kinds,)
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise error(f"{source}: {key} is {value!r}, of the wrong type")
        values[key] = value
    return values


def read_record_file(path: str | Path, parse: Callable[[str, str], T]) -> T | None:
    """`parse(text, path)` of the file at `path`; None when there is none (yet)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    return parse(text, str(path))


def flatten(value: object, prefix: str = "") -> dict:
    """Nested dicts as one level of dotted keys."""
    if isinstance(value, dict):
        flat: dict = {}
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: value}
