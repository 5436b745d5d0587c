"""Fault injection for testing the failure paths on real runs; inert unless CLIPFORGE_FAULTS is set.

CLIPFORGE_FAULTS is a comma-separated list of `nan@STEP` (the images of that step's batch
become NaN, as a corrupt batch or an overflow would make them) and `stall@STEP=SECONDS` (the
step sleeps first, as a hung collective would). STEP counts optimizer steps from 1.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

ENV = "CLIPFORGE_FAULTS"


@dataclass(frozen=True)
class Faults:
    nan_steps: frozenset[int] = frozenset()
    stall_seconds: dict[int, float] = field(default_factory=dict)

    def apply(self, step: int, micro_batches: list) -> list:
        if step in self.stall_seconds:
            time.sleep(self.stall_seconds[step])
        if step in self.nan_steps:
            return [(torch.full_like(images, float("nan")), texts) for images, texts in micro_batches]
        return micro_batches


def faults_from_env(environ=os.environ) -> Faults:
    spec = environ.get(ENV, "").strip()
    if not spec:
        return Faults()
    nan_steps, stalls = set(), {}
    for item in spec.split(","):
        kind, _, where = item.strip().partition("@")
        if kind == "nan":
            nan_steps.add(int(where))
        elif kind == "stall":
            step, _, seconds = where.partition("=")
            stalls[int(step)] = float(seconds)
        else:
            raise ValueError(f"{ENV}: unknown fault {item!r}; use nan@STEP or stall@STEP=SECONDS")
    return Faults(frozenset(nan_steps), stalls)
