"""Eval stage: retrieval recall of any open_clip model on a Chinese-CLIP-layout test set.

`python -m clipforge.eval` (stage.py: the CLI and its files); core.py encodes and scores,
loading.py loads a model as a user of open_clip would. The recall itself is clipforge.metrics.
"""
