"""`trellis replay RUN@STEP --set key=value`: a stored step applied again, as the run applied it and with
changed settings, from the same policy; the comparison is printed and written beside the run."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from trellis.deployments.run_options import ConfigOption, StorageOption, WorkDirOption, run_ref


def replay(
    run_at_step: Annotated[str, typer.Argument(metavar="RUN@STEP", help="A run (name or URI) and one of its stored steps.")],
    overrides: Annotated[list[str], typer.Option("--set", help="A changed setting key=value, e.g. --set loss.clip_eps_high=0.28.")] = [],  # noqa: B006
    name: Annotated[Optional[str], typer.Option(help="Name of the replay's folder under {run}/replays/ (default: from the changes).")] = None,
    work_dir: WorkDirOption = None,
    config: ConfigOption = None,
    storage_option: StorageOption = [],
) -> None:
    """Rebuild the policy before STEP (its last checkpoint, then the stored steps in between), apply the
    step's stored rollouts with the run's settings and with --set's, and compare the two updates: loss,
    grad norm, clip fraction, advantages, and the KL between the two updated policies."""
    from trellis.engine.errors import SettingError
    from trellis.engine.run.replay import comparison_markdown, replay_step
    from trellis.engine.storage.checkpoints import CheckpointError
    from trellis.engine.storage.lake import LakeError
    from trellis.engine.storage.runs import RunNotFoundError, split_run_step

    try:
        run, step = split_run_step(run_at_step)
        if step is None:
            raise ValueError(f"{run_at_step!r}: name the step to replay, as in {run_at_step}@10.")
        comparison = replay_step(run_ref(run, work_dir, config, storage_option), step, list(overrides), name=name)
    except (SettingError, RunNotFoundError, CheckpointError, LakeError, ValueError) as error:
        typer.secho(str(error), fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from None
    typer.echo(comparison_markdown(comparison))
    typer.echo(f"written to {comparison.folder}/comparison.md and comparison.json")
