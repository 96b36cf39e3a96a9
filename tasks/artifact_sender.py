"""Prefect artifacts posted without waiting for the API.

An artifact is a record for the UI, not a step's output: nothing downstream reads it. Posting one is an
HTTP round trip the step would otherwise wait on (two per ``log_step``, ~14 ms each on the CPU bench,
``bench/results/cpu_prefect_calls.txt``). ``send`` hands the post to one background thread, in a copy of
the caller's context, so Prefect still links the artifact to the task run that made it; ``flush`` waits
for every post still on its way, and is called before the run ends. A post that fails is a warning in the
run's log, never a failed step.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

logger = logging.getLogger(__name__)

_sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefect-artifacts")
_pending: list[Future] = []
_lock = threading.Lock()


def send(create: Callable[..., Any], **arguments: Any) -> None:
    """Run ``create(**arguments)`` (``create_table_artifact``, ``create_link_artifact``, ...) in the
    background; the order of posts is kept."""
    context = contextvars.copy_context()
    future = _sender.submit(context.run, _post, create, arguments)
    with _lock:
        _pending[:] = [f for f in _pending if not f.done()]
        _pending.append(future)


def flush(timeout_s: float = 60.0) -> None:
    """Wait for the posts still on their way, up to ``timeout_s`` for each."""
    with _lock:
        waiting, _pending[:] = list(_pending), []
    for future in waiting:
        try:
            future.result(timeout=timeout_s)
        except TimeoutError:
            logger.warning("A Prefect artifact was still being posted after %g s; not waiting for it.", timeout_s)


def _post(create: Callable[..., Any], arguments: dict[str, Any]) -> None:
    try:
        create(**arguments)
    except Exception as error:
        logger.warning("A Prefect artifact was not recorded: %s: %s", type(error).__name__, error)
