"""The per-prompt ledger accounts for every prompt a run draws: trained once, or dropped once with its
reason (filtered, failed, invalid, given up), and none twice; `trellis ledger check` says so, and
names the prompts where it is not so. Runs here are in-process (the flow's runs are checked after
every kill in test_disaggregated.py, test_faults.py and test_multi_worker.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trellis.engine.parquet_reads import read_parquet
from trellis.engine.run.local import LocalRun
from trellis.engine.storage.ledger import EXACTLY_ONCE
from trellis.engine.storage.ledger_check import check_ledger
from trellis.engine.storage.store import Store
from trellis.engine.tiny.reverse_task import write_dataset
from helpers import lake_rows, moto_s3_server, tiny_config

PROMPTS = 40
TRELLIS = str(Path(sys.executable).with_name("trellis"))


def small_config(tiny_model, tmp_path, name, **changes):
    """40 prompts, 8 a step: an epoch is 5 steps."""
    data = tmp_path / "small.parquet"
    if not data.exists():
        write_dataset(data, PROMPTS, seed=0)
    base = dict(
        experiment_name=name, total_train_steps=6, train_batch_size=8, enable_evaluate=False, enable_initial_evaluate=False,
        checkpoint_interval=2, train_dataset={"path": str(data), "max_prompt_length": 64},
    )
    work_dir = changes.pop("work_dir", tmp_path)
    return tiny_config(tiny_model, {"train": data, "eval": data}, work_dir, **{**base, **changes})


def train(config, resume: bool = False):
    with LocalRun(config, resume=resume) as run:
        run.run()
    return config


def ledger_rows(config, table: str = "groups") -> list[dict]:
    fs, root = fsspec.core.url_to_fs(f"{config.run_uri}/ledger/{table}", **config.storage_options)
    rows = []
    for path in sorted(fs.glob(f"{root}/step=*/part-0.parquet")):
        rows += read_parquet(fs, path).to_pylist()
    return rows


def trellis(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([TRELLIS, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **env})


@pytest.fixture(scope="module")
def filtered_run(tiny_model, tmp_path_factory):
    """Colocated, dynamic sampling on: groups whose 8 rewards are all equal are dropped and more prompts drawn."""
    tmp = tmp_path_factory.mktemp("filtered")
    return train(small_config(tiny_model, tmp, "filtered", dynamic_sampling={"enable": True}))


def test_a_run_with_dynamic_sampling_ends_every_prompt_it_draws_once(filtered_run):
    """Tried: the colocated trainer with dynamic sampling, 6 steps over 40 prompts. Filtered groups
    are not trained, so the sampler goes through more than one epoch; each of those prompts has one
    `filtered` row with its reason, the trained ones one `trained` row, and the lake agrees."""
    check = check_ledger(Store(filtered_run.run_uri))
    assert check.ok, check
    finished = [epoch for epoch in check.epochs if epoch.finished]
    assert finished and finished[0].epoch == 0
    for epoch in finished:
        assert epoch.statuses["trained"] + epoch.statuses["filtered"] == PROMPTS and epoch.statuses["filtered"] > 0
    rows = ledger_rows(filtered_run)
    assert all(row["reason"].startswith("dynamic sampling") for row in rows if row["status"] == "filtered")
    # Independently of the ledger: the lake's groups, trained when completed, filtered otherwise.
    lake = {(row["train_step"], row["group_id"]): row["status"] for row in lake_rows(filtered_run)}
    expected = {key: "trained" if status == "completed" else status for key, status in lake.items()}
    assert {(row["train_step"], row["group_id"]): row["status"] for row in rows} == expected
    for epoch in (e.epoch for e in finished):
        assert duckdb.sql(EXACTLY_ONCE.format(run=filtered_run.run_uri, epoch=epoch)).fetchall() == []


def test_the_check_names_a_lost_prompt_and_a_doubled_one_and_exits_1(filtered_run, tmp_path):
    """Tried: a copy of the run's ledger with one prompt's row deleted (as a lost group would leave it)
    and another's row written into a second step (as a group trained twice would). `trellis ledger
    check` names both and exits 1; the documented query finds both; the untouched run passes with 0."""
    clean = trellis("ledger", "check", filtered_run.run_uri)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert clean.stdout.splitlines()[-1] == "every prompt accounted for exactly once"

    copy = tmp_path / "doctored"
    shutil.copytree(filtered_run.run_uri, copy)
    step_one = copy / "ledger" / "groups" / "step=000001" / "part-0.parquet"
    step_two = copy / "ledger" / "groups" / "step=000002" / "part-0.parquet"
    first, second = pq.read_table(step_one).to_pylist(), pq.read_table(step_two).to_pylist()
    lost, doubled = first[0], second[0]
    pq.write_table(pa.Table.from_pylist(first[1:] + [{**doubled, "train_step": 1}], schema=pq.read_schema(step_one)), step_one)

    found = trellis("ledger", "check", str(copy))
    assert found.returncode == 1, found.stdout + found.stderr
    lines = found.stdout.splitlines()
    assert f"missing: train_dataset epoch {lost['epoch']} prompt {lost['prompt_index']}: drawn, not open, and no row ends it" in lines
    doubled_line = f"doubled: train_dataset epoch {doubled['epoch']} prompt {doubled['prompt_index']}: ended 2 times"
    assert any(line.startswith(doubled_line) for line in lines), lines
    assert lines[-1] == "2 violation(s)"
    answer = duckdb.sql(EXACTLY_ONCE.format(run=copy, epoch=0)).fetchall()
    assert sorted((prompt, times) for _, _, prompt, times in answer) == sorted(
        [(lost["prompt_index"], 0), (doubled["prompt_index"], 2)]
    )
    only_epoch_1 = trellis("ledger", "check", str(copy), "--epoch", "1")
    assert only_epoch_1.returncode == 0 and "train_dataset      0" not in only_epoch_1.stdout


def test_the_check_refuses_a_run_without_a_ledger_with_a_clear_line(tmp_path):
    (tmp_path / "empty" / "logs").mkdir(parents=True)
    result = trellis("ledger", "check", str(tmp_path / "empty"))
    assert result.returncode == 2 and result.stderr.strip().endswith("/empty/ledger/groups/.")
    assert "Traceback" not in result.stderr
    missing = trellis("ledger", "check", "nope", "--work-dir", str(tmp_path))
    assert missing.returncode == 2 and "nope" in missing.stderr


def test_an_asynchronous_run_with_dynamic_sampling_records_the_groups_its_producer_drops(tiny_model, tmp_path):
    """Tried: the disaggregated trainer with dynamic sampling. Its producer drops flat groups before
    they reach the buffer; they are written at the next step as `filtered`, the groups still in the
    buffer stay open, and every drawn prompt is open or ended once."""
    config = train(small_config(
        tiny_model, tmp_path, "async_filtered", trainer="disaggregated", replay_buffer={"max_staleness": 1},
        dynamic_sampling={"enable": True}, total_train_steps=8,
    ))
    check = check_ledger(Store(config.run_uri))
    assert check.ok, check
    assert sum(epoch.statuses["filtered"] for epoch in check.epochs) > 0
    assert check.epochs[0].finished
    assert check.epochs[0].statuses["trained"] + check.epochs[0].statuses["filtered"] == PROMPTS
    trained = [row for row in ledger_rows(config) if row["status"] == "trained"]
    assert len(trained) == 8 * 8  # the trained groups are the batches, 8 a step
    open_rows = [row for row in ledger_rows(config, "open") if row["train_step"] == 8 and row["kind"] == "open"]
    assert sum(epoch.open for epoch in check.epochs) == len(open_rows) > 0  # the buffer ran ahead


@pytest.mark.parametrize("tail_batch_trigger_size, status", [(-1, "given_up"), (0, "expired")])
def test_groups_too_stale_after_a_resume_are_given_up_or_made_again(tiny_model, tmp_path, tail_batch_trigger_size, status):
    """Tried: 4 asynchronous steps with max_staleness 2 (the checkpoint at step 4 keeps the groups the
    producer made ahead), then a resume with max_staleness 0, under which those groups are too stale.
    With tail_batch_trigger_size -1 they are `given_up` (their prompts end there); otherwise they
    `expire`, and their prompts are made again and trained later (or are still open at the end)."""
    config = train(small_config(tiny_model, tmp_path, "stale", trainer="disaggregated", replay_buffer={"max_staleness": 2}, total_train_steps=4))
    buffered = sum(epoch.open for epoch in check_ledger(Store(config.run_uri)).epochs)
    assert buffered > 0  # what the resume will find too stale
    stricter = {"max_staleness": 0, "tail_batch_trigger_size": tail_batch_trigger_size}
    train(config.model_copy(update={"total_train_steps": 8, "replay_buffer": config.replay_buffer.model_copy(update=stricter)}), resume=True)
    check = check_ledger(Store(config.run_uri))
    assert check.ok, check
    rows = ledger_rows(config)
    dropped = [row for row in rows if row["status"] == status]
    # The checkpoint holds the groups open at step 4's record and any the producer made during step 4's
    # fit after that record (seen once on a loaded machine: 8 more, made with step 3's weights), so at
    # least `buffered` are dropped, all with the first batch after the resume, and none of them, nor any
    # other group too stale for max_staleness 0 (made before step - 1's weights), is trained.
    assert len(dropped) >= buffered and all(row["train_step"] == 5 for row in dropped), dropped
    assert all(row["oldest_version"] < 4 for row in dropped), dropped
    too_stale = [row for row in rows if row["status"] == "trained" and row["train_step"] >= 5 and row["oldest_version"] < row["train_step"] - 1]
    assert too_stale == [], too_stale
    if status == "expired":
        trained = {(row["epoch"], row["prompt_index"]) for row in rows if row["status"] == "trained" and row["train_step"] >= 5}
        still_open = {(row["epoch"], row["prompt_index"]) for row in ledger_rows(config, "open") if row["train_step"] == 8 and row["kind"] == "open"}
        assert {(row["epoch"], row["prompt_index"]) for row in dropped} <= trained | still_open


def test_a_multi_task_run_keeps_a_ledger_per_task(tiny_model, tmp_path):
    """Each task has a sampler and epochs of its own: the ledger keys prompts by task."""
    long, short = write_dataset(tmp_path / "long.parquet", PROMPTS, seed=0), write_dataset(tmp_path / "short.parquet", 24, seed=5)
    config = small_config(tiny_model, tmp_path, "tasks", train_dataset=None, eval_dataset=None, tasks=[
        {"name": "long", "weight": 2, "train_dataset": {"path": str(long), "max_prompt_length": 64}},
        {"name": "short", "weight": 1, "train_dataset": {"path": str(short), "max_prompt_length": 64}},
    ])
    check = check_ledger(Store(train(config).run_uri))
    assert check.ok, check
    assert {(epoch.sampler, epoch.prompts) for epoch in check.epochs} >= {("long", PROMPTS), ("short", 24)}
    assert sum(epoch.statuses["trained"] for epoch in check.epochs) == 6 * 8


def test_the_check_reads_a_ledger_on_s3(tiny_model, tmp_path):
    """The same run and check with the run's storage on S3 (moto on loopback), from the shell."""
    with moto_s3_server() as endpoint:
        storage = {"key": "ledger-key", "secret": "ledger-secret", "endpoint_url": endpoint}
        fsspec.filesystem("s3", **storage).mkdir("ledger-test")
        train(small_config(tiny_model, tmp_path, "on_s3", total_train_steps=2, work_dir="s3://ledger-test/runs", storage_options=storage))
        env = {"AWS_ACCESS_KEY_ID": "ledger-key", "AWS_SECRET_ACCESS_KEY": "ledger-secret"}
        result = trellis("ledger", "check", "s3://ledger-test/runs/on_s3", "-o", f"endpoint_url={endpoint}", **env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[2].split()[:6] == ["train_dataset", "0", str(PROMPTS), "16", "0", "16"]
