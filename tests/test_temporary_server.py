"""The temporary Prefect server a run starts without PREFECT_API_URL (flows.temporary_server): its SQLite
transactions hold the write lock from their first statement, and every task run of a run is recorded by the
time the run's process has exited."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_transaction_holds_the_write_lock_before_it_writes(tmp_path):
    """Prefect's DEFERRED transaction that has only read lets another connection commit a write, after
    which its own write fails at once (SQLITE_BUSY_SNAPSHOT, PrefectHQ/prefect#18934). Tried: a read in a
    transaction of each configuration, then a write from a second connection that does not wait."""
    from prefect.server.database.configurations import AioSqliteConfiguration
    from sqlalchemy import text

    from trellis.flows.temporary_server import WriteFirstSqliteConfiguration

    database = tmp_path / "prefect.db"
    with sqlite3.connect(database) as setup:
        setup.execute("CREATE TABLE t (x INTEGER)")

    async def other_writer_while_reading(config) -> str:
        engine = await config.engine()
        session = await config.session(engine)
        async with session:
            async with config.begin_transaction(session):
                await session.execute(text("SELECT count(*) FROM t"))
                other = sqlite3.connect(database, timeout=0)
                try:
                    other.execute("INSERT INTO t VALUES (1)")
                    other.commit()
                    return "written"
                except sqlite3.OperationalError as error:
                    return str(error)
                finally:
                    other.close()

    url = f"sqlite+aiosqlite:///{database}"
    assert asyncio.run(other_writer_while_reading(AioSqliteConfiguration(connection_url=url))) == "written"
    assert asyncio.run(other_writer_while_reading(WriteFirstSqliteConfiguration(connection_url=url))) == "database is locked"


RUN = textwrap.dedent("""
    from trellis.flows.prefect_settings import use_lean_temporary_server

    use_lean_temporary_server()
    from prefect import flow, task
    from prefect.server.api.server import SubprocessASGIServer

    @task(task_run_name="phase[step={step}, i={i}]")
    def phase(step: int, i: int) -> int:
        return i

    @flow(flow_run_name="step[{step}]")
    def step_flow(step: int) -> int:
        return sum(phase(step, i) for i in range(5))

    @flow
    def run() -> None:
        for step in range(4):
            step_flow(step)

    run()
    args = SubprocessASGIServer._instances[None].server_process.args
    print("factory:", args[args.index("--factory") + 1])
""")


@pytest.mark.slow
def test_a_run_on_the_temporary_server_records_every_task_run(tmp_path):
    """A run of 4 step flow runs of 5 tasks each, in a process of its own that exits right after the run
    (its server is stopped then); its database, read once the process is gone, holds all 20 task runs,
    completed, and the run printed no error."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), PREFECT_LOGGING_LEVEL="WARNING")
    done = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "factory: trellis.flows.temporary_server:create_app" in done.stdout
    with sqlite3.connect(tmp_path / "home" / "prefect.db") as database:
        rows = database.execute("SELECT name, state_type FROM task_run WHERE name LIKE 'phase[%'").fetchall()
    assert sorted(rows) == sorted((f"phase[step={s}, i={i}]", "COMPLETED") for s in range(4) for i in range(5))
