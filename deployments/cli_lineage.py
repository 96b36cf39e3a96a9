"""`trellis lineage RUN@STEP`: what a checkpoint came from and what was made of it, with links."""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

from trellis.deployments.run_options import ConfigOption, StorageOption, WorkDirOption, run_ref


def prefect_ui_base(home: str = "~/.trellis") -> str | None:
    """The Prefect UI the flow runs are in: PREFECT_UI_URL, else PREFECT_API_URL's, else a server
    `trellis server up` recorded."""
    if os.environ.get("PREFECT_UI_URL"):
        return os.environ["PREFECT_UI_URL"].rstrip("/")
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"].rstrip("/").removesuffix("/api")
    from trellis.deployments.server import recorded_state

    state = recorded_state(home)
    return state.url if state is not None else None


def flow_run_link(flow_run_id: str, ui: str | None) -> str:
    return f"{ui}/runs/flow-run/{flow_run_id}" if ui else f"flow run {flow_run_id}"


def lineage(
    run_at_step: Annotated[str, typer.Argument(metavar="RUN@STEP", help="A run (name or URI) and the step of one of its checkpoints.")],
    sample: Annotated[Optional[str], typer.Option(help="Also trace this trajectory row (its rollout_id).")] = None,
    work_dir: WorkDirOption = None,
    config: ConfigOption = None,
    storage_option: StorageOption = [],
) -> None:
    """Print the chain: evaluation <- export <- checkpoint <- trajectories <- flow runs <- origin."""
    from trellis.engine.storage.checkpoints import CheckpointError
    from trellis.engine.storage.lake import LakeError
    from trellis.engine.storage.lineage import lineage_chain, trace_sample
    from trellis.engine.storage.runs import RunNotFoundError, split_run_step

    try:
        name, step = split_run_step(run_at_step)
        if step is None:
            raise ValueError(f"{run_at_step!r}: name a step, as in {run_at_step}@10.")
        ref = run_ref(name, work_dir, config, storage_option)
        chain = lineage_chain(ref, step)
        traced = trace_sample(ref, sample) if sample else None
    except (RunNotFoundError, CheckpointError, LakeError, ValueError) as error:
        typer.secho(str(error), fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from None
    ui = prefect_ui_base()
    typer.echo(f"{ref.name}@{step}")
    for link in chain:
        typer.echo(f"  {link.kind:<13} {link.description}")
        if link.uri:
            typer.echo(f"  {'':<13} {link.uri}")
        for flow_run_id in link.flow_runs:
            typer.echo(f"  {'':<13} {flow_run_link(flow_run_id, ui)}")
    if traced is not None:
        typer.echo(f"sample {sample}: split={traced['split']} step {traced['step']}, policy version {traced['policy_version']}, reward {traced['reward']}")
        typer.echo(f"  checkpoint of its policy: {traced['checkpoint'] or 'never saved'}")
        typer.echo(f"  written by: {flow_run_link(traced['flow_run_id'], ui) if traced['flow_run_id'] else 'an in-process run (no flow run)'}")
