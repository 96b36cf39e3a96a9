"""Reward functions that break things on purpose, for the fault tests (imported by Ray workers)."""

import os
import signal
from pathlib import Path


def kill_rollout_once(sample):
    """Score like the task, but first SIGKILL the process named in $TRELLIS_TEST_KILL_FILE, once."""
    marker = Path(os.environ["TRELLIS_TEST_KILL_FILE"])
    try:
        pid = int(marker.read_text())
        marker.unlink()
        os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        pass
    return 1.0 if str(sample["response"]).strip() == str(sample["label"]) else 0.0
