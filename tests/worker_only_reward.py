"""A reward module that imports where the run is launched but not on the workers (whose environment
has $TRELLIS_TEST_KILL_FILE): a dependency installed on the laptop and missing on the cluster."""

import os

if "TRELLIS_TEST_KILL_FILE" in os.environ:
    raise ModuleNotFoundError("No module named 'judge_sdk'")

from trellis.engine.tiny.reverse_task import score  # noqa: E402,F401
