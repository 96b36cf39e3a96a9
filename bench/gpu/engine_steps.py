"""A few in-process GRPO steps of the engine on one GPU, bf16, random-init Qwen2-0.5B shape.

Weights are random, so rewards are ~0: this measures rollout and training token throughput of the
same engine code that runs on CPU in CI (transformers rollout loop, fp32 master weights + bf16 autocast).

    python bench/gpu/engine_steps.py OUT_DIR [--steps 3] [--prompts 32] [--group 8] [--new-tokens 256] [--backend vllm]
        [--resident-trainer] [--[no-]compile] [--vllm-memory 0.4] [--lr LR] [--model DIR] [--torch-threads N] [--warmup 1]

On a machine without a GPU (``--backend transformers --model DIR`` with a small model) it runs on CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
import warnings
from pathlib import Path

import rollout_host
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from trellis.engine.config.loading import load_config
from trellis.engine.run.local import LocalRun
from trellis.engine.tiny.model import build_tokenizer
from trellis.engine.tiny.reverse_task import write_dataset

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


QWEN2_SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2),
    # Qwen2.5-7B: untied embeddings over a 152,064-token vocabulary, 7.6B parameters
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               vocab_size=152064, tie_word_embeddings=False),
}


def random_qwen2_05b(tokenizer, out: Path, max_positions: int = 4096, shape: str = "0.5b") -> Path:
    """A randomly initialised Qwen2 of the 0.5B (or another of ``QWEN2_SHAPES``) shape, saved in bf16."""
    config = Qwen2Config(**{
        "vocab_size": 151936, "tie_word_embeddings": True, **QWEN2_SHAPES[shape], "max_position_embeddings": max_positions,
        "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
    })
    torch.manual_seed(0)
    larger = shape != "0.5b" and torch.cuda.is_available()  # a 3B init takes minutes on the host; 0.5B stays as measured before
    with torch.device("cuda" if larger else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def step_config(work: Path, args: argparse.Namespace, **changes):
    """The measured step: the random model (or ``--model``), ``args.prompts`` x ``args.group`` samples, 8k packs."""
    model_dir = args.model or work / ("qwen2-05b-random" if args.shape == "0.5b" else f"qwen2-{args.shape}-random")
    if not (model_dir / "config.json").exists():
        random_qwen2_05b(build_tokenizer(), model_dir, shape=args.shape)
    data = work / "train.parquet"
    if not data.exists():
        write_dataset(data, 2048, seed=0)
    rollout = {"max_new_tokens": args.new_tokens, "backend": args.backend, "gpu_memory_utilization": args.vllm_memory,
               "return_routed_experts": args.return_routed_experts, "quantization": args.quantization,
               "sleep_level": sleep_level(getattr(args, "sleep_level", "auto"))}
    settings = dict(
        load_from=str(model_dir),
        train_dataset={"path": str(data)},
        reward={"function": "trellis.engine.tiny.reverse_task:score"},
        total_train_steps=args.steps,
        train_batch_size=args.prompts,
        prompt_repeat_k=args.group,
        train_worker={"pack_max_length": 8192, "offload_when_idle": False if args.resident_trainer else args.offload, "compile": args.compile,
                      "routing_replay": args.routing_replay},
        work_dir=str(work / "runs"),
        exp_tracker="jsonl",
    )
    if args.lr is not None:
        settings["optim"] = {"lr": args.lr}
    if args.lora:
        settings["lora"] = {"rank": args.lora, "alpha": 2 * args.lora, "sync": args.lora_sync}
    if args.torch_threads is not None:
        settings["cluster"] = {"torch_threads": args.torch_threads}
    if getattr(args, "attest", "default") != "default":
        settings["attest"] = {"enabled": args.attest == "on"}
    return load_config(None, **{**settings, **changes, "rollout": {**rollout, **changes.get("rollout", {})}})


def sleep_level(value: str) -> str | int:
    return value if value == "auto" else int(value)


def add_step_arguments(parser: argparse.ArgumentParser, *, steps: int, backend: str) -> None:
    """The options that define the measured step; flow_steps.py takes them too and passes them on."""
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--backend", choices=("transformers", "vllm"), default=backend)
    parser.add_argument("--resident-trainer", action="store_true", help="train_worker.offload_when_idle=false")
    parser.add_argument("--sleep-level", choices=("auto", "0", "1", "2"), default="auto",
                        help="rollout.sleep_level (vLLM; 0: never sleeps; auto, trellis's: asleep only where the fit needs it)")
    parser.add_argument("--offload", choices=("auto", "true", "false"), default="auto",
                        help="train_worker.offload_when_idle (default auto, trellis's; --resident-trainer: false)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default="auto",
                        help="train_worker.compile true (--compile) or false (--no-compile); neither: auto, the default")
    parser.add_argument("--vllm-memory", type=float, default=0.4, help="rollout.gpu_memory_utilization")
    parser.add_argument("--lr", type=float, help="optim.lr (default: the config's)")
    parser.add_argument("--model", type=Path, help="a model folder instead of the random 0.5B shape")
    parser.add_argument("--shape", choices=sorted(QWEN2_SHAPES), default="0.5b", help="the random model's Qwen2 shape")
    parser.add_argument("--lora", type=int, default=0, help="LoRA of this rank on every linear layer (0: full fine-tuning)")
    parser.add_argument("--quantization", choices=("none", "fp8"), default="none", help="rollout.quantization")
    parser.add_argument("--lora-sync", choices=("auto", "adapter", "full"), default="auto", help="lora.sync")
    parser.add_argument("--torch-threads", type=int, help="cluster.torch_threads (default: every core in process)")
    parser.add_argument("--routing-replay", choices=("none", "r2", "r3"), default="none", help="MoE: train_worker.routing_replay")
    parser.add_argument("--return-routed-experts", action="store_true", help="MoE: rollout.return_routed_experts (router agreement)")
    parser.add_argument("--attest", choices=("default", "on", "off"), default="default", help="attest.enabled (default: the config's)")
    parser.add_argument("--probe-rollout", action="store_true",
                        help="vLLM: record where each rollout's host time goes (rollout_host.py) and the GPU's busy time")


def vllm_child_env() -> dict[str, str]:
    """This process's environment with vLLM's site (``$TRELLIS_VLLM_SITE``, which the GPU pack's unpack.sh
    exports) first on PYTHONPATH, for a child process that runs vLLM; the parent keeps its own path, since
    vLLM's fastapi pin conflicts with Prefect's."""
    env = dict(os.environ)
    if os.environ.get("TRELLIS_VLLM_SITE"):
        env["PYTHONPATH"] = f"{os.environ['TRELLIS_VLLM_SITE']}:{env.get('PYTHONPATH', '')}"
    return env


def step_argv(args: argparse.Namespace) -> list[str]:
    """``add_step_arguments``' values back as command-line words, to run this script with them."""
    argv = [str(args.out), "--steps", str(args.steps), "--prompts", str(args.prompts), "--group", str(args.group),
            "--new-tokens", str(args.new_tokens), "--backend", args.backend, "--vllm-memory", str(args.vllm_memory)]
    argv += ["--lr", str(args.lr)] if args.lr is not None else []
    argv += ["--model", str(args.model)] if args.model is not None else []
    argv += ["--shape", args.shape, "--lora", str(args.lora), "--lora-sync", args.lora_sync, "--quantization", args.quantization]
    argv += ["--torch-threads", str(args.torch_threads)] if args.torch_threads is not None else []
    argv += ["--routing-replay", args.routing_replay] + (["--return-routed-experts"] if args.return_routed_experts else [])
    argv += ["--attest", getattr(args, "attest", "default")] + (["--probe-rollout"] if getattr(args, "probe_rollout", False) else [])
    compile_flag = {True: ["--compile"], False: ["--no-compile"]}.get(args.compile, [])
    argv += ["--offload", getattr(args, "offload", "auto"), "--sleep-level", str(getattr(args, "sleep_level", "auto"))]
    return argv + (["--resident-trainer"] if args.resident_trainer else []) + compile_flag


def run_settings(config) -> dict:
    """The settings of the measured step that a comparison with another trainer must match."""
    return config.model_dump(mode="json", include={
        "load_from": True, "train_dataset": {"path"}, "train_batch_size": True, "prompt_repeat_k": True,
        "rollout": {"backend", "max_new_tokens", "gpu_memory_utilization", "temperature", "quantization", "sleep_level"},
        "optim": {"lr"}, "loss": {"kl_coef"}, "cluster": {"torch_threads"}, "lora": True, "attest": {"enabled"},
        "train_worker": {"compile", "optimizer_steps", "offload_when_idle", "gradient_checkpointing", "dtype", "routing_replay"},
    })


def result_path(args: argparse.Namespace) -> Path:
    return args.out / f"engine_steps_{args.backend}{'_resident' if args.resident_trainer else ''}.json"


def main() -> None:
    parser = argparse.ArgumentParser()
    add_step_arguments(parser, steps=3, backend="transformers")
    parser.add_argument("--track", action="store_true", help="write trajectories and metrics, as the flow does")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    args = parser.parse_args()
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 0 and less than --steps")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/trellis-gpu")
    config = step_config(work, args)
    reports, starts = [], []
    with LocalRun(config, track=args.track) as run:
        probed = rollout_host.install(run.backend) if args.probe_rollout else None
        for _ in range(args.steps):
            starts.append(time.perf_counter())
            reports.append(run.train_step().metrics)
            print({k: round(v, 3) for k, v in reports[-1].items() if k.startswith(("time/", "throughput/"))}, flush=True)
        host = rollout_host.records(run.backend) if args.probe_rollout else None
        stays = run.worker.idle.stays_on_gpu  # what offload_when_idle decided last
    steady = reports[args.warmup:]
    on_gpu = torch.cuda.is_available()
    summary = {
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "settings": run_settings(config),
        "samples_per_step": args.prompts * args.group,
        "warmup_steps": args.warmup,
        "measured_steps": len(steady),
        "rollout_tokens_per_s": statistics.median(r["throughput/rollout_tgs"] for r in steady),
        "training_tokens_per_s": statistics.median(r["throughput/training_tgs"] for r in steady),
        "step_s": statistics.median(r["time/step"] for r in steady),
        # what the user waits for, as the flow bench times its steps: one step's start to the next one's
        "wall_steps_s": [after - before for before, after in zip(starts, starts[1:])][args.warmup:],
        "response_len_mean": statistics.median(r["response/response_len/mean"] for r in steady),
        "peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
        "steps": reports,
    }
    if args.probe_rollout:  # every step's rollout, the warm-up's included
        summary["rollout_host"] = {"process": probed, "calls": host}
    summary["backend"] = args.backend
    summary["resident_trainer"] = args.resident_trainer
    summary["trainer_stays_on_gpu"] = stays
    summary["engine_awake_in_fits"] = [r.get("memory/engine_awake") for r in steady]  # sleep_level auto's choice
    summary["phase_median_s"] = {k: statistics.median(r[k] for r in steady if k in r) for k in steady[-1] if k.startswith("time/")}
    summary["throughput_median"] = {k: statistics.median(r[k] for r in steady) for k in steady[-1] if k.startswith("throughput/")}
    result_path(args).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "steps"}, indent=1))


if __name__ == "__main__":
    main()
    os._exit(0)  # vLLM's engine threads would hold the process open
