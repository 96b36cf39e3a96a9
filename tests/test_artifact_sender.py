"""Artifacts posted without waiting: in the order sent, in the sender's context (so Prefect links each to
the task run that made it), all recorded once ``flush`` returns, and a post that fails is a warning."""

from __future__ import annotations

import contextvars
import logging
import threading
import time

from tasks import artifact_sender

current_task = contextvars.ContextVar("current_task", default=None)


def test_posts_run_in_order_in_the_senders_context_and_flush_waits_for_them():
    posted, caller = [], threading.get_ident()

    def create(key: str) -> None:
        time.sleep(0.05)
        posted.append((key, current_task.get(), threading.get_ident() != caller))

    for step in range(3):
        current_task.set(f"log_step[step={step}]")
        artifact_sender.send(create, key=f"metrics-{step}")
    artifact_sender.flush()
    assert posted == [(f"metrics-{step}", f"log_step[step={step}]", True) for step in range(3)]


def test_a_post_that_fails_is_a_warning_not_an_error(caplog):
    def unreachable_api(key: str) -> None:
        raise ConnectionError("Prefect API down")

    with caplog.at_level(logging.WARNING, logger="tasks.artifact_sender"):
        artifact_sender.send(unreachable_api, key="metrics")
        artifact_sender.flush()
    assert "A Prefect artifact was not recorded: ConnectionError: Prefect API down" in caplog.text
