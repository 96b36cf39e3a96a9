"""TRL's side of trl_peer.py: GRPOTrainer as its docs set it up for one GPU with vLLM colocated, in a
process of its own, writing each step's wall time, trained response tokens and generation time.

    python bench/gpu/trl_runner.py RECORD.json --steps 10 --vllm-memory 0.3 --torch-threads 4 [--smoke]

``--smoke``: on CPU, the tiny model and TRL's transformers generation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peer_workload import TOKENS_COUNTED, WARMUP_STEPS, WORK, prepare_model_and_data, shared  # noqa: E402
from run_facts import files_digest, weights_digest  # noqa: E402


def run_trl(out: Path, steps: int, args: argparse.Namespace) -> None:
    """TRL's GRPOTrainer as its docs set it up for one GPU with vLLM colocated (``--smoke``: on CPU)."""
    import pyarrow.parquet as pq
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trellis.engine.tiny.model import build_tokenizer

    step = shared(args)
    model, data = prepare_model_and_data(args)
    rows = pq.read_table(data).to_pylist()
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]} for r in rows])
    record = {"step_s": [], "response_tokens": [], "completions": [], "generate_s": []}
    seen = {"tokens": 0, "completions": 0, "generate_s": 0.0}  # since the step began: TRL generates and scores inside its step

    def reverse_reward(completions, label, completion_ids, **_):
        seen["tokens"] += sum(len(ids) for ids in completion_ids)
        seen["completions"] += len(completion_ids)
        return [1.0 if c[0]["content"].strip() == answer else 0.0 for c, answer in zip(completions, label)]

    def synchronize() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            synchronize()
            self.started, seen["tokens"], seen["completions"], seen["generate_s"] = time.perf_counter(), 0, 0, 0.0

        def on_step_end(self, args, state, control, **kwargs):
            synchronize()
            record["step_s"].append(time.perf_counter() - self.started)
            record["response_tokens"].append(seen["tokens"])
            record["completions"].append(seen["completions"])
            record["generate_s"].append(seen["generate_s"])

    torch.set_num_threads(args.torch_threads)  # trellis's workers take the same (cluster.torch_threads)
    per_device = step["prompts"] * step["group"] // step["accumulation"]
    config = GRPOConfig(
        output_dir=str(WORK / "trl_out"), use_vllm=not args.smoke, vllm_mode="colocate", vllm_gpu_memory_utilization=args.vllm_memory,
        vllm_enable_sleep_mode=False, per_device_train_batch_size=per_device, gradient_accumulation_steps=step["accumulation"],
        num_generations=step["group"], max_completion_length=step["new_tokens"], bf16=not args.smoke, use_cpu=args.smoke,
        beta=0.0, learning_rate=step["lr"], temperature=step["temperature"], max_steps=steps, logging_steps=1,
        gradient_checkpointing=False,  # TRL's GRPO default is on; trellis's is off
        save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
    )
    trainer = GRPOTrainer(model=str(model), reward_funcs=[reverse_reward], args=config, train_dataset=dataset,
                          processing_class=build_tokenizer(), callbacks=[Clock()])
    # vLLM colocated: TRL 1.16's generation object (its engine call and the processing around it) is the step's
    # rollout, as trellis's time/rollout is (the weight sync apart on both sides)
    generation = getattr(trainer, "vllm_generation", None)
    if generation is not None:
        generate = generation.generate

        def timed_generate(*call_args, **call_kwargs):
            started = time.perf_counter()
            try:
                return generate(*call_args, **call_kwargs)
            finally:
                seen["generate_s"] += time.perf_counter() - started

        generation.generate = timed_generate
    trainer.train()
    generation_batch = config.per_device_train_batch_size * config.steps_per_generation
    record["settings"] = {
        "model (weights digest)": f"{model.name} ({weights_digest(model)})",
        "prompts file digest": files_digest([data]),
        "prompts x samples per step": f"{generation_batch // config.num_generations} x {config.num_generations}",
        "max new tokens": config.max_completion_length,
        "rollout engine": "vllm" if config.use_vllm else "transformers",
        "vLLM gpu_memory_utilization": config.vllm_gpu_memory_utilization if config.use_vllm else "no vLLM",
        "temperature": config.temperature,
        "learning rate": config.learning_rate,
        "KL coefficient": config.beta,
        "optimizer steps per batch": config.num_iterations * config.steps_per_generation // config.gradient_accumulation_steps,
        "trainer resident (no offload)": not config.vllm_enable_sleep_mode,
        "vLLM asleep during the fit": config.vllm_enable_sleep_mode,
        "torch threads (CPU ops)": torch.get_num_threads(),
        "activation checkpointing": config.gradient_checkpointing,
        "weights / compute dtype": f"{str(next(trainer.model.parameters()).dtype).removeprefix('torch.')} / "
                                   f"{'bfloat16' if config.bf16 else 'float32'}",
        "compiled": config.torch_compile,
        "tokens counted": TOKENS_COUNTED,
        "tokens counted from": "reward function: len(completion_ids) (cut after EOS)",
        "warm-up steps": WARMUP_STEPS,
    }
    vllm = __import__("vllm").__version__ if config.use_vllm else None
    record["versions"] = {"trl": trl.__version__, "vllm": vllm, "transformers": transformers.__version__,
                          "torch": torch.__version__, "param_dtype": str(next(trainer.model.parameters()).dtype)}
    out.write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("record", type=Path, help="the JSON file it writes")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--vllm-memory", type=float, required=True)
    parser.add_argument("--torch-threads", type=int, required=True)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    run_trl(args.record, args.steps, args)
    os._exit(0)  # vLLM's engine threads would hold the process open


if __name__ == "__main__":
    main()
