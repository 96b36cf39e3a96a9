"""Leaving the `trellis` command without tearing the interpreter down module by module.

After a run, Python's own exit spends seconds freeing the modules of torch, transformers, Prefect and
Ray one by one (measured: ~2-3 s a `trellis train`, all of it after the last line was printed). The
command does what an exit must (joins the threads that are not daemons, runs the atexit hooks: Ray's
shutdown, the temporary Prefect server's stop, logging's flush; flushes the console) and then ends
the process at once.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Callable


def run_then_exit(main: Callable[[], object]) -> None:
    """Run ``main`` (a command that ends with ``sys.exit``, as typer's do) and end the process with its
    exit code, skipping only the interpreter's teardown."""
    try:
        main()
        code = 0
    except SystemExit as done:
        code = exit_code(done)
    except KeyboardInterrupt:  # what a shell reports for Ctrl-C
        code = 130
    except BaseException:  # shown as Python would, then the same quick end
        import traceback

        traceback.print_exc()
        code = 1
    getattr(threading, "_shutdown", lambda: None)()  # what Python does first at exit: wait for the threads that are not daemons
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said there
            pass
    os._exit(code)


def exit_code(done: SystemExit) -> int:
    """What the interpreter makes of ``sys.exit(x)``: None is 0, an int is itself, anything else is
    printed to stderr and is 1."""
    if done.code is None:
        return 0
    if isinstance(done.code, int):
        return done.code
    print(done.code, file=sys.stderr)
    return 1
