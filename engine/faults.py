"""Crashes on purpose at named points of the workers, for the fault tests.

A worker whose environment names a file in ``TRELLIS_FAULT_FILE`` reads it at each ``fault_point``:
when the file holds ``POINT [COUNT]`` for this point, the point is passed COUNT more times, and the
next time the worker writes ``POINT PID`` to ``{file}.fired``, removes the file and SIGKILLs its own
process, as an out-of-memory kill or a lost node would end it. The test then knows the kill happened,
where, and to which process. Outside the tests the variable is unset and a point costs one lookup.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

FAULT_FILE = "TRELLIS_FAULT_FILE"


def fault_point(name: str) -> None:
    path = os.environ.get(FAULT_FILE)
    if not path:
        return
    marker = Path(path)
    try:
        point, *count = marker.read_text().split()
    except FileNotFoundError:
        return
    if point != name:
        return
    left = int(count[0]) if count else 0
    if left > 0:
        marker.write_text(f"{point} {left - 1}")
        return
    Path(f"{path}.fired").write_text(f"{point} {os.getpid()}")
    marker.unlink()
    os.kill(os.getpid(), signal.SIGKILL)
