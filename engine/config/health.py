"""``rollout.health_check``: the probes that find a dead or hung rollout engine between steps and
replace it before a step needs it (``engine.cluster.health``)."""

from __future__ import annotations

from pydantic import Field

from trellis.engine.config.base import Frozen


class HealthCheckConfig(Frozen):
    """Every ``interval``-th weight sync, before it, each rollout engine is asked for a heartbeat in its
    control lane, which answers even while the engine generates. An engine whose process is gone is
    dead; one that gives no answer within ``probe_timeout_s`` (a frozen process), or that has generated
    without a single decode step for ``stall_after_s``, is hung. Either is replaced by a fresh engine,
    which the sync that follows gives the trainer's weights; on the asynchronous trainer the groups it
    was generating go back to the replay buffer first. XTuner restarts its inactive workers at the same
    point."""

    interval: int | None = Field(
        None, ge=0,
        description="Probe before every N-th weight sync; 0: never. Unset: every sync where the rollout runs on an "
        "accelerator (vLLM's engines are what hang), never on CPU, where the check's task cost the bundled task's "
        "flow step ~8% (one paired bench/cpu_step.py measurement) and a lost engine is still replaced by the retry of the task that meets it.",
    )
    probe_timeout_s: float = Field(30.0, gt=0.0, description="An engine that does not answer a heartbeat within this is hung.")
    stall_after_s: float = Field(
        300.0, gt=0.0,
        description="An engine generating with no decode step for this long is hung (a decode step of a large batch "
        "takes well under a second; a long prefill a few).",
    )

    def every(self, rollout_on_gpu: bool) -> int:
        """``interval``, or its default where the rollout runs."""
        return (1 if rollout_on_gpu else 0) if self.interval is None else self.interval
