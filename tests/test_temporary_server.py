"""The temporary Prefect server a run starts without PREFECT_API_URL (flows.temporary_server): its SQLite
transactions hold the write lock from their first statement, and every task run of a run is recorded by the
time the run's process has exited."""

from __future__ import annotations

import asyncio
import json
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


TRELLIS_SERVER = textwrap.dedent("""
    from trellis.flows.prefect_settings import use_lean_temporary_server

    use_lean_temporary_server()
""")
PREFECTS_SERVER = TRELLIS_SERVER + textwrap.dedent("""
    from prefect.server.api.server import SubprocessASGIServer

    SubprocessASGIServer._instances.pop(None)  # the client starts Prefect's own then
""")
STEPS = textwrap.dedent("""
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
RUN = TRELLIS_SERVER + STEPS


STOP_MID_WRITE = textwrap.dedent("""
    import sqlite3
    import time

    from prefect.settings import get_current_settings

    # Hold the database's write lock and run one more task (outside a flow: its states reach the server only
    # as events). The recorder's periodic flush of those events (every second) starts and waits for the lock.
    # Then stop the server as the process's exit would (SIGTERM), but without the 5 s after which that stop
    # kills it, and let the lock go while the stop has cancelled the flush: the whole hold stays well inside
    # the 10 s for which a SQLite write of Prefect's waits for a lock.
    database = sqlite3.connect(get_current_settings().home / "prefect.db", isolation_level=None)
    database.execute("BEGIN IMMEDIATE")
    phase(4, 0)
    time.sleep(2.5)
    server = SubprocessASGIServer._instances[None]
    server.server_process.terminate()
    time.sleep(2.5)
    database.rollback()
    server.server_process.wait(timeout=120)
    server.stop()
""")


def run_in_own_process(script: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PYTHONPATH=str(ROOT), PREFECT_LOGGING_LEVEL="WARNING")
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)


def recorded_phases(home: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(home / "prefect.db") as database:
        return sorted(database.execute("SELECT name, state_type FROM task_run WHERE name LIKE 'phase[%'").fetchall())


EVERY_PHASE_COMPLETED = sorted((f"phase[step={s}, i={i}]", "COMPLETED") for s in range(4) for i in range(5))


@pytest.mark.slow
def test_a_run_on_the_temporary_server_records_every_task_run(tmp_path):
    """A run of 4 step flow runs of 5 tasks each, in a process of its own that exits right after the run
    (its server is stopped then); its database, read once the process is gone, holds all 20 task runs,
    completed, and the run printed no error."""
    done = run_in_own_process(RUN, tmp_path / "home")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "factory: trellis.flows.temporary_server:create_app" in done.stdout
    assert recorded_phases(tmp_path / "home") == EVERY_PHASE_COMPLETED


@pytest.mark.slow
def test_a_server_stopped_mid_write_records_every_task_run_and_prints_no_error(tmp_path):
    """The recorder's write of the run's last events is under way (waiting for a lock this test holds) when
    the run's server is stopped. Tried on Prefect's own temporary server too: it prints the
    cancelled write as an error with a traceback, and it too records every task run (its last flush writes
    the events back in the queue), which is why the error is dropped on trellis's."""
    with_the_last_task = sorted([*EVERY_PHASE_COMPLETED, ("phase[step=4, i=0]", "COMPLETED")])
    prefects = run_in_own_process(PREFECTS_SERVER + STEPS + STOP_MID_WRITE, tmp_path / "prefects")
    assert prefects.returncode == 0, prefects.stdout + prefects.stderr
    assert "factory: prefect.server.api.server:create_app" in prefects.stdout
    assert "Error flushing 3 events (3 to retry, 0 dropped)" in prefects.stderr, prefects.stderr[-3000:]
    assert "CancelledError" in prefects.stderr
    assert recorded_phases(tmp_path / "prefects") == with_the_last_task

    ours = run_in_own_process(RUN + STOP_MID_WRITE, tmp_path / "ours")
    assert ours.returncode == 0, ours.stdout + ours.stderr
    assert "Traceback" not in ours.stderr and "Error" not in ours.stderr, ours.stderr[-3000:]
    assert recorded_phases(tmp_path / "ours") == with_the_last_task


def test_the_step_loop_reads_one_ca_certificate_over_plain_http_and_the_machines_over_https():
    """Prefect's client loads its CA file for every client it makes, even for an http:// API. Tried: the
    temporary server (no API URL), a server on loopback over HTTP, and one over HTTPS, whose CA file must
    stay the one Prefect would read without trellis."""
    import ssl

    from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from trellis.flows.prefect_settings import ONE_CERTIFICATE_FILE, step_loop_settings

    assert ONE_CERTIFICATE_FILE.read_text().count("BEGIN CERTIFICATE") == 1
    assert ssl.create_default_context(cafile=str(ONE_CERTIFICATE_FILE)).cert_store_stats()["x509_ca"] == 1
    for url in (None, "http://127.0.0.1:4200/api"):
        with temporary_settings({PREFECT_API_URL: url}):
            assert step_loop_settings() == {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None, PREFECT_API_SSL_CERT_FILE: str(ONE_CERTIFICATE_FILE)}
    with temporary_settings({PREFECT_API_URL: "https://prefect.example.com/api"}):
        assert step_loop_settings() == {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}


BACKGROUND_POSTS = textwrap.dedent("""
    import sqlite3

    from prefect import flow, task
    from prefect.artifacts import LinkArtifact, TableArtifact
    from prefect.settings import get_current_settings

    from trellis.flows.prefect_settings import on_trellis_temporary_server
    from trellis.tasks.artifact_posts import post, posting_in_background

    @task(task_run_name="publish[{i}]")
    def publish(i: int) -> None:
        # The database's write lock is held while the task posts: a post the task waited for would wait for
        # that lock, which this thread lets go only after posting.
        database = sqlite3.connect(get_current_settings().home / "prefect.db", isolation_level=None)
        database.execute("BEGIN IMMEDIATE")
        post(TableArtifact(key="metrics", table=[{"step": i}]))
        post(LinkArtifact(key="trajectories", link=f"file:///run/step={i}"))
        print(f"publish[{i}] posted with the database locked")
        database.rollback()

    @flow
    def run() -> None:
        for i in range(3):
            publish(i)

    warnings = []
    print("on trellis's temporary server:", on_trellis_temporary_server())
    with posting_in_background(on_trellis_temporary_server(), warnings.append):
        run()
    print("warnings:", warnings)
""")


@pytest.mark.slow
def test_step_artifacts_post_while_the_database_is_locked_and_are_all_recorded_in_order(tmp_path):
    """On trellis's temporary server a step's artifacts do not hold the step up: each task posts two while
    the database's write lock is held (by the task itself, so a post it waited for could never finish).
    Once the posting block has ended, every artifact is recorded, in the order posted, linked to the task
    run and the flow run that posted it. With the block disabled (each post waited for, as on a server
    trellis did not start), the same script never got past the lock (tried: still waiting after 120 s)."""
    done = run_in_own_process(TRELLIS_SERVER + BACKGROUND_POSTS, tmp_path / "home")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "on trellis's temporary server: True" in done.stdout
    assert all(f"publish[{i}] posted with the database locked" in done.stdout for i in range(3))
    assert "warnings: []" in done.stdout
    with sqlite3.connect(tmp_path / "home" / "prefect.db") as database:
        rows = database.execute(
            "SELECT artifact.key, artifact.data, task_run.name, task_run.flow_run_id = artifact.flow_run_id FROM artifact"
            " JOIN task_run ON task_run.id = artifact.task_run_id ORDER BY artifact.created").fetchall()
    rows = [(key, json.loads(data), task_run, same_flow_run) for key, data, task_run, same_flow_run in rows]  # a JSON column
    expected = []
    for i in range(3):
        expected += [("metrics", f'[{{"step": {i}}}]', f"publish[{i}]", 1),
                     ("trajectories", f"[file:///run/step={i}](file:///run/step={i})", f"publish[{i}]", 1)]
    assert rows == expected


def test_a_post_the_api_does_not_take_is_a_warning_and_the_next_posts_are_still_tried():
    """Tried: an API that nobody serves (a closed loopback port), with the client's retries off. Each post
    is a warning naming its artifact; closing the poster returns once all were tried."""
    from prefect.client.schemas.actions import ArtifactCreate
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from trellis.tasks.artifact_posts import BackgroundPoster

    warnings: list[str] = []
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api", PREFECT_CLIENT_MAX_RETRIES: 0}):
        poster = BackgroundPoster(warnings.append)
    for key in ("metrics", "trajectories"):
        poster.put(ArtifactCreate(key=key, type="table", data="[]"))
    poster.close(timeout_s=60)
    assert [w.split(":")[0] for w in warnings] == [f"The Prefect artifact {k!r} was not posted" for k in ("metrics", "trajectories")]
    assert all("ConnectError" in w for w in warnings), warnings
