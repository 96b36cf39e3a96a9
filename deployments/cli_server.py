"""`trellis server up | down | status`: a Prefect server, its work pool and worker, and the deployments."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

server_app = typer.Typer(help="A Prefect server with the work pool, worker and deployments of trellis.")

HomeOption = Annotated[str, typer.Option(help="Where the server keeps its database, logs and pids ({home}/prefect).")]


@server_app.command("up")
def server_up(
    port: Annotated[int, typer.Option(help="Port of the API and UI (on 127.0.0.1).")] = 4200,
    database_url: Annotated[
        Optional[str],
        typer.Option(help="SQLAlchemy URL of a team database, e.g. postgresql+asyncpg://user:pass@host/prefect; default SQLite."),
    ] = None,
    deploy: Annotated[bool, typer.Option(help="Apply deployments/prefect.yaml.")] = True,
    home: HomeOption = "~/.trellis",
) -> None:
    """Start the server and a worker for the `trellis-local` pool (or find them up), and deploy."""
    from trellis.deployments.server import ServerError, start

    try:
        state = start(home, port, database_url, deploy)
    except ServerError as error:
        typer.secho(str(error), fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1) from None
    typer.echo(f"Prefect UI:  {state.url}   (database: {state.database})")
    typer.echo(f"API:         export PREFECT_API_URL={state.api_url}")
    typer.echo("deployments: " + ("applied from deployments/prefect.yaml" if deploy else "not applied (--no-deploy)"))
    typer.echo("train runs launched with `trellis train` now show in this UI")


@server_app.command("down")
def server_down(home: HomeOption = "~/.trellis") -> None:
    """Stop the worker and the server."""
    from trellis.deployments.server import stop

    typer.echo("stopped" if stop(home) else "no server was recorded as running")


@server_app.command("status")
def server_status(home: HomeOption = "~/.trellis") -> None:
    """Say whether the recorded server answers (exit 1 if not)."""
    from trellis.deployments.server import process_alive, recorded_state, running_state

    state = running_state(home)
    if state is None:
        typer.echo("not running" if recorded_state(home) is None else "recorded, but not answering: `trellis server down`, then up")
        raise typer.Exit(code=1)
    worker = "running" if process_alive(state.worker_pid) else "NOT running (`trellis server down`, then up)"
    typer.echo(f"running at {state.url} (database: {state.database}); worker for pool trellis-local: {worker}")
