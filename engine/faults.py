"""Crashes on purpose at named points of the workers, for the fault tests.

A worker whose environment names a file in ``TRELLIS_FAULT_FILE`` reads it at each ``fault_point``:
when the file holds ``POINT [COUNT]`` for this point, the point is passed COUNT more times, and the
next time the worker writes ``POINT PID`` to ``{file}.fired``, removes the file and SIGKILLs its own
process, as an out-of-memory kill or a lost node would end it. The test then knows the kill happened,
where, and to which process. Outside the tests the variable is unset and a point costs one lookup.

A ``fault_flag`` is a point that does not kill: it answers True when it fires (the caller then does the
damage, as flipping a weight sync's bytes), and ``POINT COUNT TIMES`` makes it fire TIMES times in a row.

``trainer.lr_spike`` is such a flag: the optimizer step that fires it runs at ``LR_SPIKE_FACTOR`` times its
learning rate, the injected instability the stability guard's tests recover from.
"""

from __future__ import annotations

import fcntl
import os
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

FAULT_FILE = "TRELLIS_FAULT_FILE"
LR_SPIKE, LR_SPIKE_FACTOR = "trainer.lr_spike", 100.0


def fault_point(name: str) -> None:
    if _fires(name):
        os.kill(os.getpid(), signal.SIGKILL)


def fault_flag(name: str) -> bool:
    """Whether the point ``name`` fires now; the caller does the damage."""
    return _fires(name)


def _fires(name: str) -> bool:
    path = os.environ.get(FAULT_FILE)
    if not path:
        return False
    marker = Path(path)
    with marker_lock(marker):
        try:
            point, *numbers = marker.read_text().split()
        except FileNotFoundError:
            return False
        if point != name:
            return False
        left, times = (int(numbers[0]) if numbers else 0), (int(numbers[1]) if len(numbers) > 1 else 1)
        if left > 0:
            marker.write_text(f"{point} {left - 1} {times}")
            return False
        Path(f"{path}.fired").write_text(f"{point} {os.getpid()}")
        if times > 1:
            marker.write_text(f"{point} 0 {times - 1}")
        else:
            marker.unlink()
        return True


@contextmanager
def marker_lock(marker: Path) -> Iterator[None]:
    """Hold ``{marker}.lock`` while reading and rewriting a countdown marker: processes that pass a point
    at once (trainer ranks, a reward pool's extra pools) would otherwise read one count and lose one, and
    the fault would fire a call late."""
    with open(f"{marker}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def spike_lr_if_asked(param_groups: list[dict]) -> None:
    """When ``trainer.lr_spike`` fires: this optimizer step's learning rate times ``LR_SPIKE_FACTOR`` (the
    scheduler's next step sets it back)."""
    if fault_flag(LR_SPIKE):
        for group in param_groups:
            group["lr"] *= LR_SPIKE_FACTOR
