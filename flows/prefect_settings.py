"""Prefect settings for a run that starts its own temporary API server (no ``PREFECT_API_URL``).

Every step is a flow run with a task run per phase, so the API server works on every step; on a small
machine it competes with the workers for the same cores (``bench/cpu_step.py``). The temporary server
keeps what a run's records need (flow runs, task runs, states, logs, artifacts) and drops what no one
watches on it: automations' triggers, the event stream out, and the stored event feed (task runs are
recorded from the events all the same, a batch of them at a time). The server's transactions take SQLite's
write lock first (``flows.temporary_server``), so that a write beside them does not make the run's own
requests fail and wait 2 s. The client skips the CSRF token fetch that each new client otherwise makes
(once per step flow run); a server's CSRF protection is off by default.

A server of your own (``trellis server up``, or any ``PREFECT_API_URL``) keeps its settings, and any
of these set in the environment wins. ``step_loop_settings`` is for any API: the Prefect settings of the
loop that calls the step flow runs, set in that process only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

TEMPORARY_SERVER_DEFAULTS = {
    # Its telemetry write races the run's first writes on the shared SQLite file ("database is locked").
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # A first temporary server creates its database; on 2 busy cores that can outlast Prefect's 20 s.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_CLIENT_CSRF_SUPPORT_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
    "PREFECT_SERVER_EVENTS_STREAM_OUT_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
    # Its task-run recorder writes up to 200 task-run events at once, at least every second, instead of each on
    # its own: a CPU step 0.91x, its CPU 0.86x (bench/RESULTS.md, 2026-12-07, late night). The write lock taken
    # first keeps these writes from failing the run's own requests (flows.temporary_server).
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
}


def use_lean_temporary_server() -> None:
    """Set the defaults above in this process's environment, which the temporary server inherits, and
    make that server ``flows.temporary_server``'s; call it before Prefect is imported, as Prefect reads
    its client settings then."""
    if "PREFECT_API_URL" in os.environ:
        return
    for name, value in TEMPORARY_SERVER_DEFAULTS.items():
        os.environ.setdefault(name, value)
    from trellis.flows.temporary_server import use_temporary_server

    use_temporary_server()


def on_trellis_temporary_server() -> bool:
    """Whether this process's Prefect client talks to trellis's temporary server (no API URL set, and
    ``use_lean_temporary_server`` put that server in place), whose writes take the SQLite lock first."""
    from prefect.settings import get_current_settings

    server = sys.modules.get("trellis.flows.temporary_server")  # not imported: not in place
    if server is None or get_current_settings().api.url is not None:
        return False
    return isinstance(server.SubprocessASGIServer._instances.get(None), server.TemporaryServer)


# One public root certificate (ISRG Root X1, copied from certifi's bundle): never used to verify anything.
ONE_CERTIFICATE_FILE = Path(__file__).with_name("one_root_certificate.pem")


def step_loop_settings() -> dict[Any, Any]:
    """Prefect settings for the loop that calls a run's step flow runs (``rl_run``), in this process only.

    - No heartbeats: the run's own flow run sends them, and each step flow run's heartbeat thread is
      joined at the step's end, up to a second a step.
    - Over a plain-HTTP API (the temporary server, or ``trellis server up`` on loopback), a CA file of one
      certificate. Prefect's client builds a TLS context from its CA file even for an ``http://`` URL, and a
      subflow's tracking task run makes a new client each time: with certifi's 117 certificates that is
      17 ms of this process's CPU a step, with one 0.4 ms. Over plain HTTP no CA file is read again, so
      one set for this machine (``SSL_CERT_FILE``, which Prefect also reads) is left to other processes.
    """
    from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, get_current_settings

    settings: dict[Any, Any] = {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}
    url = get_current_settings().api.url
    if url is None or url.startswith("http://"):
        settings[PREFECT_API_SSL_CERT_FILE] = str(ONE_CERTIFICATE_FILE)
    return settings
