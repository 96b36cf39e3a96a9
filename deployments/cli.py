"""The `trellis` command line: build the tiny model, train from a YAML config."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="RL post-training for language models.")


@app.command("tiny-model")
def tiny_model(
    out: Annotated[Path, typer.Argument(help="Folder for the HF checkpoint (model + tokenizer).")],
    data: Annotated[Optional[Path], typer.Option(help="Also write train/eval Parquet prompts of the reverse task here.")] = None,
    warmup: Annotated[bool, typer.Option(help="Warm the model up on the task (~10 s).")] = True,
) -> None:
    """Build the bundled tiny Qwen2 model and tokenizer offline."""
    from engine.tiny.model import build_tiny_checkpoint
    from engine.tiny.reverse_task import EVAL_SEED_OFFSET, write_dataset

    build_tiny_checkpoint(out, warmup=warmup)
    typer.echo(f"model and tokenizer: {out}")
    if data is not None:
        write_dataset(data / "train.parquet", 4096, seed=0)
        write_dataset(data / "eval.parquet", 512, seed=EVAL_SEED_OFFSET)
        typer.echo(f"prompts: {data}/train.parquet, {data}/eval.parquet")


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="YAML run configuration.")],
    overrides: Annotated[list[str], typer.Option("--set", help="key=value override, e.g. --set optim.lr=1e-4.")] = [],  # noqa: B006
) -> None:
    """Train in-process (engine only)."""
    from engine.config_loading import ConfigError, load_config
    from engine.data import DatasetError
    from engine.preflight import InputError

    _quiet_libraries()
    try:
        cfg = load_config(config, overrides)
        _train_in_process(cfg)
    except (ConfigError, InputError, DatasetError) as error:
        typer.secho(str(error), fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from None


def _train_in_process(cfg) -> None:
    from tqdm import tqdm

    from engine.local_run import LocalRun

    with LocalRun(cfg) as run:
        typer.echo(f"train prompts: {run.train_report.summary()}")
        with tqdm(total=run.total_train_steps, desc="train", unit="step", file=sys.stdout) as bar:

            def on_step(report) -> None:
                metrics = report.metrics
                if report.step == 0:
                    bar.write(f"initial eval accuracy {metrics['eval/accuracy']:.3f}")
                    return
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['response/rewards/mean']:.3f}")
                if "eval/accuracy" in metrics:
                    bar.write(f"step {report.step}: eval accuracy {metrics['eval/accuracy']:.3f}")

            run.run(on_step)
    typer.echo(f"metrics: {cfg.run_uri}/logs/metrics.jsonl")


def _quiet_libraries() -> None:
    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


if __name__ == "__main__":
    app()
