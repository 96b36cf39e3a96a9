"""TRL's GRPOTrainer on the bundled tiny model and task, with the settings of shared/TINY_TASK.md.

Usage: python bench/trl_peer.py MODEL_DIR TRAIN_PARQUET STEPS OUT_JSON
"""

from __future__ import annotations

import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import pyarrow.parquet as pq  # noqa: E402

from _measure import StepClock  # noqa: E402

REWARDS: list[float] = []


def reverse_reward(prompts, completions, label, **_):
    scores = [1.0 if c[0]["content"].strip() == answer else 0.0 for c, answer in zip(completions, label)]
    REWARDS.append(sum(scores) / len(scores))
    return scores


class Clock(TrainerCallback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_step_begin(self, args, state, control, **kwargs):
        self.clock.start()

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.stop()


def main(model_dir: str, train_path: str, steps: int, out: str) -> None:
    rows = pq.read_table(train_path).to_pylist()
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            loss_type="dapo",
            beta=0.0,
            scale_rewards="group",
            num_generations=8,
            per_device_train_batch_size=128,
            max_completion_length=8,
            learning_rate=3e-4,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_grad_norm=1.0,
            temperature=1.0,
            gradient_checkpointing=False,
            bf16=False,
            use_cpu=True,
            use_vllm=False,
            max_steps=steps,
            logging_steps=1000,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model, reward_funcs=[reverse_reward], args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[Clock(clock)]
        )
        trainer.train()
    clock.dump(out, rewards=REWARDS)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
