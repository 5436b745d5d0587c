"""Training-health rules: what a run's numbers say that its process does not.

What a run's numbers say that its process does not. Pure: numbers in,
findings out; no I/O, no clock, no torch.

A launcher sees a process that runs; these rules see a model that has stopped learning:

- **temperature**: CLIP learns its softmax temperature as `logit_scale` (the inverse
  temperature, capped at `train.max_logit_scale`). Pinned at the cap for a while, the logits
  are as sharp as allowed and the loss keeps pushing: a known sign of instability (open_clip's
  runs that later diverge sit at 100). Falling to `alerts.logit_scale_floor`, the similarities
  are washed out: the model no longer tells pairs apart.
- **chance accuracy**: in-batch contrastive accuracy (does each image pick its own caption among
  the B of its batch, and back) starts near chance, 1/B. Still below
  `chance_accuracy_factor` / B after `chance_accuracy_warmup_steps`, the model learns nothing:
  broken labels, shuffled captions, a frozen tower, a learning rate of zero.
- **recall decline**: validation recall (mean of R@1/5/10 both ways on the validation gallery)
  lower than the validation before, `recall_decline_validations` times in a row: overfitting
  or a run that went off the rails without a NaN.

Readings come when the loop already reads the device (a log interval, a validation), so the
rules cost no host synchronisation of their own. Each condition must hold for
`health_patience_logs` readings in a row (recall: K validations) before it alerts, and it
alerts once per episode; it re-arms when the condition has ended.
"""

from __future__ import annotations

from dataclasses import dataclass

from clipforge.alerts import events
from clipforge.alerts.config import AlertsConfig
from clipforge.alerts.events import Finding


class _Episode:
    """A condition that must hold `patience` readings in a row; reports its start once."""

    def __init__(self, patience: int) -> None:
        self._patience = patience
        self._count = 0
        self._fired = False

    def observe(self, holds: bool) -> bool:
        """True exactly once per episode: when the condition has held `patience` times."""
        if not holds:
            self._count, self._fired = 0, False
            return False
        self._count += 1
        if self._count >= self._patience and not self._fired:
            self._fired = True
            return True
        return False


class TemperatureRule:
    def __init__(self, *, pinned_fraction: float, floor: float, patience: int) -> None:
        self._pinned_fraction = pinned_fraction
        self._floor = floor
        self._pinned = _Episode(patience)
        self._collapsed = _Episode(patience)

    def observe(self, step: int, logit_scale: float, cap: float) -> list[Finding]:
        findings = []
        if self._pinned.observe(logit_scale >= self._pinned_fraction * cap):
            findings.append(
                Finding(
                    events.TEMPERATURE_PINNED,
                    "warning",
                    f"logit scale {logit_scale:.4g} has sat at its cap train.max_logit_scale="
                    f"{cap:g} (>= {self._pinned_fraction:g} of it) for the last readings up to "
                    f"step {step}: the logits are as sharp as allowed; watch the loss for a "
                    f"divergence, lower train.lr or the cap",
                    details={"logit_scale": logit_scale, "cap": cap},
                )
            )
        if self._collapsed.observe(logit_scale <= self._floor):
            findings.append(
                Finding(
                    events.TEMPERATURE_COLLAPSED,
                    "warning",
                    f"logit scale {logit_scale:.4g} fell to alerts.logit_scale_floor="
                    f"{self._floor:g} or below (CLIP starts at 14.3): similarities are washed "
                    f"out and pairs no longer stand apart; check the learning rate and the data",
                    details={"logit_scale": logit_scale, "floor": self._floor},
                )
            )
        return findings


class ChanceAccuracyRule:
    def __init__(self, *, factor: float, warmup_steps: int, patience: int) -> None:
        self._factor = factor
        self._warmup_steps = warmup_steps
        self._episode = _Episode(patience)

    def observe(self, step: int, accuracy: float, batch_size: int) -> list[Finding]:
        chance = 1.0 / batch_size
        near_chance = step > self._warmup_steps and accuracy < self._factor * chance
        if not self._episode.observe(near_chance):
            return []
        return [
            Finding(
                events.ACCURACY_AT_CHANCE,
                "warning",
                f"in-batch contrastive accuracy {accuracy:.3g} at step {step} is below "
                f"{self._factor:g} x chance (1/{batch_size} = {chance:.3g}) after "
                f"alerts.chance_accuracy_warmup_steps={self._warmup_steps}: the model is not "
                f"learning to match pairs. Check the captions belong to their images, the "
                f"learning rate, and frozen towers",
                details={"accuracy": accuracy, "batch_size": batch_size, "chance": chance},
            )
        ]


class RecallDeclineRule:
    def __init__(self, *, num_validations: int) -> None:
        self._num_validations = num_validations
        self._previous: float | None = None
        self._history: list[tuple[int, float]] = []
        self._episode = _Episode(num_validations)

    def observe(self, step: int, recall: float) -> list[Finding]:
        falling = self._previous is not None and recall < self._previous
        self._previous = recall
        self._history = (self._history + [(step, recall)])[-(self._num_validations + 1) :]
        if not self._episode.observe(falling):
            return []
        trail = " -> ".join(f"{r:.4g} (step {s})" for s, r in self._history)
        return [
            Finding(
                events.RECALL_DECLINING,
                "warning",
                f"validation mean recall fell {self._num_validations} validations in a row: "
                f"{trail} (alerts.recall_decline_validations={self._num_validations}). "
                f"Overfitting or a run going wrong without a NaN: compare with the loss curves; "
                f"the best checkpoint so far is older",
                details={"recall": recall, "history": [r for _, r in self._history]},
            )
        ]


@dataclass(frozen=True)
class HealthReading:
    """What the loop hands over at a log interval (every value already read from the device)."""

    step: int
    logit_scale: float | None = None
    max_logit_scale: float | None = None
    accuracy: float | None = None
    """Mean of image->text and text->image top-1 accuracy over the rank's in-batch pairs."""
    batch_size: int | None = None
    """The pairs that accuracy was measured over (chance is 1/batch_size)."""


class HealthRules:
    """The three rules, each on or off by its `alerts.*_alerts` switch."""

    def __init__(self, config: AlertsConfig) -> None:
        patience = config.health_patience_logs
        self.temperature = (
            TemperatureRule(
                pinned_fraction=config.logit_scale_pinned_fraction,
                floor=config.logit_scale_floor,
                patience=patience,
            )
            if config.temperature_alerts
            else None
        )
        self.accuracy = (
            ChanceAccuracyRule(
                factor=config.chance_accuracy_factor,
                warmup_steps=config.chance_accuracy_warmup_steps,
                patience=patience,
            )
            if config.chance_accuracy_alerts
            else None
        )
        self.recall = (
            RecallDeclineRule(num_validations=config.recall_decline_validations)
            if config.recall_decline_alerts
            else None
        )

    def observe(self, reading: HealthReading) -> list[Finding]:
        findings: list[Finding] = []
        if (
            self.temperature
            and reading.logit_scale is not None
            and reading.max_logit_scale is not None
        ):
            findings += self.temperature.observe(
                reading.step, reading.logit_scale, reading.max_logit_scale
            )
        if self.accuracy and reading.accuracy is not None and reading.batch_size:
            findings += self.accuracy.observe(reading.step, reading.accuracy, reading.batch_size)
        return findings

    def observe_validation(self, step: int, mean_recall: float | None) -> list[Finding]:
        if self.recall is None or mean_recall is None:
            return []
        return self.recall.observe(step, mean_recall)
