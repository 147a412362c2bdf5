"""Ports for the servers the tests start: one picker for every test, scripts/loopback.py's (shared
with scripts/pd_group.py, since a script does not import the tests). It picks below the kernel's
ephemeral range, where no outgoing connection takes the port between the pick and the server's
bind, and never twice in one test process (scripts/loopback.py says why)."""

from __future__ import annotations

from scripts.loopback import free_port as free_port
from scripts.loopback import free_ports as free_ports
