"""The run store: a run's checkpoints, logs, metrics and model kept in object storage (or any
fsspec place) while it trains, so that it outlives its host (see docs/launcher.md)."""
