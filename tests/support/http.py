"""HTTP with the standard library only, for a test that asks a server it started (the test runs
in .venv, the servers in vLLM's environment): a request whose answer is its status and body, never
an exception, and a server's /metrics text. scripts/loopback.py's, which scripts/pd_group.py uses
too (a script does not import the tests)."""

from __future__ import annotations

from scripts.loopback import Answer as Answer
from scripts.loopback import metrics_text as metrics_text
from scripts.loopback import request as request
