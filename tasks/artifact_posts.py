"""The Prefect artifacts a run's steps publish every step (metrics table, trajectory, checkpoint and
evaluation links), posted without the step waiting for the API where that is safe.

An artifact is a record for the UI: nothing in the run reads it back, yet posting one is an HTTP round
trip the step waits for (``log_step`` posts two a step, ~12 ms each on the CPU bench, with the workers
idle meanwhile: ``bench/results/cpu_prefect_calls.txt``). Inside ``posting_in_background`` the step hands
each post to one thread with a client of its own, in order, and the block's end waits until all are
posted. A post that fails, after the client's own retries, is a warning in the run's log, never a
failed step.

The flow enables it only on trellis's temporary server (``flows.prefect_settings.on_trellis_temporary_server``).
Its SQLite transactions take the write lock first, so a post that lands beside one of the step's own
requests waits its turn. On a server whose transactions begin ``DEFERRED`` (Prefect's own SQLite server)
the same collision fails the step's request with a 503, which Prefect's client retries 2 s later; there,
and on any server trellis did not start, each artifact is posted while the step waits, as Prefect's
``create_*_artifact`` do.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

from prefect.artifacts import Artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactCreate
from prefect.context import SettingsContext
from prefect.utilities.context import get_task_and_flow_run_ids

_DONE = None  # what ends the sender's queue


class BackgroundPoster:
    """One thread posting artifacts in the order they came, through its own Prefect client, made with
    the Prefect settings (API URL included) of the thread that started it."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        self._warn = warn
        self._settings = SettingsContext.get()
        self._queue: queue.Queue[ArtifactCreate | None] = queue.Queue()
        self._thread = threading.Thread(target=self._send, name="trellis-artifact-posts", daemon=True)
        self._thread.start()

    def put(self, request: ArtifactCreate) -> None:
        self._queue.put(request)

    def close(self, timeout_s: float = 120.0) -> None:
        """Wait for the posts still on their way, up to ``timeout_s`` in all."""
        self._queue.put(_DONE)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._warn(f"{self._queue.qsize()} Prefect artifacts of this run were still waiting to be posted after "
                       f"{timeout_s:g} s; they are not posted.")

    def _send(self) -> None:
        settings = SettingsContext(profile=self._settings.profile, settings=self._settings.settings)
        with settings, ExitStack() as open_client:
            client = None
            while (request := self._queue.get()) is not _DONE:
                try:  # the client is made at the first post, and again at the next if the API did not answer
                    client = client or open_client.enter_context(get_client(sync_client=True))
                    client.create_artifact(artifact=request)
                except Exception as error:  # a record for the UI: losing one must not fail the run
                    self._warn(f"The Prefect artifact {request.key!r} was not posted: {type(error).__name__}: {error}")


_poster: BackgroundPoster | None = None


def post(artifact: Artifact) -> None:
    """Post ``artifact``, linked to the calling task run and its flow run, through the open background
    poster, or now if none is open."""
    if _poster is None:
        artifact.create(_sync=True)  # pyright: ignore[reportCallIssue] (Prefect's async_dispatch)
        return
    task_run_id, flow_run_id = get_task_and_flow_run_ids()
    _poster.put(ArtifactCreate(type=artifact.type, key=artifact.key, description=artifact.description,
                               task_run_id=task_run_id, flow_run_id=flow_run_id,
                               data=artifact.format(_sync=True)))  # pyright: ignore[reportCallIssue]


@contextmanager
def posting_in_background(enabled: bool, warn: Callable[[str], None]) -> Iterator[None]:
    """Within the block, ``post`` hands artifacts to a background thread if ``enabled``; the block's end
    waits for them. A post that fails is passed to ``warn`` (the run log's). A block inside another's
    keeps the outer one's poster."""
    global _poster
    if _poster is not None or not enabled:
        yield
        return
    _poster = BackgroundPoster(warn)
    try:
        yield
    finally:
        poster, _poster = _poster, None
        poster.close()
