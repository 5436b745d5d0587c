"""A training run's checkpoints: their names, places, manifests, writer and resume point.

Their names (layout, the only module that knows them), the places
they are kept (places: a local directory or an fsspec URL, behind one CheckpointStorage seam),
their manifests, the checkpointer, where a run resumes from (resume: this disk or the run store's
checkpoints, given as a CheckpointStorage), its one writer on this disk (lock) and the disk's room
and permissions (disk). Nothing here knows the run store or the train stage.

Nothing is imported here: the host side uses `layout` under a bare python3.
"""
