"""Ray's errors as the driver meets them, told as trellis's (``engine.errors``): which of the run's
workers failed, in which call, and why, on one line without secrets. Ray's own error stays attached
as the ``__cause__``, with the worker's traceback, for the run log."""

from __future__ import annotations

from typing import Protocol

from ray.exceptions import RayActorError, RayTaskError

from trellis.engine.cluster.compat import creation_error, failed_call
from trellis.engine.errors import (
    SettingError,
    WorkerError,
    WorkerLostError,
    WorkerSettingError,
    describe_failure,
    one_line,
)
from trellis.engine.secrets import redact

UNKNOWN_WORKER = "a worker of the run"


class Roster(Protocol):
    """The run's workers, as ``engine.cluster.workers.RunWorkers`` knows them."""

    def label(self, name: str) -> str:
        """``trainer rank 1 (exp-trainer-1)`` for the actor named ``exp-trainer-1``."""
        ...

    def lost(self) -> list[str]:
        """The names of the run's workers that no longer run."""
        ...


def worker_error(error: RayTaskError | RayActorError, roster: Roster) -> WorkerError:
    """``error`` as the run's user should read it: a setting a worker refused, a worker that raised
    (the innermost, when a worker's call to another raised there), or a worker that was lost."""
    if isinstance(error, RayActorError):
        built = creation_error(error)
        if built is None:
            return lost_worker(roster, error)
        error = built
    cause = error.cause
    while isinstance(cause, RayTaskError):
        error, cause = cause, cause.cause
    if isinstance(cause, RayActorError) and creation_error(cause) is None:
        return lost_worker(roster, cause)
    name, method = failed_call(error)
    who = roster.label(name) if name else UNKNOWN_WORKER
    during = " while it was built" if method == "__init__" else f" in {method}" if method else ""
    kind = WorkerSettingError if isinstance(cause, SettingError) else WorkerError
    return kind(redact(f"{who} failed{during}: {describe_failure(cause)}"))


def lost_worker(roster: Roster, error: RayActorError) -> WorkerLostError:
    """The run's workers that are gone, by name; Ray's own account of the death where none is missing
    (the dead worker already replaced, or its name not yet freed)."""
    names = roster.lost()
    if not names:
        return WorkerLostError(redact(f"{UNKNOWN_WORKER} was lost: {one_line(str(error))}"))
    if len(names) == 1:
        return WorkerLostError(f"{roster.label(names[0])} was lost: its process died")
    return WorkerLostError(f"{' and '.join(roster.label(name) for name in names)} were lost: their processes died")
