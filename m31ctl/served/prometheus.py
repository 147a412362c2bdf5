"""What a running vLLM reports on /metrics (Prometheus text), read with prometheus_client's own
parser: label values may hold escaped quotes and backslashes, which a hand-written regex got wrong."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from m31ctl.served import http_answers


@dataclass(frozen=True)
class Sample:
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True)
class ServedMetrics:
    """Samples by sample name (a counter's `_total` name, not its family's)."""

    samples: Mapping[str, tuple[Sample, ...]] = field(default_factory=dict)
    problem: str = ""  # why /metrics could not be read (whole or in part), or ""

    def labels(self, name: str) -> Mapping[str, str]:
        """The labels of the first sample of `name` (an info-style gauge carries its facts there)."""
        found = self.samples.get(name)
        return found[0].labels if found else {}

    def total(self, name: str) -> float:
        """The sum over every label set of `name` (a counter's value across models or engines)."""
        return sum(s.value for s in self.samples.get(name, ()))


def parse(text: str) -> ServedMetrics:
    """The samples of Prometheus text. A malformed line costs only itself: the text is read again
    line by line, keeping the lines that parse (the parser stops at its first error, and drops
    the family it was reading)."""
    try:
        return ServedMetrics(_samples(text))
    except ValueError as exc:  # the parser's one error for text that is not Prometheus's format
        problem = f"/metrics is not Prometheus text: {http_answers.glimpse(str(exc))}"
    found: dict[str, tuple[Sample, ...]] = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            try:
                for name, samples in _samples(line + "\n").items():
                    found[name] = found.get(name, ()) + samples
            except ValueError:
                continue
    return ServedMetrics(found, problem)


def _samples(text: str) -> dict[str, tuple[Sample, ...]]:
    # Imported here: prometheus_client's package import is heavy, and only verify reads metrics.
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(Sample(dict(sample.labels), float(sample.value)))
    return {name: tuple(samples) for name, samples in found.items()}


def scrape(client: Any) -> ServedMetrics:
    """GET /metrics from the server `client` talks to."""
    answer = http_answers.fetch(client, "GET", "/metrics", parse=False)
    if answer.status != 200 or answer.problem:
        return ServedMetrics(problem=f"/metrics answered HTTP {answer.status}{answer.evidence()}")
    return parse(answer.body.decode("utf-8", "replace"))
