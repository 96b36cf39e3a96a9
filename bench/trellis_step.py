"""trellis's in-process engine step on the bundled tiny model and task, timed per step.

Usage: python bench/trellis_step.py MODEL_DIR TRAIN_PARQUET STEPS OUT_JSON
Same model, task and hyperparameters as bench/trl_peer.py (shared/TINY_TASK.md).
"""

from __future__ import annotations

import logging
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

from _measure import StepClock  # noqa: E402

from trellis.engine.config.loading import load_config  # noqa: E402
from trellis.engine.run.local import LocalRun  # noqa: E402


def main(model_dir: str, train_path: str, steps: int, out: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(
            None,
            load_from=model_dir,
            train_dataset={"path": train_path},
            reward={"function": "trellis.engine.tiny.reverse_task:score"},
            total_train_steps=steps,
            train_batch_size=16,
            prompt_repeat_k=8,
            rollout={"temperature": 1.0, "max_new_tokens": 8},
            optim={"lr": 3e-4, "max_grad_norm": 1.0},
            work_dir=tmp,
        )
        clock = StepClock()
        rewards: list[float] = []
        phases: list[dict[str, float]] = []
        with LocalRun(config, track=False) as run:
            for _ in range(steps):
                clock.start()
                report = run.train_step()
                clock.stop()
                rewards.append(report.metrics["response/rewards/mean"])
                phases.append({k: v for k, v in report.metrics.items() if k.startswith("time/")})
            clock.dump(out, rewards=rewards, phases=phases)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
