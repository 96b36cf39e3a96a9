"""`trellis runs ls`, `trellis trajectories query` and `trellis trajectories show` on one real in-process
run, locally and copied into an S3 bucket (moto): the answers match the files, and what a new user
mistypes ends in one clear line and exit code 2. `trellis trajectories` and `trellis report` also run as
the installed executable, in a process of their own: what goes wrong only at the interpreter's exit
(an arrow abort, apache/arrow#34314) shows there and not in typer's in-process runner."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from matplotlib.image import imread
from typer.testing import CliRunner

from trellis.deployments.cli_lake import runs_app, trajectories_app
from trellis.engine.run.local import LocalRun
from trellis.engine.storage.lake_query import QueryError, query
from trellis.engine.storage.runs import RunRef
from helpers import moto_s3_server, tiny_config

RUN = "lake"
BUCKET = "lake-shell"
TRELLIS = str(Path(sys.executable).with_name("trellis"))
REPORT_PANELS = {"reward", "eval", "response_length", "throughput", "mismatch", "goodput"}  # a colocated run's
REWARDS_PER_STEP = "SELECT step, avg(reward) AS reward FROM trajectories WHERE split='train' GROUP BY step ORDER BY step"

app = typer.Typer()
app.add_typer(runs_app, name="runs")
app.add_typer(trajectories_app, name="trajectories")


def trellis(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def work_dir(tiny_model, reverse_data, tmp_path_factory):
    """Two steps of 4 prompts x 4 samples; evaluated at steps 0 and 2, checkpointed and exported at 2."""
    root = tmp_path_factory.mktemp("work")
    config = tiny_config(
        tiny_model, reverse_data, root, experiment_name=RUN,
        total_train_steps=2, train_batch_size=4, prompt_repeat_k=4, hf_interval=2,
        eval_dataset={"path": str(reverse_data["eval"]), "max_prompt_length": 64, "limit": 8},
    )
    with LocalRun(config) as run:
        run.run()
    return root


@pytest.fixture(scope="module")
def s3_work_dir(work_dir):
    """The same run copied into a bucket; credentials come from the environment, as an operator's would."""
    with moto_s3_server() as endpoint, pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "lake-key")
        env.setenv("AWS_SECRET_ACCESS_KEY", "lake-secret")
        s3 = fsspec.filesystem("s3", endpoint_url=endpoint)
        s3.mkdir(BUCKET)
        s3.put(str(work_dir / RUN), f"{BUCKET}/work/{RUN}", recursive=True)
        yield f"s3://{BUCKET}/work", endpoint


def metrics(work_dir) -> dict[int, dict]:
    lines = (work_dir / RUN / "logs" / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


def part(work_dir, split: str, step: int) -> list[dict]:
    return pq.read_table(work_dir / RUN / "trajectories" / f"split={split}" / f"step={step:06d}" / "part-0.parquet").to_pylist()


def json_rows(result) -> list[dict]:
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_runs_ls_shows_steps_reward_eval_and_checkpoints(work_dir):
    result = trellis("runs", "ls", str(work_dir))
    assert result.exit_code == 0, result.stderr
    header, line = result.stdout.splitlines()
    assert header.split() == ["RUN", "STEPS", "REWARD", "EVAL", "ACC@STEP", "CHECKPOINTS", "HF", "GOODPUT"]
    logged = metrics(work_dir)
    goodput = sum(logged[s]["goodput/device_s/trained_tokens"] for s in (1, 2)) / sum(
        v for s in (1, 2) for k, v in logged[s].items() if k.startswith("goodput/device_s/"))
    assert 0 < goodput < 1
    assert line.split() == [RUN, "2/2", f"{logged[2]['response/rewards/mean']:.3f}", f"{logged[2]['eval/accuracy']:.3f}@2", "2", "2",
                            f"{100 * goodput:.0f}%"]


def test_query_answers_as_pyarrow_reads_the_parts(work_dir):
    answer = json_rows(trellis("trajectories", "query", RUN, REWARDS_PER_STEP, "--work-dir", str(work_dir), "--format", "json"))
    expected = []
    for step in (1, 2):
        rewards = [row["reward"] for row in part(work_dir, "train", step)]
        expected.append({"step": step, "reward": pytest.approx(sum(rewards) / len(rewards), rel=1e-12)})
    assert answer == expected

    partitions = "SELECT split, step, count(*) AS n FROM trajectories GROUP BY ALL ORDER BY split, step"
    counts = json_rows(trellis("trajectories", "query", RUN, partitions, "--work-dir", str(work_dir), "--format", "json"))
    assert counts == [
        {"split": split, "step": step, "n": len(part(work_dir, split, step))}
        for split, step in [("eval", 0), ("eval", 2), ("train", 1), ("train", 2)]
    ]
    # Filters on the partition columns select exactly that part.
    one_part = "SELECT rollout_id FROM trajectories WHERE split = 'eval' AND step = 2 ORDER BY rollout_id"
    ids = json_rows(trellis("trajectories", "query", RUN, one_part, "--work-dir", str(work_dir), "--format", "json"))
    assert [row["rollout_id"] for row in ids] == sorted(row["rollout_id"] for row in part(work_dir, "eval", 2))


def test_query_reads_the_ledger_and_prints_a_table_and_csv(work_dir):
    per_step = "SELECT step, count(*) AS groups, sum(samples) AS samples FROM ledger GROUP BY step ORDER BY step"
    assert json_rows(trellis("trajectories", "query", RUN, per_step, "--work-dir", str(work_dir), "--format", "json")) == [
        {"step": 1, "groups": 4, "samples": 16}, {"step": 2, "groups": 4, "samples": 16},
    ]
    table = trellis("trajectories", "query", str(work_dir / RUN), per_step)  # the run folder itself names the run
    assert table.stdout.splitlines() == ["step  groups  samples", "   1       4       16", "   2       4       16", "(2 rows)"]
    csv = trellis("trajectories", "query", RUN, per_step, "--work-dir", str(work_dir), "--format", "csv")
    assert csv.stdout.splitlines() == ["step,groups,samples", "1,4,16", "2,4,16"]


def test_show_prints_the_stored_prompts_responses_and_rewards(work_dir):
    result = trellis("trajectories", "show", RUN, "--step", "2", "--work-dir", str(work_dir), "--limit", "0")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"{RUN} · train step 2 · 4 prompts"
    for row in part(work_dir, "train", 2):
        assert f"{row['reward']:6.2f}  {row['response']}" in lines
        assert f"  prompt: {row['prompt'][0]['content']}" in lines
    assert len([line for line in lines if line.startswith("train-000002-g")]) == 4

    first = trellis("trajectories", "show", f"{RUN}@2", "--split", "eval", "--limit", "1", "--work-dir", str(work_dir))
    assert first.stdout.splitlines()[0] == f"{RUN} · eval step 2 · the first 1 prompts"


@pytest.mark.parametrize(
    "args, message",
    [
        (["trajectories", "query", "lkae", "SELECT 1"], f"No run named 'lkae' under {{work}}. Runs there: {RUN}."),
        (["trajectories", "show", RUN, "--step", "5"], f"{RUN} has no train step 5; stored train steps: 1-2."),
        (["trajectories", "show", RUN, "--step", "1", "--split", "test"], f"{RUN} has no 'test' split; stored splits: eval, train."),
        (["trajectories", "query", RUN, "SELEC step FROM trajectories"], 'Parser Error: syntax error at or near "SELEC"'),
        (["trajectories", "query", RUN, "SELECT rewards FROM trajectories"], 'Referenced column "rewards" not found'),
        (["trajectories", "query", RUN, "SELECT * FROM trajectory"], "Table with name trajectory does not exist"),
    ],
)
def test_a_mistyped_command_says_what_exists_in_one_line(work_dir, args, message):
    result = trellis(*args, "--work-dir", str(work_dir))
    assert result.exit_code == 2
    assert message.format(work=work_dir) in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_a_missing_column_lists_the_columns(work_dir):
    result = trellis("trajectories", "query", RUN, "SELECT rewards FROM trajectories", "--work-dir", str(work_dir))
    assert "Columns of trajectories: run, train_step," in result.stderr and ", reward, " in result.stderr
    assert ", split, step." in result.stderr


def test_a_column_added_later_reads_as_null_in_the_parts_written_before_it(work_dir, tmp_path):
    shutil.copytree(work_dir / RUN / "trajectories", tmp_path / RUN / "trajectories")
    newer = tmp_path / RUN / "trajectories" / "split=train" / "step=000002" / "part-0.parquet"
    table = pq.read_table(newer)
    pq.write_table(table.append_column("added_later", pa.array(["x"] * table.num_rows)), newer)

    counts = query(RunRef(str(tmp_path / RUN)), "SELECT step, count(added_later) AS n FROM trajectories GROUP BY step ORDER BY step")
    assert counts.to_pylist() == [{"step": 0, "n": 0}, {"step": 1, "n": 0}, {"step": 2, "n": table.num_rows}]


def test_a_work_dir_that_does_not_exist(tmp_path):
    missing = str(tmp_path / "nowhere")
    listed = trellis("runs", "ls", missing)
    assert listed.exit_code == 2 and listed.stderr == f"work_dir {missing} does not exist.\n"
    queried = trellis("trajectories", "query", RUN, "SELECT 1", "--work-dir", missing)
    assert queried.exit_code == 2 and queried.stderr == f"No run named '{RUN}': work_dir {missing} does not exist.\n"


def test_a_run_without_trajectories_yet(tmp_path):
    (tmp_path / "starting" / "logs").mkdir(parents=True)
    listed = trellis("runs", "ls", str(tmp_path))
    assert listed.stdout.splitlines()[1].split() == ["starting", "-/-", "-", "-", "-", "-", "-"]
    with pytest.raises(QueryError, match="starting has no trajectories yet"):
        query(RunRef(str(tmp_path / "starting")), "SELECT count(*) FROM trajectories")
    shown = trellis("trajectories", "show", "starting", "--step", "1", "--work-dir", str(tmp_path))
    assert shown.exit_code == 2 and "starting has no trajectories yet" in shown.stderr


def test_on_s3_the_commands_answer_as_they_do_locally(work_dir, s3_work_dir):
    s3_root, endpoint = s3_work_dir
    storage = ["-o", f"endpoint_url={endpoint}"]
    local, remote = trellis("runs", "ls", str(work_dir)), trellis("runs", "ls", s3_root, *storage)
    assert remote.exit_code == 0, remote.stderr
    assert remote.stdout == local.stdout

    for sql in (REWARDS_PER_STEP, "SELECT split, step, count(*) AS n FROM trajectories GROUP BY ALL ORDER BY ALL"):
        on_s3 = trellis("trajectories", "query", RUN, sql, "--work-dir", s3_root, *storage, "--format", "json")
        assert json_rows(on_s3) == json_rows(trellis("trajectories", "query", RUN, sql, "--work-dir", str(work_dir), "--format", "json"))

    missing = trellis("trajectories", "show", f"{s3_root}/{RUN}", "--step", "9", *storage)
    assert missing.exit_code == 2 and "stored train steps: 1-2" in missing.stderr


def installed_trellis(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The `trellis` executable beside this Python, run as a user runs it, from a folder of its own."""
    return subprocess.run([TRELLIS, *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def assert_clean_exit(result: subprocess.CompletedProcess) -> None:
    # An abort at exit is a negative return code (SIGABRT) even after every line was printed.
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr and "Aborted" not in result.stderr, result.stderr[-3000:]


def test_the_installed_trellis_trajectories_query_and_show_answer_and_exit_cleanly(work_dir, tmp_path):
    """Tried as the executable: a JSON query over both splits (its answer against pyarrow's reading of
    the parts), the same query as a table, and `show` of a step (each stored response with its reward)."""
    sql = "SELECT split, step, count(*) AS n, avg(reward) AS reward FROM trajectories GROUP BY ALL ORDER BY split, step"
    answered = installed_trellis("trajectories", "query", RUN, sql, "--work-dir", str(work_dir), "--format", "json", cwd=tmp_path)
    assert_clean_exit(answered)
    expected = []
    for split, step in [("eval", 0), ("eval", 2), ("train", 1), ("train", 2)]:
        rewards = [row["reward"] for row in part(work_dir, split, step)]
        expected.append({"split": split, "step": step, "n": len(rewards), "reward": pytest.approx(sum(rewards) / len(rewards), rel=1e-12)})
    assert json.loads(answered.stdout) == expected

    table = installed_trellis("trajectories", "query", str(work_dir / RUN), sql, cwd=tmp_path)
    assert_clean_exit(table)
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["split", "step", "n", "reward"] and lines[-1] == "(4 rows)"
    assert [line.split()[:3] for line in lines[1:-1]] == [[row["split"], str(row["step"]), str(row["n"])] for row in expected]

    shown = installed_trellis("trajectories", "show", RUN, "--step", "2", "--limit", "0", "--work-dir", str(work_dir), cwd=tmp_path)
    assert_clean_exit(shown)
    lines = shown.stdout.splitlines()
    assert lines[0] == f"{RUN} · train step 2 · 4 prompts"
    for row in part(work_dir, "train", 2):
        assert f"{row['reward']:6.2f}  {row['response']}" in lines
        assert f"  prompt: {row['prompt'][0]['content']}" in lines


def test_the_installed_trellis_lineage_traces_a_sample_and_exits_cleanly_every_time(work_dir, tmp_path):
    """Tried: `trellis lineage lake@2 --sample ID` as the executable, 4 times; the traced row must be
    the one stored. Its former reading (a pyarrow dataset over fsspec) aborted at exit now and then,
    which failed CI once; bench/exit_aborts.py counts those aborts over many runs, which a test can't afford."""
    row = part(work_dir, "train", 2)[3]
    for _ in range(4):
        shown = installed_trellis("lineage", f"{RUN}@2", "--work-dir", str(work_dir), "--sample", row["rollout_id"], cwd=tmp_path)
        assert_clean_exit(shown)
    assert f"sample {row['rollout_id']}: split=train step 2, policy version {row['policy_version']}, reward {row['reward']}" in shown.stdout
    assert "written by: an in-process run (no flow run)" in shown.stdout


def test_the_installed_trellis_report_writes_the_page_and_a_plot_per_panel(work_dir, tmp_path):
    """Tried as the executable: `trellis report RUN --out DIR` exits 0, prints the page and one line per
    panel, and writes exactly those files: real PNGs with something drawn, each embedded in the page."""
    out = tmp_path / "report"
    result = installed_trellis("report", RUN, "--work-dir", str(work_dir), "--out", str(out), cwd=tmp_path)
    assert_clean_exit(result)
    head, *panel_lines = result.stdout.splitlines()
    assert head == f"report: {out}/index.html"
    printed = dict(line.strip().split(": ", 1) for line in panel_lines)
    assert set(printed) == REPORT_PANELS and all(uri == f"{out}/{panel}.png" for panel, uri in printed.items())
    assert sorted(p.name for p in out.iterdir()) == sorted(["index.html", *(f"{panel}.png" for panel in REPORT_PANELS)])

    page = (out / "index.html").read_text()
    assert RUN in page
    for panel in REPORT_PANELS:
        png = (out / f"{panel}.png").read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and imread(io.BytesIO(png), format="png").var() > 0, panel
        assert f'src="data:image/png;base64,{base64.b64encode(png).decode()}"' in page, panel


def test_the_installed_trellis_queries_a_run_on_s3_and_exits_cleanly(work_dir, s3_work_dir, tmp_path):
    """Tried as the executable, through s3fs (its own threads and event loop at exit): the per-step
    rewards of the run in the bucket, the same as the local run's."""
    s3_root, endpoint = s3_work_dir
    on_s3 = installed_trellis("trajectories", "query", RUN, REWARDS_PER_STEP, "--work-dir", s3_root, "-o", f"endpoint_url={endpoint}",
                              "--format", "json", cwd=tmp_path)
    assert_clean_exit(on_s3)
    assert json.loads(on_s3.stdout) == json_rows(trellis("trajectories", "query", RUN, REWARDS_PER_STEP, "--work-dir", str(work_dir), "--format", "json"))
