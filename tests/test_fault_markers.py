"""The fault tests' countdowns (``engine.faults`` and ``fault_rewards``) stay exact when several processes
count down at once, as trainer ranks and a reward pool's extra pools do."""

from __future__ import annotations

import multiprocessing
import os
import signal

from trellis.engine.faults import FAULT_FILE, fault_flag

PROCESSES, CALLS_EACH = 4, 60


def _pass_the_point(path: str, fired) -> None:
    os.environ[FAULT_FILE] = path
    for _ in range(CALLS_EACH):
        if fault_flag("test.point"):
            with fired.get_lock():
                fired.value += 1


def test_a_countdown_passed_by_four_processes_at_once_fires_at_its_call(tmp_path):
    """Tried: 4 processes pass one point 60 times each, with the point set to fire at the 240th call, so
    only an exact count fires it; without the lock, two processes reading one count lose a call and it
    never fires."""
    marker = tmp_path / "fault"
    marker.write_text(f"test.point {PROCESSES * CALLS_EACH - 1}")
    context = multiprocessing.get_context("fork")
    fired = context.Value("i", 0)
    workers = [context.Process(target=_pass_the_point, args=(str(marker), fired)) for _ in range(PROCESSES)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [worker.exitcode for worker in workers] == [0] * PROCESSES
    assert fired.value == 1 and not marker.exists()
    assert (tmp_path / "fault.fired").read_text().startswith("test.point ")


def _score_many(path: str) -> None:
    os.environ["TRELLIS_TEST_KILL_FILE"] = path
    from fault_rewards import freeze_once

    for _ in range(CALLS_EACH):
        freeze_once({"prompt": [{"role": "user", "content": "abc"}], "response": "cba", "label": "cba"})


def test_the_freeze_harness_counts_every_scoring_call_of_parallel_pools(tmp_path):
    """Tried: 4 scoring processes at once, the freeze set for the 240th call, against a sleeping child:
    the child is stopped exactly when the last call is made, and not before."""
    target = multiprocessing.get_context("fork").Process(target=signal.pause)
    target.start()
    try:
        marker = tmp_path / "kill"
        marker.write_text(f"{target.pid} {PROCESSES * CALLS_EACH - 1}")
        context = multiprocessing.get_context("fork")
        scorers = [context.Process(target=_score_many, args=(str(marker),)) for _ in range(PROCESSES)]
        for scorer in scorers:
            scorer.start()
        for scorer in scorers:
            scorer.join(timeout=120)
        assert [scorer.exitcode for scorer in scorers] == [0] * PROCESSES
        assert not marker.exists()
        with open(f"/proc/{target.pid}/stat") as stat:
            assert stat.read().split(") ")[1][0] == "T"  # stopped
    finally:
        target.kill()
        target.join()
