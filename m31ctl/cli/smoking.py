"""What `smoke` prints: its report's text view (its JSON is SmokeReport.to_json)."""

from __future__ import annotations

import sys

from m31ctl.cli.output import text_view
from m31ctl.redact import redact
from m31ctl.served.smoke import SmokeReport


@text_view(SmokeReport)
def print_smoke(report: SmokeReport) -> None:
    # Redacted line by line: a server's answer (quoted in a failed check, or its model name) may
    # echo the API key it was sent.
    for check in report.checks:
        mark = "FAIL" if check.failed else "ok  "
        sys.stdout.write(redact(f"{mark} {check.id}: {check.message}") + "\n")
    if report.ttft_s is not None:
        rate = f"{report.tokens_per_s:.1f} tokens/s" if report.tokens_per_s else "rate n/a"
        sys.stdout.write(
            redact(
                f"time to first token {report.ttft_s * 1000:.0f} ms, {rate}, "
                f"chat latency {report.latency_s or 0:.2f} s ({report.model} at {report.endpoint})"
            )
            + "\n"
        )
