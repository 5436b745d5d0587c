"""Training-step rules: loss spike and non-finite loss / gradient norm. Pure: no I/O, no clock.

Every rank can run them on the same (globally reduced) numbers and reach the same verdict,
so a skip or a stop is decided identically everywhere without an extra collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from clipforge.alerts import events
from clipforge.alerts.config import AlertsConfig
from clipforge.alerts.events import Finding


class NonFiniteTrainingError(RuntimeError):
    """Raised by the training loop when `StepVerdict.stop` is set."""


@dataclass(frozen=True)
class StepVerdict:
    """What the loop must do with the current step."""

    skip: bool
    """The loss (or gradient norm) is NaN or infinite. From `check_loss`: do not run backward
    and the optimizer step for this batch, go to the next one. From `check_update`: the
    optimizer already ran (under fp16 DeepSpeed discards such an update itself); go on, the
    streak counter decides when to stop."""
    stop: bool
    """`max_consecutive_nonfinite` steps in a row were non-finite: raise
    `NonFiniteTrainingError(verdict.message)`."""
    loss_spike: bool
    """The loss is above k x its moving average (informational: the step is still applied)."""
    consecutive_nonfinite: int
    total_nonfinite: int
    message: str
    """Why skip/stop/spike, for the log and the error; empty for a normal step."""
    findings: tuple[Finding, ...] = ()


class LossSpikeRule:
    """Loss above `factor` x its exponential moving average, once `warmup_steps` losses are seen.

    Spiking losses are kept out of the average: otherwise a sustained explosion would raise its
    own baseline and look normal after a few dozen steps. The alert fires when a spike starts,
    not on every spiking step; it re-arms once a loss is back under the threshold.
    """

    def __init__(self, *, factor: float, beta: float, warmup_steps: int) -> None:
        self._factor = factor
        self._beta = beta
        self._warmup_steps = warmup_steps
        self._average: float | None = None
        self._num_seen = 0
        self._in_spike = False

    @property
    def average(self) -> float | None:
        return self._average

    def observe(self, loss: float) -> tuple[bool, Finding | None]:
        """Feed one finite loss. Returns (is spike, finding when a spike starts)."""
        average = self._average if self._num_seen >= self._warmup_steps else None  # armed
        # A contrastive loss is >= 0; a non-positive average gives no meaningful ratio.
        if average is not None and average > 0 and loss > self._factor * average:
            finding = None
            if not self._in_spike:
                finding = Finding(
                    events.LOSS_SPIKE,
                    "warning",
                    f"loss {loss:.4g} is {loss / average:.1f}x its moving average "
                    f"{average:.4g} (threshold {self._factor:g}x)",
                    details={"loss": loss, "moving_average": average},
                )
            self._in_spike = True
            return True, finding
        self._in_spike = False
        self._num_seen += 1
        if self._average is None:
            self._average = loss
        else:
            self._average = self._beta * self._average + (1 - self._beta) * loss
        return False, None


class NonFiniteRule:
    """Counts non-finite steps; a step only counts as good once its update completed finite."""

    def __init__(self, *, max_consecutive: int) -> None:
        self._max_consecutive = max_consecutive
        self.consecutive = 0
        self.total = 0

    def observe(self, step: int, what: str, value: float | None) -> tuple[bool, list[Finding]]:
        """Feed the loss or the gradient norm of `step`. Returns (is non-finite, findings)."""
        if value is None or math.isfinite(value):
            return False, []
        self.consecutive += 1
        self.total += 1
        findings = [
            Finding(
                events.NON_FINITE,
                "warning",
                f"{what} is {value} at step {step} ({self.consecutive} in a row, "
                f"{self.total} in this run; the run stops after {self._max_consecutive} in a row)",
                details={what: value, "consecutive": self.consecutive, "total": self.total},
            )
        ]
        if self.should_stop:
            findings.append(Finding(events.NON_FINITE_STOP, "critical", self.stop_message(step)))
        return True, findings

    def step_completed(self) -> None:
        self.consecutive = 0

    @property
    def should_stop(self) -> bool:
        return self.consecutive >= self._max_consecutive

    def stop_message(self, step: int) -> str:
        return (
            f"{self.consecutive} consecutive non-finite steps (last at step {step}, "
            f"alerts.max_consecutive_nonfinite={self._max_consecutive}); the run stops. "
            f"Lower train.lr (or lengthen train.warmup_steps) in params.yaml and rerun, or check "
            f"the data."
        )


class StepRules:
    """The two step rules together, in the order the loop meets the numbers.

    `check_loss` comes after the forward pass and before backward, so a non-finite loss can be
    skipped before it touches the weights; `check_update` comes after the optimizer step, with
    the global gradient norm. A step counts as good (resetting the non-finite streak) only when
    both were finite.
    """

    def __init__(self, config: AlertsConfig) -> None:
        self.spike = LossSpikeRule(
            factor=config.loss_spike_factor,
            beta=config.loss_ema_beta,
            warmup_steps=config.loss_spike_warmup_steps,
        )
        self.nonfinite = NonFiniteRule(max_consecutive=config.max_consecutive_nonfinite)

    def check_loss(self, step: int, loss: float) -> StepVerdict:
        bad, findings = self.nonfinite.observe(step, "loss", loss)
        if bad:
            return self._verdict(step, skip=True, spike=False, findings=findings)
        spike, finding = self.spike.observe(loss)
        return self._verdict(step, skip=False, spike=spike, findings=[finding] if finding else [])

    def check_update(self, step: int, grad_norm: float | None) -> StepVerdict:
        bad, findings = self.nonfinite.observe(step, "gradient norm", grad_norm)
        if not bad:
            self.nonfinite.step_completed()
        return self._verdict(step, skip=bad, spike=False, findings=findings)

    def _verdict(
        self, step: int, *, skip: bool, spike: bool, findings: list[Finding]
    ) -> StepVerdict:
        stop = skip and self.nonfinite.should_stop
        if stop:
            message = self.nonfinite.stop_message(step)
        else:
            message = "; ".join(f.message for f in findings if f.rule != events.NON_FINITE_STOP)
        if spike and not message:
            message = f"loss spike continues at step {step}"
        return StepVerdict(
            skip=skip,
            stop=stop,
            loss_spike=spike,
            consecutive_nonfinite=self.nonfinite.consecutive,
            total_nonfinite=self.nonfinite.total,
            message=message,
            findings=tuple(findings),
        )
