"""`m31ctl bench`: the serving frontier measured on this host with vLLM's own benchmark, and the
operating point it gives the plan (workloads, figures, frontier, SLO pick, profile layer file).

It may import plan, engine and runtime (the server's endpoint, the benchmark runners); nothing
below the CLI imports it."""
