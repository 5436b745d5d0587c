"""Alerts for long training runs: loss spikes, non-finite steps, GPU health, stalls, lifecycle.

Import from the module that defines a name (`clipforge.alerts.monitor.AlertMonitor`,
`clipforge.alerts.config.AlertsConfig`...): this package imports nothing, so the params loader,
which every stage runs, pulls in `config` alone and not the monitor with its threads and NVML.
The training loop needs only `AlertsConfig`, `AlertMonitor` and `NonFiniteTrainingError`;
docs/alerts.md describes the rules and how to set up Feishu and Slack webhooks.
"""
