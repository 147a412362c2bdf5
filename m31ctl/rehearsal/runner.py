"""`m31ctl rehearse`: run a plan's exact layout and rendered commands for real, with vLLM's CPU
build, on a private Docker network; then remove everything it made, even on Ctrl-C or failure.

Four steps, one call each into the module that owns it: prepare (prepared.py: the plan's twin
derived and rendered by the normal code, read back as pods, and what the later steps need of it,
read once), run the pods (cluster.py: the Secrets' values, the network, the Services'
forwarders, the volumes, then the emulated kubelet, kubelet.py, which starts the pods and
watches until the serving pod is ready), judge (proofs.py: its table of proofs in order, through
the serving pod, then a P/D plan's pair, pairing.py, then a rollout, rollout_proof.py), and the
result (result.py). Around them: the derived image and the tiny model (provision.py), the
session's id, signals and cleanup (session.py). Docker is reached over the program's one
client, m31ctl/runtime/engine_api.py: the kubelet's own verbs for a pod's container, the
rehearsal's others in docker_verbs.py.
"""

from __future__ import annotations

import time
from typing import Any

from m31ctl.plan import Plan
from m31ctl.rehearsal import cluster, proofs
from m31ctl.rehearsal.prepared import prepare
from m31ctl.rehearsal.provision import ensure_image, ensure_model
from m31ctl.rehearsal.result import RehearsalResult, Run, assemble
from m31ctl.rehearsal.session import (
    Options,
    Progress,
    clean_up,
    new_session,
    sigterm_interrupts,
)
from m31ctl.runtime import engine_api

# The longest one Engine API request may take on a loaded two-core host (the `docker` CLI calls
# it replaced had 20-120 s each); the build, the model and the waits give their own.
REQUEST_TIMEOUT_S = 120.0


def rehearse(
    plan: Plan,
    options: Options,
    client: Any | None = None,
    progress: Progress = lambda _: None,
) -> RehearsalResult:
    """Rehearse `plan`: refused layouts raise before any container (InputError, exit 2); the
    result says whether it served. Everything made is removed unless options.keep, also when
    this raises (Ctrl-C included). Engine errors end it through engine_api's one boundary (lost
    engine: 3; refused request: 6). The steps in order, each a call into the module that owns it:
    the plan prepared, the image, then under one session's label the model, the cluster's
    Secrets, the pods run until the serving one is ready, the proofs judged, the cleanup, the
    result."""
    started = time.monotonic()
    prepared = prepare(plan, options)
    with engine_api.engine_boundary("rehearsing"):
        client = client or engine_api.connect(timeout=REQUEST_TIMEOUT_S)
        image = ensure_image(client, options.base_image)
        timings = {"image_s": round(time.monotonic() - started, 1)}
        with sigterm_interrupts():
            session = new_session()
            run = Run([], "interrupted", None)
            try:
                model_started = time.monotonic()
                ensure_model(client, image, prepared.model_dir, prepared.twin.moe, session)
                timings["model_s"] = round(time.monotonic() - model_started, 1)
                progress(f"rehearsing {prepared.layout}")
                with cluster.secret_values(prepared.manifest) as keys:
                    kubelet, run = cluster.run_pods(client, prepared, session, keys, options, progress)
                    run = proofs.judge(kubelet, prepared, run, options, progress)
                nodes = cluster.node_outcomes(kubelet, run.states, run.why is not None)
            finally:
                leftovers = [] if options.keep else clean_up(client, session)
            timings["total_s"] = round(time.monotonic() - started, 1)
            return assemble(prepared, run, nodes, timings, tuple(leftovers), options.keep, session)
