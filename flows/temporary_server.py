"""The temporary Prefect API server a run starts when no ``PREFECT_API_URL`` is set: Prefect's own
(``SubprocessASGIServer``), with one change to how it writes its SQLite database.

Prefect opens the transactions of its API routes as SQLite ``DEFERRED`` transactions: one that reads
before it writes (``POST /task_runs/`` reads the flow run, then inserts) cannot take the write lock
when another connection committed in between, and SQLite refuses it at once (``SQLITE_BUSY_SNAPSHOT``;
its busy timeout does not apply). The server answers 503, and Prefect's client retries after 2 s
(PrefectHQ/prefect#18934). The other connection is usually the task-run recorder writing the last
step's task-run events, so the faster a step's flow runs come, the more often a step stalls for 2 s.
Here every transaction that Prefect opens begins ``IMMEDIATE``: it takes the write lock first and waits
for it (up to the busy timeout) instead of failing after its read, as Prefect's own comment on its
SQLite set-up recommends. Writes to one SQLite file are one at a time either way.

When the server stops, Prefect's task-run recorder cancels a write that is under way, puts its events back
in its queue and writes them in its last flush; it logs the cancelled write as an error with a traceback
all the same, which would land in the run's output at its end. ``QuietStoppedFlush`` drops that one record
(a cancelled write that lost no event); any other error of the recorder is logged.

A Postgres database, or a server of your own, is left as it is.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from typing import Any

import prefect
from prefect.server.api.server import SubprocessASGIServer
from prefect.server.database.configurations import SQLITE_BEGIN_MODE, AioSqliteConfiguration
from prefect.settings import get_current_settings

APP_FACTORY = "trellis.flows.temporary_server:create_app"
RECORDER_LOGGER = "prefect.server.services.task_run_recorder"


class WriteFirstSqliteConfiguration(AioSqliteConfiguration):
    """Prefect's SQLite configuration, with every transaction it opens taking the write lock first."""

    @asynccontextmanager
    async def begin_transaction(self, session: Any, with_for_update: bool = False) -> AsyncGenerator[Any, None]:
        token = SQLITE_BEGIN_MODE.set("IMMEDIATE")
        try:
            async with session.begin() as transaction:
                yield transaction
        finally:
            SQLITE_BEGIN_MODE.reset(token)


class QuietStoppedFlush(logging.Filter):
    """Drops the recorder's error record for a write cancelled by its own stop, whose events it requeued
    ("Error flushing N events (N to retry, 0 dropped)" with a ``CancelledError``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        cancelled = record.exc_info is not None and record.exc_info[0] is asyncio.CancelledError
        requeued = str(record.msg).startswith("Error flushing") and str(record.msg).endswith(" 0 dropped)")
        return not (cancelled and requeued)


def create_app() -> Any:
    """uvicorn's app factory for the temporary server: Prefect's app over the configuration above."""
    from prefect.server.api.server import create_app as prefect_app
    from prefect.server.database.dependencies import set_database_config
    from prefect.server.utilities.database import get_dialect
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL

    url = PREFECT_API_DATABASE_CONNECTION_URL.value()
    if get_dialect(url).name == "sqlite":
        set_database_config(WriteFirstSqliteConfiguration(connection_url=url))
    logging.getLogger(RECORDER_LOGGER).addFilter(QuietStoppedFlush())
    return prefect_app()


class TemporaryServer(SubprocessASGIServer):
    """Prefect's temporary server process, started from ``create_app`` above (the same arguments and
    environment as Prefect's ``SubprocessASGIServer._run_uvicorn_command``, another factory)."""

    def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
        server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        return subprocess.Popen(
            args=[sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
                  APP_FACTORY, "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"],
            env={**os.environ, **server_env, **get_current_settings().to_environment_variables(exclude_unset=True)},
        )


def use_temporary_server() -> None:
    """Make the temporary server that Prefect's client starts on its first call (when no API URL is set)
    this module's: Prefect keeps one ``SubprocessASGIServer`` per port, and the one with no port is
    the one its client starts and reuses (Prefect's own test harness puts its server there the same way)."""
    if get_current_settings().api.url:
        return
    current = SubprocessASGIServer._instances.get(None)
    if current is None or (not isinstance(current, TemporaryServer) and not current.running):
        SubprocessASGIServer._instances.pop(None, None)
        TemporaryServer()
