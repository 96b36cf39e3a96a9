"""Reward functions that break things on purpose, for the fault tests (imported by Ray workers)."""

import os
import signal
from pathlib import Path

from trellis.engine.faults import marker_lock
from trellis.engine.tiny.reverse_task import score


def kill_rollout_once(sample):
    """Score like the task, but on the first call SIGKILL the process named in $TRELLIS_TEST_KILL_FILE."""
    return kill_once(sample)


def kill_once(sample):
    """Score like the task. $TRELLIS_TEST_KILL_FILE holds "PID [CALLS]": after CALLS more scoring
    calls (0 by default), SIGKILL that process and disarm by removing the file."""
    _signal_once(signal.SIGKILL)
    return score(sample)


def freeze_once(sample):
    """As ``kill_once``, but SIGSTOP the process: it stays alive and answers nothing (a hung engine)."""
    _signal_once(signal.SIGSTOP)
    return score(sample)


def _signal_once(signum: int) -> None:
    """The countdown is taken under a lock: a slow call opens another reward pool (``BoundedCalls``), and
    two pools counting down at once lost a count, so the signal landed one call (and one step) late."""
    marker = Path(os.environ["TRELLIS_TEST_KILL_FILE"])
    with marker_lock(marker):
        try:
            pid, *countdown = marker.read_text().split()
        except FileNotFoundError:
            return
        left = int(countdown[0]) if countdown else 0
        if left > 0:
            marker.write_text(f"{pid} {left - 1}")
            return
        marker.unlink()
    try:
        os.kill(int(pid), signum)
    except ProcessLookupError:
        pass
