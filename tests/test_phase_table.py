"""The phase table is what the flow runs: every row is a Prefect task named after it (``fit[step=12]``
in the UI), with the row's retries; the step's order names only rows; a row's retry policy keeps its
meaning (``fit`` never retries, a checkpoint's files are retried once, the rest twice unless a setting
failed them)."""

from __future__ import annotations

import ast
from pathlib import Path

from trellis.engine.run.phases import PHASES
from trellis.tasks.step_tasks import PHASE_TASKS, unless_a_setting_error

ROOT = Path(__file__).resolve().parents[1]


def test_every_row_is_a_named_prefect_task_with_its_retries():
    assert set(PHASE_TASKS) == set(PHASES)
    for name, task in PHASE_TASKS.items():
        assert task.name == name and task.task_run_name == f"{name}[step={{step}}]"
        assert task.task_key.startswith(f"{name}-")  # distinct in the UI although made by one factory
        assert task.retries == PHASES[name].retries.count
    assert PHASE_TASKS["fit"].retries == 0
    assert PHASE_TASKS["save_checkpoint"].retries == PHASE_TASKS["export_hf"].retries == 1
    assert PHASE_TASKS["get_batch"].retry_condition_fn is unless_a_setting_error
    assert [hook.doing for hook in PHASES["get_batch"].on_retry] == ["replacing lost rollout workers", "restarting the producer"]


def test_the_step_and_the_run_name_only_rows_of_the_table():
    used = set()
    for module in ("engine/run/step.py", "engine/run/loop.py"):
        for node in ast.walk(ast.parse((ROOT / module).read_text())):
            if isinstance(node, ast.Name) and node.id.isupper() and node.id.replace("_", "").isalpha():
                used.add(node.id.lower())
    assert used - {"batch_sources"} <= set(PHASES)
    assert {"produce_batch", "get_batch", "fit", "sync_weights", "check_weights", "log_step", "continue_produce"} <= used
