"""Helpers every test group shares: the checkout as shipped (checkout.py), polling (wait.py)."""
