"""``trellis ledger check``: whether every prompt a run drew is accounted for exactly once."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from trellis.deployments.cli_lake import RunArgument, operator_errors
from trellis.deployments.run_options import ConfigOption, StorageOption, WorkDirOption, run_ref

ledger_app = typer.Typer(no_args_is_help=True, help="A run's per-prompt ledger: what became of every prompt it drew.")


@ledger_app.command("check")
def ledger_check(
    run: RunArgument,
    epoch: Annotated[Optional[int], typer.Option(help="Check this epoch only.")] = None,
    work_dir: WorkDirOption = None,
    config: ConfigOption = None,
    storage_option: StorageOption = [],  # noqa: B006
) -> None:
    """Per sampler and epoch: prompts drawn, open, and rows by status; then every prompt drawn that no
    row ends (missing), that several rows end (doubled), or that a row ends without being drawn.
    Exits 1 when there is any such prompt, 2 when the run or its ledger cannot be read."""
    from trellis.engine.storage.ledger_check import LedgerMissingError, check_ledger, render

    with operator_errors():
        ref = run_ref(run, work_dir, config, storage_option)
        try:
            check = check_ledger(ref, epoch=epoch)
        except LedgerMissingError as error:
            raise FileNotFoundError(str(error)) from None
    for line in render(check):
        typer.echo(line)
    if not check.ok:
        raise typer.Exit(code=1)
