"""What `doctor` returns and prints: the report's JSON (m31ctl.doctor's report_json) and its table."""

from __future__ import annotations

from dataclasses import dataclass

from m31ctl.cli.output import console, text_view
from m31ctl.cli.screen import print_paragraph, print_table
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
        print_paragraph(out, f"No plan for this host: {report.plan_error}")
    else:
        p = report.plan
        print_paragraph(
            out,
            f"Plan {p.hash}: recipe {p.recipe.recipe}, variant {p.variant}, profile {p.profile}, "
            f"{p.gpus_needed} GPUs",
        )
    colors = {"ok": "green", "warn": "yellow", "fail": "red", "skip": "dim"}
    rows = [
        [Text(r.title), Text(r.status, style=colors[r.status]), Text(r.message), Text(r.remedy)]
        for r in report.results
    ]
    # A check's title is prose, not a name to copy: it may wrap between its words.
    print_table(out, None, ["check", "status", "finding", "remedy"], rows, names=())
    s = report.summary()
    out.print(f"{s['ok']} ok, {s['warn']} warn, {s['fail']} fail, {s['skip']} skip")
