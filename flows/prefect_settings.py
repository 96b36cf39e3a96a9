"""Prefect settings for a run that starts its own temporary API server (no ``PREFECT_API_URL``).

Every step is a flow run with a task run per phase, so the API server works on every step; on a small
machine it competes with the workers for the same cores (``bench/cpu_step.py``). The temporary server
keeps what a run's records need (flow runs, task runs, states, logs, artifacts) and drops what no one
watches on it: automations' triggers, the event stream out, and the stored event feed (task runs are
recorded from the events all the same, a batch of them at a time). The server's transactions take SQLite's write lock first
(``flows.temporary_server``), so that a write beside them does not make the run's own requests fail and
wait 2 s. The client skips the CSRF token fetch that each new client
otherwise makes (once per step flow run); a server's CSRF protection is off by default.

A server of your own (``trellis server up``, or any ``PREFECT_API_URL``) keeps its settings, and any
of these set in the environment wins.
"""

from __future__ import annotations

import os

TEMPORARY_SERVER_DEFAULTS = {
    # Its telemetry write races the run's first writes on the shared SQLite file ("database is locked").
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # A first temporary server creates its database; on 2 busy cores that can outlast Prefect's 20 s.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_CLIENT_CSRF_SUPPORT_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
    "PREFECT_SERVER_EVENTS_STREAM_OUT_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
    # Its task-run recorder writes up to 200 task-run events at once, at least every second, instead of each on its
    # own: a CPU step 0.91x, its CPU 0.86x (bench/RESULTS.md, 2026-12-08). The write lock taken first keeps
    # these writes from failing the run's own requests (flows.temporary_server).
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
