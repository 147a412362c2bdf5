"""What a measured point costs, from a rental price and the point's own throughput. Pure.

The deployment's hourly cost is the price times what it rents: a GPU-hour price times the plan's
GPUs, or a node-hour price times the nodes its layout spans (a node is paid whole, whatever share
of its GPUs the plan uses). At a point the deployment processes its measured tokens per second
for the whole hour, so

    cost per million output tokens = hourly cost / (output tok/s x 3600) x 1e6
    cost per million total tokens  = hourly cost / ((input + output) tok/s x 3600) x 1e6
    total tokens per unit of money = (input + output) tok/s x 3600 / hourly cost

This is the price of the GPUs while they are busy at that concurrency: it leaves out idle hours
(traffic below the point's load), power and cooling, networking, storage and operations, which a
total-cost-of-ownership figure (the launch post's tokens per dollar of TCO) includes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from m31ctl.deployment import Deployment
from m31ctl.errors import InputError
from m31ctl.served.figures import Objective, Point

SECONDS_PER_HOUR = 3600
PER_MILLION = 1_000_000


class Price(NamedTuple):
    """A rental price: `amount` of `currency` per GPU-hour or per node-hour (`unit`)."""

    amount: float
    unit: str  # a key of UNITS
    currency: str

    def describe(self) -> str:
        return f"{self.amount:g} {self.currency} per {UNITS[self.unit]}"


# unit -> how the price reads
UNITS = {"gpu": "GPU-hour", "node": "node-hour"}


def parse_price(gpu_hour: float | None, node_hour: float | None, currency: str) -> Price | None:
    """--gpu-hour / --node-hour (one of them, or none: no cost) and --currency."""
    given = [(unit, value) for unit, value in (("gpu", gpu_hour), ("node", node_hour)) if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InputError(
            "--gpu-hour and --node-hour are both given", hint="price the GPUs or the nodes, not both"
        )
    unit, amount = given[0]
    flag = f"--{unit}-hour"
    if not (0 < amount < math.inf):
        raise InputError(f"{flag} {amount:g} is not a positive price", hint=f"e.g. {flag} 2.50")
    code = currency.strip()
    if not code or not code.replace("_", "").isalnum() or len(code) > 8:
        raise InputError(f"--currency {currency!r} is not a currency code", hint="e.g. --currency USD")
    return Price(float(amount), unit, code)


class Costing(NamedTuple):
    """A price applied to a deployment of `gpus` GPUs on `nodes` nodes."""

    price: Price
    gpus: int
    nodes: int

    @property
    def rented(self) -> int:
        """What the price is paid for: the plan's GPUs, or the nodes its layout spans."""
        return max(1, self.gpus if self.price.unit == "gpu" else self.nodes)

    @property
    def per_hour(self) -> float:
        """The deployment's cost per hour."""
        return self.price.amount * self.rented

    def per_million_output(self, point: Point) -> float | None:
        return self._per_million(point.output_tok_s)

    def per_million_total(self, point: Point) -> float | None:
        return self._per_million(point.total_tok_s)

    def tokens_per_unit(self, point: Point) -> float | None:
        """Input and output tokens one unit of the currency buys at the point."""
        if point.total_tok_s <= 0 or not point.complete:
            return None
        return point.total_tok_s * SECONDS_PER_HOUR / self.per_hour

    def _per_million(self, tok_s: float) -> float | None:
        if tok_s <= 0:
            return None
        return self.per_hour / (tok_s * SECONDS_PER_HOUR) * PER_MILLION

    def figures(self, point: Point) -> dict[str, float | None]:
        """The point's three figures, rounded for the report (None: nothing was measured)."""

        def rounded(value: float | None) -> float | None:
            return None if value is None else float(f"{value:.6g}")

        return {
            "per_million_output": rounded(self.per_million_output(point)),
            "per_million_total": rounded(self.per_million_total(point)),
            "tokens_per_unit": rounded(self.tokens_per_unit(point)),
        }

    def to_json(self, points: Sequence[Point], assumed_at: str) -> dict[str, Any]:
        return {
            "price": self.price.amount,
            "unit": self.price.unit,
            "currency": self.price.currency,
            "gpus": self.gpus,
            "nodes": self.nodes,
            "per_hour": round(self.per_hour, 6),
            "assumed_at": assumed_at,
            "formula": FORMULA,
            "points": {str(p.concurrency): self.figures(p) for p in points},
        }

    def objective(self) -> Objective:
        """The SLO pick by cost: the cheapest million output tokens among the points that meet
        it. With one price for every point the cheapest million total tokens is the highest
        per-GPU throughput, the default objective; output tokens are what a reply is made of."""

        def rank(point: Point) -> float:
            value = self.per_million_output(point)
            return -value if value is not None else -math.inf

        return Objective(
            "lowest cost per million output tokens",
            rank,
            self.per_million_output,
            f"{self.price.currency} per million output tokens",
            "above",
        )


FORMULA = (
    "hourly cost = price x GPUs (per GPU-hour) or x nodes (per node-hour); cost per million tokens "
    "= hourly cost / (measured tok/s x 3600) x 1e6; excludes idle time, power, networking, storage "
    "and operations (a TCO figure includes them)"
)


def deployment_costing(deployment: Deployment, price: Price | None) -> Costing | None:
    """The price applied to the GPUs and nodes that serve the deployment (a P/D group's roles
    together), or None (no price given)."""
    if price is None:
        return None
    return Costing(price, deployment.serving_gpus, deployment.serving_nodes)


def costing_from_json(data: Any) -> Costing | None:
    """A report's recorded cost section back as a Costing (None when it has none or it is malformed)."""
    if not isinstance(data, dict):
        return None
    try:
        price = Price(float(data["price"]), str(data["unit"]), str(data["currency"]))
        if price.unit not in UNITS or not price.amount > 0:
            return None
        return Costing(price, int(data["gpus"]), int(data["nodes"]))
    except (KeyError, TypeError, ValueError):
        return None
