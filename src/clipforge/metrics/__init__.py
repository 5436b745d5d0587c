"""Metrics the train and eval stages both report, in leaf modules that import no stage.

Metrics the train and eval stages both report, in leaf modules that import no stage: editing
the eval stage does not make a training run stale."""
