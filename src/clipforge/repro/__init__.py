"""Reproducing runs: read a run's folder, compare two runs, publish a model and pull it back."""
