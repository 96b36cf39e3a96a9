"""A Prefect server of one's own, with the work pool and worker that run trellis' deployments:
``trellis server up | down | status``.

    {home}/prefect/            PREFECT_HOME of the server and the worker
        prefect.db             the SQLite database (unless a --database-url, e.g. Postgres, is given)
        server.json            the server's URL and the two processes' pids
        server.log, worker.log their output

``up`` starts ``prefect server start`` (127.0.0.1 only) and ``prefect worker start`` for a ``process``
work pool as processes of their own that outlive the command, then deploys ``deployments/prefect.yaml``
(every deployment runs from this checkout). ``trellis train`` sends its flow runs to a server
recorded here, so they show in its UI; without one, each run starts a temporary server, as before.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from trellis.engine.secrets import redact_url_passwords

ROOT = Path(__file__).resolve().parents[1]
POOL = "trellis-local"
STARTUP_TIMEOUT_S = 180.0  # a first start creates the database; on 2 busy cores that takes a while


class ServerError(RuntimeError):
    """The server or its worker could not be started, or deployments could not be applied."""


@dataclass(frozen=True)
class ServerState:
    url: str  # the UI; the API is at {url}/api
    server_pid: int
    worker_pid: int
    home: str
    database: str  # with any password masked

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"


def prefect_home(home: str) -> Path:
    return Path(home).expanduser() / "prefect"


def _state_file(home: str) -> Path:
    return prefect_home(home) / "server.json"


def _prefect() -> str:
    return str(Path(sys.executable).with_name("prefect"))


def child_env(home: str, api_url: str) -> dict[str, str]:
    """The environment of the worker and the flow runs it starts (and the server's, plus its database)."""
    env = dict(os.environ)
    env.update(
        PREFECT_HOME=str(prefect_home(home)),
        PREFECT_API_URL=api_url,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS="2",  # deployment runs start within seconds
    )
    return env


def database(home: str, database_url: str | None) -> str:
    return database_url or f"sqlite+aiosqlite:///{prefect_home(home) / 'prefect.db'}"


def is_healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/api/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recorded_state(home: str = "~/.trellis") -> ServerState | None:
    path = _state_file(home)
    if not path.exists():
        return None
    return ServerState(**json.loads(path.read_text()))


def running_state(home: str = "~/.trellis") -> ServerState | None:
    """The recorded server, if it answers."""
    state = recorded_state(home)
    return state if state is not None and is_healthy(state.url) else None


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as output:
        return subprocess.Popen(
            args, env=env, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )


def _wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if is_healthy(url):
            return
        if process.poll() is not None:
            raise ServerError(f"The Prefect server exited with code {process.returncode}; its log: {log}\n{_tail(log)}")
        time.sleep(0.5)
    raise ServerError(f"The Prefect server did not answer at {url} within {timeout_s:g}s; its log: {log}")


def _tail(log: Path, lines: int = 15) -> str:
    return redact_url_passwords("\n".join(log.read_text(errors="replace").splitlines()[-lines:])) if log.exists() else ""


def start(home: str = "~/.trellis", port: int = 4200, database_url: str | None = None, deploy: bool = True) -> ServerState:
    """Start the server and its worker (or find them running), then apply the deployments."""
    running = running_state(home)
    if running is not None:
        if deploy:
            apply_deployments(running)
        return running
    folder = prefect_home(home)
    folder.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    if is_healthy(url):
        raise ServerError(f"Something else already answers at {url}: stop it, or pick another --port.")
    env = child_env(home, f"{url}/api")  # the database URL (and its password) goes to the server alone
    server_env = {**env, "PREFECT_API_DATABASE_CONNECTION_URL": database(home, database_url)}
    server_log, worker_log = folder / "server.log", folder / "worker.log"
    server = _spawn([_prefect(), "server", "start", "--host", "127.0.0.1", "--port", str(port)], server_env, server_log)
    _wait_healthy(url, server, server_log, STARTUP_TIMEOUT_S)
    _ensure_pool(url)
    worker = _spawn([_prefect(), "worker", "start", "--pool", POOL, "--type", "process"], env, worker_log)
    state = ServerState(url, server.pid, worker.pid, str(Path(home).expanduser()), redact_url_passwords(database(home, database_url)))
    _state_file(home).write_text(json.dumps(asdict(state), indent=2))
    if deploy:
        apply_deployments(state)
    return state


def _ensure_pool(url: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    with temporary_settings({PREFECT_API_URL: f"{url}/api"}), get_client(sync_client=True) as client:
        try:
            client.create_work_pool(
                WorkPoolCreate(name=POOL, type="process", base_job_template=ProcessWorker.get_default_base_job_template())
            )
        except ObjectAlreadyExists:
            pass


def apply_deployments(state: ServerState, prefect_yaml: Path | None = None) -> None:
    """``prefect deploy --all`` of ``deployments/prefect.yaml`` from the repository root, so that
    flow runs load their code from this checkout."""
    from trellis.deployments.render import PREFECT_YAML

    env = child_env(state.home, state.api_url)
    done = subprocess.run(
        [_prefect(), "--no-prompt", "deploy", "--prefect-file", str(prefect_yaml or PREFECT_YAML), "--all"],
        env=env, cwd=ROOT, capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise ServerError(f"`prefect deploy` failed:\n{redact_url_passwords(done.stdout[-2000:] + done.stderr[-2000:])}")


def stop(home: str = "~/.trellis", timeout_s: float = 20.0) -> bool:
    """Stop the worker, then the server; False if none was recorded."""
    state = recorded_state(home)
    if state is None:
        return False
    for pid in (state.worker_pid, state.server_pid):
        _stop_group(pid, timeout_s)
    _state_file(home).unlink(missing_ok=True)
    return True


def _stop_group(pid: int, timeout_s: float) -> None:
    if not process_alive(pid):
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process_alive(pid):
        time.sleep(0.2)
        try:
            os.waitpid(pid, os.WNOHANG)  # reap it when this process started it (tests)
        except ChildProcessError:
            pass
    if process_alive(pid):
        os.killpg(pid, signal.SIGKILL)
