"""clipforge's Kubernetes infrastructure: a Pulumi program (``infra/__main__.py``) and the tools that
``make up`` / ``make down`` run around it.

Modules here must not import torch, nor any part of clipforge that does: they run on the user's
laptop, in CI and on the worker image alike.
"""
