"""clipforge: reproducible CLIP training, from a laptop CPU to a GPU cluster.

Stages: `python -m clipforge.data`, `python -m clipforge.train`, `python -m clipforge.eval`.
"""

__version__ = "0.1.0"
