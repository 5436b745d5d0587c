"""CLIPFORGE_FAULTS: parsed into faults that do nothing unless set; `hold@STEP` waits for a stop."""

from __future__ import annotations

import pytest
import torch

from clipforge.train.faults import Faults, faults_from_env


def _batch() -> list:
    return [(torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.long))]


def _never_asked() -> bool:
    raise AssertionError("the stop flag was consulted at a step without a hold")


def test_faults_are_inert_unless_set():
    """No CLIPFORGE_FAULTS: every step's batch passes through untouched, nothing waits."""
    faults = faults_from_env({})
    batch = _batch()
    assert faults == Faults()
    assert all(faults.apply(step, batch, _never_asked) is batch for step in range(1, 20))


def test_hold_waits_for_the_stop_request_then_goes_on():
    """`hold@3`: step 3 goes on only once a stop has been requested, with its batch unchanged;
    the other steps never look at the stop flag."""
    faults = faults_from_env({"CLIPFORGE_FAULTS": "hold@3"})
    answers = iter([False, False, True])  # a stop requested while the step was held
    asked = []

    def stop_requested() -> bool:
        asked.append(True)
        return next(answers)

    batch = _batch()
    assert faults.apply(2, batch, _never_asked) is batch
    assert faults.apply(3, batch, stop_requested) is batch
    assert len(asked) == 3


def test_faults_combine_and_unknown_ones_are_named():
    """Several faults in one list; an unknown one fails naming it and the known kinds."""
    faults = faults_from_env({"CLIPFORGE_FAULTS": "nan@2, stall@4=0.5, hold@6"})
    assert faults == Faults(frozenset({2}), {4: 0.5}, frozenset({6}))
    ((images, _),) = faults.apply(2, _batch(), _never_asked)
    assert torch.isnan(images).all()
    with pytest.raises(ValueError, match=r"'pause@3'.*hold@STEP"):
        faults_from_env({"CLIPFORGE_FAULTS": "pause@3"})
