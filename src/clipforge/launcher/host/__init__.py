"""What runs on the GPU host: plan, run directories, supervisor, status, smoke check.

The plan, the run's directories, the supervisor, status, smoke check,
and the list of stored checkpoints that `make down` checks.

Standard library only (tests/launcher/host/test_imports.py holds it to that): on a docker-runtime
host these modules run under the host's own python3, outside the training image, with nothing
but the run's checkout on PYTHONPATH.
"""
