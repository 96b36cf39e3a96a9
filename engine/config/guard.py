"""The ``guard:`` section: the stability guard (``engine.run.guard``) and its rollback
(``engine.run.rollback``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trellis.engine.config.base import Frozen


class GuardConfig(Frozen):
    """After each step's update, rules over its metrics decide whether training went unstable. A tripped
    rule rolls the run back to its last good complete checkpoint (the steps after it are set aside, never
    trained on again), applies the remedy and goes on; or stops the run. A rule set to null is off."""

    enabled: bool = Field(False, description="Check every step after its update; a tripped rule rolls back or stops.")
    nonfinite: bool = Field(True, description="Trip when any metric of the step is NaN or infinite (loss, grad norm, logprobs...).")
    max_k3_mismatch: float | None = Field(
        1.0, gt=0.0, description="Trip when mismatch/k3_kl (trainer vs rollout logprobs of the same tokens) exceeds this. "
        "A healthy run stays near 0 (1e-3 on the tiny task in float32; ~1e-2 with a bf16 engine).",
    )
    entropy_collapse: float | None = Field(
        0.1, gt=0.0, lt=1.0, description="Trip when the rollout's entropy (entropy/rollout) falls below this fraction of "
        "its running median: the policy suddenly stopped exploring.",
    )
    grad_norm_spike: float | None = Field(
        10.0, gt=1.0, description="Trip when train/grad_norm exceeds this many times its running median.",
    )
    reward_collapse: float | None = Field(
        0.25, gt=0.0, lt=1.0, description="Trip when the mean reward (response/rewards/mean) falls below this fraction of its "
        "running median; a median at or below 0 is not judged by this rule (use reward_drop). Batches of harder prompts "
        "swing the tiny task's asynchronous run to 0.44 of its median; a collapsed policy scores ~0.",
    )
    reward_drop: float | None = Field(
        None, gt=0.0, description="Trip when the mean reward falls more than this below its running median, in the reward's "
        "own units (off by default: the scale is the task's).",
    )
    window: int = Field(8, ge=1, description="Steps the running medians are taken over (the steps that passed).")
    min_history: int = Field(3, ge=1, description="Steps that must have passed before the running-median rules judge.")
    on_trip: Literal["rollback", "stop"] = Field(
        "rollback", description="rollback: back to the last good checkpoint, remedy, go on. stop: end the run, its last "
        "good checkpoint kept for a resume.",
    )
    confirm_steps: int = Field(
        1, ge=0, description="A checkpoint is good once this many steps after it passed: the damage of an update shows in "
        "the next step's rollouts, so the checkpoint just before a tripped step is not trusted.",
    )
    max_rollbacks: int = Field(3, ge=1, description="Rollbacks in the whole run; one more trip stops it.")
    lr_factor: float = Field(
        0.5, gt=0.0, le=1.0, description="After each rollback the learning rate is multiplied by this, for the rest of the run "
        "(1.0: unchanged).",
    )
    skip_batches: bool = Field(
        False, description="Never train on the prompts of the steps rolled back (their ledger rows end as rolled_back); "
        "false: the same prompts are drawn again after the rollback. Colocated runs only.",
    )
