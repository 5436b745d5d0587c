"""Reproducing runs: read a run's folder, repeat a run, compare two runs, publish a model and pull it back."""
