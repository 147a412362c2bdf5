"""Capacity: the pure memory model (model.py) and a plan's fit and comparison rows (fit.py)."""
