"""The `trellis` command line: build the tiny model, train from a YAML config, run the Prefect server,
and look at runs (lineage, reports, the lake)."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer

from trellis.deployments.cli_lake import runs_app, trajectories_app
from trellis.deployments.cli_ledger import ledger_app
from trellis.deployments.cli_lineage import lineage
from trellis.deployments.cli_replay import replay
from trellis.deployments.cli_report import report
from trellis.deployments.cli_server import server_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help="RL post-training for language models.")
app.add_typer(server_app, name="server")
app.add_typer(runs_app, name="runs")
app.add_typer(trajectories_app, name="trajectories")
app.add_typer(ledger_app, name="ledger")
app.command("lineage")(lineage)
app.command("report")(report)
app.command("replay")(replay)


@app.command("tiny-model")
def tiny_model(
    out: Annotated[Path, typer.Argument(help="Folder for the HF checkpoint (model + tokenizer).")],
    data: Annotated[Optional[Path], typer.Option(help="Also write train/eval Parquet prompts of the task here.")] = None,
    warmup: Annotated[bool, typer.Option(help="Warm the model up on the task (reverse ~10 s, lookup ~30 s).")] = True,
    task: Annotated[str, typer.Option(help="reverse (one turn), lookup (a tool call, then the answer) or shapes (images).")] = "reverse",
    moe: Annotated[bool, typer.Option(help="A mixture-of-experts policy (Qwen3-MoE, 8 experts, top-2); reverse task only.")] = False,
    vlm: Annotated[bool, typer.Option(help="The vision-language policy (Qwen2-VL) on the shapes task: same as --task shapes.")] = False,
) -> None:
    """Build the bundled tiny Qwen2 model (Qwen3-MoE with --moe, Qwen2-VL with --vlm) and tokenizer offline."""
    from trellis.engine.tiny import lookup_task, reverse_task, shapes_task

    tasks = {"reverse": reverse_task, "lookup": lookup_task, "shapes": shapes_task}
    if vlm:
        task = "shapes"
    if task not in tasks:
        raise typer.BadParameter(f"unknown task {task!r}: one of {sorted(tasks)}", param_hint="--task")
    module = tasks[task]
    if moe and task != "reverse":
        raise typer.BadParameter("--moe builds the reverse task's model only", param_hint="--moe")
    if moe:
        reverse_task.build_checkpoint(out, warmup=warmup, moe=True)
    else:
        module.build_checkpoint(out, warmup=warmup)
    typer.echo(f"model and tokenizer: {out}")
    if data is not None:
        module.write_dataset(data / "train.parquet", 4096, seed=0)
        module.write_dataset(data / "eval.parquet", 512, seed=module.EVAL_SEED_OFFSET)
        typer.echo(f"prompts: {data}/train.parquet, {data}/eval.parquet")


cluster_app = typer.Typer(help="A persistent local Ray cluster that runs keep attaching to.")
app.add_typer(cluster_app, name="cluster")


HomeOption = Annotated[str, typer.Option(help="Where the head's address is recorded (cluster.home).")]


@cluster_app.command("up")
def cluster_up(
    port: Annotated[int, typer.Option(help="GCS port of the head.")] = 6379,
    num_cpus: Annotated[Optional[int], typer.Option(help="CPUs the head offers (default: all).")] = None,
    home: HomeOption = "~/.trellis",
) -> None:
    """Start a local Ray head that outlives this command."""
    from trellis.engine.cluster.head import ClusterError, auth_token_file, running_head, start_head
    from trellis.engine.config import ClusterConfig

    cluster = ClusterConfig(head_port=port, num_cpus=num_cpus, home=home)
    address = running_head(cluster)
    if address:
        typer.echo(f"already running at {address}")
        return
    try:
        address = start_head(cluster)
        typer.echo(f"started at {address}: listening on 127.0.0.1 only, clients need the token in {auth_token_file(cluster)}")
    except ClusterError as error:
        typer.secho(str(error), fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1) from None


@cluster_app.command("down")
def cluster_down(home: HomeOption = "~/.trellis") -> None:
    """Stop the local Ray head (and the run workers on it)."""
    from trellis.engine.cluster.head import stop_head
    from trellis.engine.config import ClusterConfig

    typer.echo("stopped" if stop_head(ClusterConfig(home=home)) else "no head was recorded as running")


@cluster_app.command("status")
def cluster_status(home: HomeOption = "~/.trellis") -> None:
    """Say whether the recorded local head answers."""
    from trellis.engine.cluster.head import is_alive, recorded_address
    from trellis.engine.config import ClusterConfig

    cluster = ClusterConfig(home=home)
    address = recorded_address(cluster)
    if address and is_alive(address, cluster):
        typer.echo(f"running at {address}")
    else:
        typer.echo("not running")
        raise typer.Exit(code=1)


deployments_app = typer.Typer(help="Prefect deployments of the configs in configs/.")
app.add_typer(deployments_app, name="deployments")


@deployments_app.command("render")
def deployments_render(
    check: Annotated[bool, typer.Option("--check", help="Only say whether prefect.yaml is up to date.")] = False,
) -> None:
    """Write deployments/prefect.yaml from configs/*.yaml (one rl_train deployment each)."""
    from trellis.deployments.render import PREFECT_YAML, bundled_configs, render

    text = render(bundled_configs())
    if check:
        if PREFECT_YAML.read_text() != text:
            typer.secho(f"{PREFECT_YAML} is out of date; run `trellis deployments render`.", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=1)
        typer.echo(f"{PREFECT_YAML} is up to date")
        return
    PREFECT_YAML.write_text(text)
    typer.echo(f"wrote {PREFECT_YAML}")


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="YAML run configuration.")],
    overrides: Annotated[list[str], typer.Option("--set", help="key=value override, e.g. --set optim.lr=1e-4.")] = [],  # noqa: B006
    in_process: Annotated[bool, typer.Option("--in-process", help="Run the engine in this process: no Prefect, no Ray.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the run's latest complete checkpoint.")] = False,
    fork: Annotated[
        Optional[str],
        typer.Option("--fork", metavar="RUN@STEP", help="Start this experiment from a complete checkpoint of another run (a name under work_dir, or a URI)."),
    ] = None,
) -> None:
    """Train: one Prefect flow run per step, on a Ray cluster (a local one is started if none runs).

    A run that fails ends with one line on the console (its traceback goes to the run log): exit code 2
    for what the user must change (``_refused``: a setting, wherever it was raised), 1 otherwise."""
    from trellis.engine.config.loading import load_config
    from trellis.engine.run.preflight import check_inputs
    from trellis.engine.secrets import install_log_redaction, redact

    _quiet_libraries()
    refused = _refused()
    try:
        cfg = load_config(config, overrides)
        if fork is not None:
            cfg = load_config(config, [*overrides, f"load_checkpoint_cfg.checkpoint_path={fork_source(cfg, fork)}"])
        install_log_redaction(cfg.storage_options)
        check_inputs(cfg)
        if in_process:
            _train_in_process(cfg, resume)
        else:
            from trellis.engine.cluster.environment import (
                ClusterEnvironmentError,
                prepare_cluster,
            )

            refused = (*refused, ClusterEnvironmentError)
            prepare_cluster(cfg)  # connects, and checks the workers' environment before any worker exists
            _train_with_flow(cfg, resume)
    except refused as error:
        typer.secho(redact(str(error)), fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from None


def _refused() -> tuple[type[Exception], ...]:
    """What refuses a run until the user changes something: exit code 2."""
    from trellis.engine.errors import SettingError
    from trellis.engine.storage.checkpoints import CheckpointError
    from trellis.engine.storage.lake import LakeError
    from trellis.engine.storage.runs import RunNotFoundError

    return (SettingError, CheckpointError, LakeError, RunNotFoundError)


def fork_source(cfg, fork: str) -> str:
    """The complete checkpoint ``RUN@STEP`` names, checked; a clear error for anything else."""
    from trellis.engine.storage.checkpoints import CheckpointError, SaveStore, require_complete
    from trellis.engine.storage.runs import locate_run, split_run_step
    from trellis.engine.storage.store import Store

    try:
        run, step = split_run_step(fork)
    except ValueError as error:
        raise CheckpointError(f"--fork {error}") from None
    if step is None:
        raise CheckpointError(f"--fork {fork!r}: name the step of a checkpoint, as in {fork}@10.")
    source = locate_run(run, work_dir=Store(cfg.work_dir, cfg.storage_options))
    if source.uri.rstrip("/") == cfg.run_uri.rstrip("/"):
        raise CheckpointError(f"--fork {fork}: that is this experiment's own run; use --resume, or pick another experiment_name.")
    if SaveStore(Store(cfg.checkpoint_uri, cfg.storage_options)).latest() is not None:
        raise CheckpointError(f"--fork: {cfg.run_uri} already holds checkpoints; a fork starts a new experiment_name.")
    uri = f"{source.uri}/checkpoints/step-{step:06d}"
    require_complete(Store(uri, cfg.storage_options))
    return uri


def _train_in_process(cfg, resume: bool) -> None:
    from trellis.deployments.progress import RunLogTail
    from trellis.engine.run.run_log import record_failure

    tail = RunLogTail(cfg)
    try:
        _run_in_process(cfg, resume, tail)
    except Exception as error:
        record_failure(cfg, error, during="the run", next_move="the run ends")
        _end_with(error, shown=False)
    _say_where(cfg)


def _run_in_process(cfg, resume: bool, tail) -> None:
    from tqdm import tqdm

    from trellis.engine.run.local import LocalRun

    with LocalRun(cfg, resume=resume) as run:
        for line in tail.new_lines():  # how the run starts, and the dataset rows it skipped
            typer.echo(line)
        with tqdm(total=run.plan.total_steps, initial=run.step, desc="train", unit="step", file=sys.stdout) as bar:

            def on_step(report) -> None:
                for line in tail.new_lines():
                    bar.write(line)
                metrics = report.metrics
                if report.step == 0:
                    bar.write(f"initial eval accuracy {metrics['eval/accuracy']:.3f}")
                    return
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['response/rewards/mean']:.3f}")
                if "eval/accuracy" in metrics:
                    bar.write(f"step {report.step}: eval accuracy {metrics['eval/accuracy']:.3f}")

            run.run(on_step)


def _train_with_flow(cfg, resume: bool) -> None:
    import os
    import threading

    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from trellis.deployments.server import running_state

    server = running_state(cfg.cluster.home) if "PREFECT_API_URL" not in os.environ else None
    if server is not None:  # `trellis server up` left one: the run shows in its UI
        os.environ["PREFECT_API_URL"] = server.api_url
        typer.echo(f"flow runs: {server.url}/runs")
    from trellis.flows.prefect_settings import use_lean_temporary_server

    use_lean_temporary_server()  # without a Prefect server, the run starts a temporary one
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from tqdm import tqdm

    from trellis.deployments.progress import RunLogTail, follow_metrics
    from trellis.flows.rl_train import rl_train

    done, tail = threading.Event(), RunLogTail(cfg)
    bar = tqdm(total=cfg.total_train_steps, desc="train", unit="step", file=sys.stdout)  # the run plan has the total
    follower = threading.Thread(target=follow_metrics, args=(cfg, bar, done, tail), daemon=True)
    follower.start()
    failure: Exception | None = None
    try:
        # The flow heartbeat thread costs ~1 s per flow call and guards nothing a CLI run needs.
        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            rl_train(cfg, resume=resume)
    except Exception as error:
        failure = error
    finally:
        done.set()
        follower.join(timeout=5)
        bar.close()
    if failure is not None:
        _end_with(failure, shown=tail.errors_shown > 0)  # the run log's lines, shown above, said why
    _say_where(cfg)


def _end_with(error: Exception, *, shown: bool) -> NoReturn:
    """End a failed run: its one line (unless the run log's lines on the console said it already),
    exit code 2 for what the user must change, 1 otherwise."""
    from trellis.engine.errors import describe_failure

    if not shown:
        typer.secho(f"error: {describe_failure(error)}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2 if isinstance(error, _refused()) else 1) from None


def _say_where(cfg) -> None:
    typer.echo(f"trajectories: {cfg.run_uri}/trajectories  (Parquet, split=/step= partitions)")
    typer.echo(f"metrics:      {cfg.run_uri}/logs/metrics.jsonl")
    typer.echo(f"run log:      {cfg.log_uri}/run.log")
    if cfg.checkpoint_interval not in (None, -1):
        typer.echo(f"checkpoints:  {cfg.checkpoint_uri}  (resume with --resume or auto_resume: true)")
    if cfg.hf_interval not in (None, -1):
        typer.echo(f"HF exports:   {cfg.hf_uri}")
    if "tensorboard" in cfg.exp_tracker:
        typer.echo(f"tensorboard:  tensorboard --logdir {cfg.run_uri}/logs/tensorboard")
    if "wandb" in cfg.exp_tracker:
        typer.echo(f"W&B:          project {cfg.trackers.wandb.project} ({cfg.trackers.wandb.mode}; run id in {cfg.run_uri}/logs/trackers.json)")
    if "mlflow" in cfg.exp_tracker:
        typer.echo(f"MLflow:       experiment {cfg.trackers.mlflow.experiment} at {cfg.trackers.mlflow.tracking_uri or '$MLFLOW_TRACKING_URI'}")


def _quiet_libraries() -> None:
    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_not_a_prefect_run_record)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _not_a_prefect_run_record(record: logging.LogRecord) -> bool:
    """Prefect's account of each flow and task run (states, failures with their tracebacks, retries)
    goes to its API and UI; on the console, the run log's lines tell the run (``deployments.progress``)."""
    return not record.name.startswith(("prefect.flow_runs", "prefect.task_runs"))


def main() -> None:
    """The ``trellis`` console script: the commands, then a quick exit (``deployments.quick_exit``)."""
    from trellis.deployments.quick_exit import run_then_exit

    run_then_exit(app)


if __name__ == "__main__":
    main()
