"""The chosen operating point as a plan layer file (`m31ctl plan -f F.yaml`), whose every value
says where it came from: `provenance:` names the measurement, and plan --explain shows it
beside each setting (m31ctl/plan/yamlfile.py reads the key)."""

from __future__ import annotations

import hashlib
import json
import math
import socket
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from m31ctl.hardware import Hardware
from m31ctl.served.figures import Limit, Point

# Pass marks from measured figures get verify's default regression tolerance as headroom: a
# rerun on the same host passes without the mark drifting from what was measured.
HEADROOM = 0.25


def host_fingerprint(hardware: Hardware, machine_id: Path = Path("/etc/machine-id")) -> str:
    """The measured host in a few words: name, a short hash of its machine id (two containers
    may share a name), and its accelerators as the plan saw them."""
    try:
        machine = hashlib.sha256(machine_id.read_bytes().strip()).hexdigest()[:8]
    except OSError:
        machine = None
    devices = f"{hardware.count}x {hardware.product or hardware.vendor}"
    if hardware.driver_version:
        devices += f", driver {hardware.driver_version}"
    return f"{socket.gethostname()} ({'machine ' + machine + ', ' if machine else ''}{devices})"


def provenance(fingerprint: str, when: datetime) -> str:
    return f"measured by m31ctl bench on {fingerprint}, {when.strftime('%Y-%m-%d %H:%M %Z').strip()}"


def pass_marks(point: Point, slo: Sequence[Limit]) -> dict[str, float | int]:
    """verify.* from the point: its load, and marks from its figures (an SLO limit on the same
    figure is the mark instead: it is the contract the point was chosen to meet)."""
    given = {limit.key: limit.value for limit in slo}
    marks: dict[str, float | int] = {
        "concurrency": point.concurrency,
        "requests": point.requests,
        "input_len": max(1, round(point.mean_input_tokens)),
        "output_len": max(1, round(point.mean_output_tokens)),
    }
    for key, measured in (("ttft_p99_ms", point.ttft_p99_ms), ("tpot_p99_ms", point.tpot_p99_ms)):
        if key in given:
            marks[key] = given[key]
        elif measured:
            marks[key] = round(measured * (1 + HEADROOM), 1)
    if point.output_tok_s > 0:
        marks["min_output_throughput"] = round(point.output_tok_s * (1 - HEADROOM), 1)
    if point.spec is not None:
        marks["min_acceptance_length"] = max(1.0, round(point.spec.acceptance_length * (1 - HEADROOM), 2))
    return marks


def profile_yaml(
    point: Point,
    workload: str,
    slo: Sequence[Limit],
    origin: str,
    data_parallel: int = 1,
    notes: Sequence[str] = (),
    max_num_seqs_limit: int | None = None,
) -> str:
    """The layer file's text: serving.max_num_seqs from the point's concurrency (the engine then
    batches no more sequences than were measured; vLLM's limit is per data-parallel rank, which
    the load balancer fills evenly), verify.* from its figures. `max_num_seqs_limit`: the plan's
    runtime limit (Plan.max_num_seqs_limit, e.g. the NVFP4 decode rows): the
    profile never asks for more, whatever concurrency was measured (a plan refuses it anyway)."""
    per_rank = math.ceil(point.concurrency / max(1, data_parallel))
    if max_num_seqs_limit is not None and per_rank > max_num_seqs_limit:
        notes = (*notes, f"serving.max_num_seqs capped from {per_rank} to the layout's runtime limit")
        per_rank = max_num_seqs_limit
    slo_text = ",".join(f"{limit.key}={limit.value:g}" for limit in slo) or "none"
    lines = [
        "# m31ctl bench: the operating point chosen from a measured sweep",
        f"# (workload {workload}, concurrency {point.concurrency}, SLO {slo_text}).",
        "# Use it as a plan layer: m31ctl plan -f THIS.yaml --explain; m31ctl launch -f THIS.yaml",
        # What the choice assumed beyond the measurement (the price): comments, as a layer holds settings.
        *(f"# {line}" for line in notes),
        f"provenance: {json.dumps(origin)}",
        "serving:",
        f"  max_num_seqs: {per_rank}",
        "verify:",
    ]
    lines += [f"  {key}: {json.dumps(value)}" for key, value in pass_marks(point, slo).items()]
    return "\n".join(lines) + "\n"
