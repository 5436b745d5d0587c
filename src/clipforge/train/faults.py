"""Fault injection for testing the failure paths on real runs; inert unless CLIPFORGE_FAULTS is set.

CLIPFORGE_FAULTS is a comma-separated list of:
- `nan@STEP`: the images of that step's batch become NaN, as a corrupt batch or an overflow
  would make them;
- `stall@STEP=SECONDS`: the step sleeps first, as a hung collective would;
- `hold@STEP`: the step waits until a stop is requested (SIGTERM/SIGINT), then goes on, so the
  stop path checkpoints after it. A test can then stop a run that cannot have ended first, with
  no guess at how fast the machine trains. Without a stop the step waits for ever;
- `wait@STEP=PATH`: the step waits until PATH exists: a test creates it once what must come
  first has happened (e.g. it took the run store down);
- `hold_upload@STEP`: the run store's upload of the checkpoint of that step stops after its first
  file and waits for ever (training goes on): kill the process there for a torn upload;
- `hold_setup`: the set-up, once the process group is up, says so in a line and waits until a
  stop is requested, then goes on: a test stops a run that cannot have started training.
STEP counts optimizer steps from 1.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

ENV = "CLIPFORGE_FAULTS"
log = logging.getLogger("clipforge.train")
HOLD_POLL_SECONDS = 0.05  # how often a held step looks at the stop flag a signal handler sets


@dataclass(frozen=True)
class Faults:
    nan_steps: frozenset[int] = frozenset()
    stall_seconds: dict[int, float] = field(default_factory=dict)
    hold_steps: frozenset[int] = frozenset()
    hold_upload_steps: frozenset[int] = frozenset()
    wait_files: dict[int, str] = field(default_factory=dict)
    hold_setup: bool = False

    def set_up_point(self, stop_requested: Callable[[], bool]) -> None:
        if self.hold_setup:
            log.warning("holding the set-up until a stop is requested (%s=hold_setup)", ENV)
            while not stop_requested():
                time.sleep(HOLD_POLL_SECONDS)

    def apply(self, step: int, micro_batches: list, stop_requested: Callable[[], bool]) -> list:
        if step in self.hold_steps:
            while not stop_requested():
                time.sleep(HOLD_POLL_SECONDS)
        if step in self.wait_files:
            while not os.path.exists(self.wait_files[step]):
                time.sleep(HOLD_POLL_SECONDS)
        if step in self.stall_seconds:
            time.sleep(self.stall_seconds[step])
        if step in self.nan_steps:
            return [
                (torch.full_like(images, float("nan")), texts) for images, texts in micro_batches
            ]
        return micro_batches

    def after_first_uploaded_file(self, step: int) -> None:
        if step in self.hold_upload_steps:
            threading.Event().wait()


def faults_from_env(environ=os.environ) -> Faults:
    spec = environ.get(ENV, "").strip()
    if not spec:
        return Faults()
    nan_steps, stalls, holds, upload_holds, waits = set(), {}, set(), set(), {}
    hold_setup = False
    for item in spec.split(","):
        kind, _, where = item.strip().partition("@")
        if kind == "hold_setup":
            hold_setup = True
        elif kind == "nan":
            nan_steps.add(int(where))
        elif kind == "stall":
            step, _, seconds = where.partition("=")
            stalls[int(step)] = float(seconds)
        elif kind == "hold":
            holds.add(int(where))
        elif kind == "hold_upload":
            upload_holds.add(int(where))
        elif kind == "wait":
            step, _, path = where.partition("=")
            waits[int(step)] = path
        else:
            raise ValueError(
                f"{ENV}: unknown fault {item!r}; use nan@STEP, stall@STEP=SECONDS, hold@STEP, "
                f"wait@STEP=PATH, hold_upload@STEP or hold_setup"
            )
    return Faults(
        frozenset(nan_steps), stalls, frozenset(holds), frozenset(upload_holds), waits, hold_setup
    )
