"""What talks to a running server: `m31ctl smoke`, `m31ctl verify` and `m31ctl bench` (the sweep,
its figures, workloads, cost, compare and profile), the defensive reading of the server's answers
(http_answers.py) and of its /metrics (prometheus.py, spec_decode.py).

It may import plan, deployment, capacity, engine and runtime (the server's endpoint and recorded
plan, the benchmark launchers); only the CLI and the rehearsal import it, never runtime or doctor
(tests/test_architecture.py)."""
