"""A training run's checkpoints: their names (layout, the only module that knows them), where
they are kept (storage: a local directory or an fsspec URL, behind one seam), their manifests,
the checkpointer, where a run resumes (recovery) and its one writer (lock).

Nothing is imported here: the host side uses `layout` under a bare python3.
"""
