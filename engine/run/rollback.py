"""The stability guard's phases (``guard:``), written once for both runners.

``check_stability`` runs after a step's update: the guard's rules (``engine.run.guard``) over the step's
metrics. When one trips, the step goes no further (nothing is saved, synced or evaluated with its
weights) and ``roll_back`` takes the run back to its last good complete checkpoint:

1. the controller (prompt order unless ``guard.skip_batches``, replay buffer, the guard's history) and
   every trainer rank (weights, optimizer, schedule) load that checkpoint; the learning rate is
   ``guard.lr_factor`` to the power of the run's rollbacks times the configured one;
2. the steps after it are set aside (``engine.storage.rollbacks``): their lake partitions, ledger parts,
   lineage records and metrics lines move under ``{run}/rollbacks/rollback=NN/``, and any checkpoint of
   theirs is unsealed, so no resume starts from it;
3. the rollout engines get the checkpoint's weights (an attested sync where syncs are attested);
4. the trip goes to ``rollbacks/trips.jsonl``, the run log and (in the flow) a Prefect artifact.

The run then goes on from the step after the checkpoint. A checkpoint is good once ``guard.confirm_steps``
steps after it passed: an update's damage shows in the rollouts of the step after it. With
``guard.on_trip: stop``, past ``guard.max_rollbacks``, or with no good checkpoint, the run stops with
``StabilityGuardTripped`` instead (not retried: the same weights would trip again).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from trellis.engine.config import GuardConfig, TrellisConfig
from trellis.engine.errors import SettingError
from trellis.engine.rollout.production.controller import Controller
from trellis.engine.run.context import PhaseContext
from trellis.engine.run.guard import StabilityGuard, Trip
from trellis.engine.run.metrics import RunCounters
from trellis.engine.run.run_log import run_log_for
from trellis.engine.run.workers import Call, each
from trellis.engine.storage.checkpoints import SaveStore, require_complete
from trellis.engine.storage.rollbacks import read_trips, record_trip, set_aside, set_aside_device_s
from trellis.engine.storage.store import Store
from trellis.engine.train.worker import TrainingWorker
from trellis.engine.train.worker_checkpoint import apply_optim_settings


class StabilityGuardTripped(SettingError):
    """The guard stopped the run; ``page`` is the markdown the flow publishes. A setting error: retrying
    the same weights would trip again, so neither Prefect nor the run retries it."""

    def __init__(self, message: str, page: str) -> None:
        super().__init__(message)
        self.page = page


@dataclass(frozen=True)
class RolledBack:
    trip: Trip
    rollback: int  # its number in the run, from 1
    to_step: int  # the checkpoint's step: the run goes on with the step after it
    checkpoint: str
    discarded: tuple[int, ...]
    lr_scale: float
    archive: str
    counters: RunCounters  # the checkpoint's throughput counters


def _check_on(controller: Controller, rules: GuardConfig, step: int, metrics: dict[str, float]) -> Trip | None:
    guard = StabilityGuard(rules)
    guard.load_state_dict(controller.guard_state)
    trip = guard.check(step, metrics)
    if trip is None:
        controller.guard_state = guard.state_dict()
    return trip


def check_stability(ctx: PhaseContext, step: int, metrics: dict[str, float]) -> Trip | None:
    """The guard's rules over the step's metrics once its update is applied; None when they pass."""
    return each(ctx.workers, "controller", _check_on, ctx.config.guard, step, metrics)[0]


def good_checkpoint(config: TrellisConfig, step: int) -> tuple[int, str] | None:
    """The latest complete checkpoint confirmed by ``guard.confirm_steps`` passed steps before ``step``. A
    disaggregated run trains a policy's rollouts up to ``replay_buffer.max_staleness`` steps later, so its
    checkpoints wait that much longer to be confirmed."""
    saved = SaveStore(Store(config.checkpoint_uri, config.storage_options))
    lag = config.guard.confirm_steps + (config.replay_buffer.max_staleness if config.disaggregated else 0)
    good = [s for s in saved.complete_steps() if s + lag < step]
    return (good[-1], saved.uri(good[-1])) if good else None


def _rewind_controller_on(controller: Controller, checkpoint: str, load_dataset: bool) -> None:
    controller.load_checkpoint(checkpoint, load_dataset=load_dataset)


def _rewind_trainer_on(trainer: TrainingWorker, checkpoint: Store, load_optimizer: bool, lr_scale: float) -> None:
    trainer.load_checkpoint(checkpoint, load_optimizer=load_optimizer)
    trainer.lr_scale = lr_scale
    apply_optim_settings(trainer)


def roll_back(ctx: PhaseContext, step: int, trip: Trip, counters: RunCounters, tripped_s: float) -> RolledBack:
    """Back to the last good checkpoint (the module's docstring says what that takes). ``counters``: the
    run's before the tripped step, which ran ``tripped_s`` seconds."""
    config, rules = ctx.config, ctx.config.guard
    run = Store(config.run_uri, config.storage_options)
    rollbacks = sum(1 for earlier in read_trips(run) if earlier.get("action") == "rollback")
    target = good_checkpoint(config, step)
    if rules.on_trip == "stop" or rollbacks >= rules.max_rollbacks or target is None:
        _stop(config, run, trip, rollbacks, target)
    assert target is not None
    to_step, checkpoint = target
    number, lr_scale = rollbacks + 1, rules.lr_factor ** (rollbacks + 1)
    load = config.load_checkpoint_cfg
    calls = [Call("controller", _rewind_controller_on, (checkpoint, not rules.skip_batches))]
    if "trainer" in ctx.workers.roles:
        calls.append(Call("trainer", _rewind_trainer_on, (Store(checkpoint, config.storage_options), load.load_optimizer_states, lr_scale)))
    ctx.workers.run(*calls)
    discarded = list(range(to_step + 1, step + 1))
    saved = SaveStore(Store(config.checkpoint_uri, config.storage_options))
    for later in saved.complete_steps():
        if later > to_step:
            saved.unseal(later)
    archive = set_aside(run, number, discarded, skip_batches=rules.skip_batches)
    ctx.workers.open_trackers(to_step + 1)
    if "rollout" in ctx.workers.roles and "trainer" in ctx.workers.roles:
        ctx.workers.sync_weights(to_step)
    rolled = RolledBack(trip, number, to_step, checkpoint, tuple(discarded), lr_scale, archive,
                        _counters_after(ctx, counters, checkpoint, archive, tripped_s))
    record_trip(run, {**trip_record(trip), "action": "rollback", "rollback": number, "to_step": to_step, "checkpoint": checkpoint,
                      "discarded": discarded, "lr_scale": lr_scale, "skip_batches": rules.skip_batches, "archive": archive})
    prompts = "never trained on again" if rules.skip_batches else "drawn again"
    run_log_for(config).warning(
        f"Step {step}: the stability guard tripped ({trip.summary()}). Rolled back to the checkpoint of step {to_step} "
        f"(rollback {number} of at most {rules.max_rollbacks}); steps {_span(discarded)} set aside in {archive}, their prompts "
        f"{prompts}; learning rate now {lr_scale:g} x the configured one."
    )
    return rolled


def _counters_after(ctx: PhaseContext, counters: RunCounters, checkpoint: str, archive: str, tripped_s: float) -> RunCounters:
    """The run's wall clock goes on; its trained samples and tokens are the checkpoint's again; the device-
    seconds of the steps set aside (and of the tripped one) wait for the next logged step's goodput."""
    config, devices = ctx.config, ctx.plan.devices
    restored = RunCounters.resumed(require_complete(Store(checkpoint, config.storage_options)))
    every = devices.train.devices + devices.rollout.devices if config.disaggregated else max(devices.train.devices, devices.rollout.devices)
    spent = set_aside_device_s(Store(archive, config.storage_options)) + tripped_s * every
    return counters.model_copy(update={"samples": restored.samples, "tokens": restored.tokens,
                                       "rolled_back_device_s": counters.rolled_back_device_s + spent})


def _stop(config: TrellisConfig, run: Store, trip: Trip, rollbacks: int, target: tuple[int, str] | None) -> None:
    rules = config.guard
    if rules.on_trip == "stop":
        why = "guard.on_trip is stop"
    elif rollbacks >= rules.max_rollbacks:
        why = f"the run already rolled back {rollbacks} times (guard.max_rollbacks)"
    else:
        why = (f"no complete checkpoint is confirmed good before step {trip.step} (a checkpoint needs "
               f"{rules.confirm_steps} passed step(s) after it; checkpoint_interval={config.checkpoint_interval})")
    record_trip(run, {**trip_record(trip), "action": "stop", "why": why})
    message = (f"The stability guard stopped the run at step {trip.step}: {trip.summary()}. It did not roll back: {why}. "
               "Resume from the last complete checkpoint once the cause is fixed (a lower optim.lr, another guard bound).")
    raise StabilityGuardTripped(message, trip_page(trip, f"**Stopped**: {why}."))


def trip_record(trip: Trip) -> dict[str, Any]:
    return {"step": trip.step, "rules": [breach.rule for breach in trip.breaches], "time": time.time(),
            "breaches": [vars(breach) for breach in trip.breaches]}


def trip_page(trip: Trip, outcome: str) -> str:
    """The trip as markdown: the rules that tripped, their values and bounds, and what was done."""
    rows = [f"| {b.rule} | `{b.metric}` | {b.value:.4g} | {b.bound:.4g} | {'' if b.median is None else f'{b.median:.4g}'} |"
            for b in trip.breaches]
    return "\n".join([f"# Stability guard: step {trip.step} tripped", "", "| rule | metric | value | bound | running median |",
                      "| --- | --- | --- | --- | --- |", *rows, "", outcome])


def rolled_back_page(rolled: RolledBack, rules: GuardConfig) -> str:
    prompts = "are never trained on again (guard.skip_batches)" if rules.skip_batches else "are drawn again"
    return trip_page(rolled.trip, (
        f"**Rolled back** to the checkpoint of step {rolled.to_step} (`{rolled.checkpoint}`), rollback {rolled.rollback} of at "
        f"most {rules.max_rollbacks}. Steps {_span(list(rolled.discarded))} are set aside in `{rolled.archive}`; their prompts "
        f"{prompts}. Learning rate from now on: {rolled.lr_scale:g} x the configured one."
    ))


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])
