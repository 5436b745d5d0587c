"""The run store: a run kept in object storage while it trains, so it outlives its host.

A run's checkpoints, logs, metrics and model kept in object storage (or any
fsspec place) while it trains, so that it outlives its host (see docs/launcher.md).

Its settings (config: the `storage:` section), one run's place there (remote), the uploader that
copies the run there from rank 0 (uploader), the lease that keeps one trainer writing it (lease),
and the sync state the uploader records for `fab status` (sync_state). Above checkpoints: the
store holds checkpoints in their layout's names, through their storage seam.
"""
