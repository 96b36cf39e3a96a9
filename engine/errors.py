"""What a failed run tells its user, wherever the error was raised: on the driver or in a worker.

``SettingError``: a setting the user must change; the message names it and what to set instead.
``trellis train`` ends with exit code 2 and that message alone, and Prefect does not retry it (the
retry would meet the same setting). ``WorkerError``: an error raised in one of the run's workers (a Ray
actor), as the driver reports it: one line naming the worker and the cause. The worker's traceback
travels as its ``__cause__``, for the run log; neither carries a secret the driver knows of.
"""

from __future__ import annotations

from trellis.engine.secrets import redact


class SettingError(ValueError):
    """A setting the user must change for the run to go on (``attention_kernel: fa4`` on a CPU, ...)."""


class DatasetError(SettingError):
    """A dataset cannot be read at all (missing path, unknown format, no split, no usable rows)."""


class WorkerError(RuntimeError):
    """An error raised in a worker: ``str()`` is one line, ``trainer rank 0 (exp-trainer) failed in fit: ...``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class WorkerSettingError(WorkerError, SettingError):
    """A worker refused a setting: the run cannot go on until the user changes it."""


class WorkerLostError(WorkerError, ValueError):
    """A worker's process is gone (killed, out of memory, its node lost). A ``ValueError`` too, as Ray's
    own lookup of a named actor that is gone is."""


def one_line(text: str) -> str:
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def describe_failure(error: BaseException) -> str:
    """What ended a run, on one line and without secrets: the message alone for the errors written
    for users (settings, workers), ``Type: message`` for anything else."""
    text = one_line(str(error))
    if not isinstance(error, (SettingError, WorkerError)):
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return redact(text)
