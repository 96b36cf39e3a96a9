"""Serve the training flow locally: a deployment plus the process that runs its flow runs.

    python -m trellis.deployments.serve configs/tiny_reverse.yaml [--cron "0 2 * * *"]

Then launch runs from the Prefect UI (edit the `config` parameter there) or with
`prefect deployment run 'rl_train/tiny-reverse'`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from prefect import serve
from prefect.deployments.runner import RunnerDeployment

from trellis.engine.config.loading import load_config
from trellis.flows.rl_train import rl_train


def deployment(config_path: Path, *, name: str = "tiny-reverse", cron: str | None = None) -> RunnerDeployment:
    config = load_config(config_path)
    return rl_train.to_deployment(
        name=name,
        parameters={"config": config.model_dump(mode="json")},
        cron=cron,
        description=f"RL training from {config_path}",
        tags=["trellis"],
    )


def main(
    config: Annotated[Path, typer.Argument(help="YAML run configuration used as the default parameter.")],
    name: Annotated[str, typer.Option(help="Deployment name.")] = "tiny-reverse",
    cron: Annotated[Optional[str], typer.Option(help="Cron schedule, e.g. '0 2 * * *'.")] = None,
) -> None:
    serve(deployment(config, name=name, cron=cron))


if __name__ == "__main__":
    typer.run(main)
