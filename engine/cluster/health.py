"""The rollout health check on a cluster: every engine's heartbeat, and a fresh engine for each one found
dead or hung, before the weight sync that then gives it the trainer's weights.

The heartbeat runs in the rollout actor's control lane, so it answers while the engine generates: its
process id, whether it is generating, and for how long no decode step has been made. A dead engine
(its process gone) fails the call or has no actor left; a hung one does not answer within
``probe_timeout_s`` (a frozen process), or answers that it has generated without a decode step for
``stall_after_s`` (a wedged engine). A replaced engine is killed first, so a generation it held fails
where it runs: the asynchronous producer puts those groups back in its buffer, and the pause before the
sync finds it idle.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import ray
from ray.exceptions import RayActorError, RayTaskError

from trellis.engine.config.health import HealthCheckConfig

if TYPE_CHECKING:
    from trellis.engine.cluster.workers import RunWorkers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Heartbeat:
    pid: int
    generating: bool
    stalled_s: float  # since the last decode step, while generating (0 otherwise)


@dataclass(frozen=True)
class Verdict:
    index: int  # of the rollout worker
    state: Literal["ok", "dead", "hung"]
    why: str = ""


def probe_rollouts(cluster: RunWorkers, settings: HealthCheckConfig) -> list[Verdict]:
    """Every rollout worker's heartbeat at once, waited for up to ``probe_timeout_s``; a verdict each, in
    worker order."""
    verdicts: dict[int, Verdict] = {}
    asked = {}
    for index, name in enumerate(cluster.names("rollout")):
        try:
            asked[index] = ray.get_actor(name, namespace=cluster.config.ray_namespace).heartbeat.remote()
        except ValueError:  # no live actor of that name
            verdicts[index] = Verdict(index, "dead", "its actor is gone")
    answered = set()
    if asked:
        answered, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=settings.probe_timeout_s)
    for index, ref in asked.items():
        verdicts[index] = _verdict(index, ref, ref in answered, settings)
    return [verdicts[index] for index in sorted(verdicts)]


def _verdict(index: int, ref: ray.ObjectRef, answered: bool, settings: HealthCheckConfig) -> Verdict:
    if not answered:
        return Verdict(index, "hung", f"no answer to a heartbeat in {settings.probe_timeout_s:g}s")
    try:
        beat: Heartbeat = ray.get(ref)
    except (RayActorError, RayTaskError) as error:
        return Verdict(index, "dead", f"its process ended ({type(error).__name__})")
    if beat.stalled_s > settings.stall_after_s:
        return Verdict(index, "hung", f"generating with no decode step for {beat.stalled_s:.0f}s (pid {beat.pid})")
    return Verdict(index, "ok")


def check_and_replace(cluster: RunWorkers) -> dict[str, float]:
    """Probe every rollout engine, replace the dead and the hung; the ``health/*`` metrics of the check."""
    settings = cluster.config.rollout.health_check
    verdicts = probe_rollouts(cluster, settings)
    sick = [verdict for verdict in verdicts if verdict.state != "ok"]
    for verdict in sick:
        logger.warning(
            "The health check found %s %s: %s. It is replaced by a fresh one, which the weight sync "
            "that follows gives the trainer's weights.", cluster.label(cluster.names("rollout")[verdict.index]),
            verdict.state, verdict.why,
        )
    if sick:
        cluster.restart_rollout([verdict.index for verdict in sick], load_weights=False)
    return {
        "health/engines": float(len(verdicts)),
        "health/replaced_engines": float(len(sick)),
        "health/hung_engines": float(sum(verdict.state == "hung" for verdict in sick)),
    }  # what the check cost is the phase's time/check_rollout
