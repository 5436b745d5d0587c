"""Reproducing runs: list every run, read a run's folder, compare two, publish a model and pull it back."""
