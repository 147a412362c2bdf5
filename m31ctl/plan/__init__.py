"""Planning: settings schema, layers with sources, recipes and model facts, resolved into one
typed, immutable Plan (resolve.py)."""

from m31ctl.plan.resolve import Plan, PlanRequest, resolve

__all__ = ["Plan", "PlanRequest", "resolve"]
