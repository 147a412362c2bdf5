"""What `doctor` returns and prints: the report's JSON (m31ctl.doctor's report_json) and its table."""

from __future__ import annotations

from dataclasses import dataclass

from m31ctl.cli.output import console, table, text_view
from m31ctl.doctor import DoctorReport, report_json


@dataclass(frozen=True)
class DoctorShown:
    """`doctor`'s result: the checks' report."""

    report: DoctorReport

    def to_json(self) -> dict[str, object]:
        return report_json(self.report)


@text_view(DoctorShown)
def print_doctor(shown: DoctorShown) -> None:
    from rich.text import Text  # lazy: rich is start-up cost that --json never needs

    report = shown.report
    out = console()
    if report.plan is None:
        out.print(Text(f"No plan for this host: {report.plan_error}"))
    else:
        p = report.plan
        out.print(
            f"Plan {p.hash}: recipe {p.recipe.recipe}, variant {p.variant}, profile {p.profile}, "
            f"{p.gpus_needed} GPUs",
            markup=False,
        )
    colors = {"ok": "green", "warn": "yellow", "fail": "red", "skip": "dim"}
    t = table(None, ["check", "status", "finding", "remedy"])
    for r in report.results:
        t.add_row(r.title, Text(r.status, style=colors[r.status]), Text(r.message), Text(r.remedy))
    out.print(t)
    s = report.summary()
    out.print(f"{s['ok']} ok, {s['warn']} warn, {s['fail']} fail, {s['skip']} skip")
