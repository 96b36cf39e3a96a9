"""`trellis report RUN`: plots and a self-contained HTML page of one run's metrics."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from trellis.deployments.run_options import ConfigOption, StorageOption, WorkDirOption, run_ref


def report(
    run: Annotated[str, typer.Argument(help="A run name under the work_dir, or a run folder's URI (local or s3://).")],
    out: Annotated[
        Optional[str], typer.Option("--out", help="Where to write index.html and the PNGs (any fsspec URI); default: RUN/report.")
    ] = None,
    work_dir: WorkDirOption = None,
    config: ConfigOption = None,
    storage_option: StorageOption = [],
) -> None:
    """Write a run's report: one PNG per metric panel and an index.html that embeds them."""
    from trellis.engine.config.loading import ConfigError
    from trellis.engine.storage.report import ReportError, write_report
    from trellis.engine.storage.runs import RunNotFoundError

    try:
        ref = run_ref(run, work_dir, config, storage_option)
        written = write_report(ref, out)
    except (RunNotFoundError, ReportError, ConfigError) as error:
        typer.secho(str(error), fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from None
    typer.echo(f"report: {written.html_uri}")
    for panel, uri in written.png_uris.items():
        typer.echo(f"  {panel}: {uri}")
