"""Where a run starts (from scratch, from live workers, or from a checkpoint) and how its checkpoints
and HF exports are opened and sealed.

The same rules serve the in-process run, ``trellis train --resume``, ``auto_resume`` and a Prefect
flow retry. A checkpoint is sealed only after its step is fully recorded (trajectories, metrics,
evaluation), so resuming from step ``c`` and re-running ``c+1...`` reproduces what was lost.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict

from trellis.engine.config import TrellisConfig
from trellis.engine.run.metrics import RunCounters
from trellis.engine.storage.lineage import record_checkpoint_lineage
from trellis.engine.storage.checkpoints import (
    TRAIN_STATE,
    CheckpointError,
    SaveStore,
    read_json,
    require_complete,
    write_json,
)
from trellis.engine.storage.store import Store


class RunExistsError(CheckpointError):
    """A fresh start was asked for where a run has already saved checkpoints."""


class StartPlan(BaseModel):
    """``restore``: load ``checkpoint`` into every worker. ``reattach``: the live trainer is exactly at
    ``checkpoint``; only the controller is restored. ``continue``: live workers, no checkpoint
    involved. ``restart``: drop the live workers and start over. ``fresh``: nothing to resume."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    action: Literal["fresh", "continue", "reattach", "restore", "restart"]
    step: int  # the last completed step; training starts at step + 1
    checkpoint: str | None = None


def plan_start(config: TrellisConfig, *, resume: bool, applied_step: int = 0, workers_used: bool = False) -> StartPlan:
    """``workers_used``: some live worker already holds run state (weights, drawn prompts).

    As in the reference, a resume prefers the run's own latest checkpoint over an explicit
    ``load_checkpoint_cfg.checkpoint_path``: the explicit one is where the run started from.
    """
    latest = SaveStore(Store(config.checkpoint_uri, config.storage_options)).latest()
    resuming = resume or config.auto_resume
    if resuming and latest is not None:
        step, uri = latest
        return StartPlan(action="reattach" if applied_step == step else "restore", step=step, checkpoint=uri)
    explicit = config.load_checkpoint_cfg.checkpoint_path
    if explicit:
        return StartPlan(
            action="restore", step=int(require_complete(Store(explicit, config.storage_options))["step"]), checkpoint=explicit.rstrip("/")
        )
    if resuming:
        # Live workers with no checkpoint behind them may hold a half-recorded step: start over.
        return StartPlan(action="restart" if workers_used or applied_step > 0 else "fresh", step=0)
    if applied_step > 0:
        return StartPlan(action="continue", step=applied_step)
    if latest is not None:
        raise RunExistsError(
            f"{config.run_uri} already holds checkpoints up to step {latest[0]}. Resume it (auto_resume=true, "
            "or `trellis train --resume`), or pick another experiment_name or work_dir."
        )
    return StartPlan(action="fresh", step=0)


def train_state(step: int, counters: RunCounters) -> dict[str, float | int]:
    """The run-level state a checkpoint carries besides the workers' own. Checkpoints are written on
    weight-sync steps only, so the policy the rollout serves after it is the step's own."""
    return {
        "step": step,
        "policy_version": step,
        "samples": counters.samples,
        "tokens": counters.tokens,
        "elapsed_s": time.time() - counters.started_s,
    }


def begin_checkpoint(config: TrellisConfig, step: int) -> str:
    """An empty checkpoint folder for ``step``; the workers then write their parts into it."""
    return SaveStore(Store(config.checkpoint_uri, config.storage_options)).begin(step)


def seal_checkpoint(config: TrellisConfig, step: int, state: dict[str, float | int]) -> list[int]:
    """Write the train state and the marker, then prune; returns the pruned steps."""
    store = SaveStore(Store(config.checkpoint_uri, config.storage_options))
    write_json(state, Store(f"{store.uri(step)}/{TRAIN_STATE}", config.storage_options))
    record_checkpoint_lineage(config, step)
    store.seal(step, {"policy_version": state["policy_version"]})
    return store.prune(config.checkpoint_maxkeep)


def begin_hf_export(config: TrellisConfig, step: int) -> str:
    return SaveStore(Store(config.hf_uri, config.storage_options)).begin(step)


def seal_hf_export(config: TrellisConfig, step: int) -> list[int]:
    store = SaveStore(Store(config.hf_uri, config.storage_options))
    store.seal(step)
    return store.prune(config.hf_max_keep)


def _owner_uri(config: TrellisConfig) -> str:
    return f"{config.run_uri}/logs/started_by.json"


def record_owner(config: TrellisConfig, owner: str) -> None:
    """Note which orchestrator run (a Prefect flow run id) got this run past its start decision."""
    write_json({"owner": owner, "at": time.time()}, Store(_owner_uri(config), config.storage_options))


def started_by(config: TrellisConfig, owner: str) -> bool:
    """Whether ``owner`` already started this run: only then does its retry resume. A first attempt
    that failed before starting (a refused fresh start, say) is retried as it was asked."""
    try:
        return read_json(Store(_owner_uri(config), config.storage_options)).get("owner") == owner
    except CheckpointError:
        return False
