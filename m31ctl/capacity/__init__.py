"""Capacity: the pure memory model (memory.py) and a plan's fit and comparison rows (fit.py)."""
