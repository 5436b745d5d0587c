"""Alerts for long training runs: loss spikes, non-finite steps, GPU health, stalls, lifecycle.

The training loop needs only `AlertsConfig`, `AlertMonitor` and `NonFiniteTrainingError`;
docs/alerts.md describes the rules and how to set up Feishu and Slack webhooks.
"""

from clipforge.alerts.config import AlertsConfig
from clipforge.alerts.events import Alert, DeliveryOutcome, Finding, TextEvent
from clipforge.alerts.gpu import GpuHealthRules, GpuReading
from clipforge.alerts.monitor import AlertMonitor
from clipforge.alerts.rules import NonFiniteTrainingError, StepVerdict
from clipforge.alerts.targets import WebhookTarget, load_targets

__all__ = [
    "Alert",
    "AlertMonitor",
    "AlertsConfig",
    "DeliveryOutcome",
    "Finding",
    "GpuHealthRules",
    "GpuReading",
    "NonFiniteTrainingError",
    "StepVerdict",
    "TextEvent",
    "WebhookTarget",
    "load_targets",
]
