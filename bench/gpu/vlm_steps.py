"""Colocated GRPO steps of a random-init Qwen2.5-VL-3B-shaped policy on one GPU, with images or without.

The shapes task's pictures scaled up to ``--picture`` pixels a side (448: 256 image tokens a prompt),
rolled out by vLLM and trained in bf16 by the same engine code CI runs on CPU. ``--no-images`` runs the
same questions with the picture left out, for the cost of the images. Reports rollout and training
tokens/s, step time (and the wall time between steps), the trainer's peak memory and the rollout vs
trainer k3 mismatch: small only where pixels and multimodal positions agree on both sides.

    python bench/gpu/vlm_steps.py OUT_DIR [--no-images] [--steps 4] [--prompts 32] [--group 8] [--new-tokens 256]
        [--picture 448] [--shape 3b|tiny]

``--shape tiny``: the tiny Qwen2-VL of the CPU tests, on whatever device there is (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import time
import warnings
from pathlib import Path

import torch
from PIL import Image
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from trellis.engine.config.loading import load_config
from trellis.engine.run.local import LocalRun
from trellis.engine.tiny import shapes_task
from trellis.engine.tiny.files import write_rows
from trellis.engine.tiny.vlm import VISION_TOKEN_IDS, build_image_processor, build_vlm_tokenizer, save_tiny_vlm

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

# Qwen2.5-VL-3B: the 3B text decoder (mrope over a 128-wide head: 16 + 24 + 24 frequencies) and its
# 32-block vision tower with windowed attention.
TEXT_3B = dict(
    hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
    vocab_size=151936, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
)
VISION_3B = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048, patch_size=14, spatial_merge_size=2,
    temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
)


def random_vl_3b(out: Path) -> Path:
    tokenizer = build_vlm_tokenizer()
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in VISION_TOKEN_IDS.items()}
    text = {**TEXT_3B, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=VISION_3B, tie_word_embeddings=True, **ids)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    build_image_processor_3b().save_pretrained(out)
    return out


def build_image_processor_3b():
    processor = build_image_processor()
    processor.size = {"shortest_edge": 56 * 56, "longest_edge": 1024 * 28 * 28}
    return processor


def write_pictures(path: Path, count: int, side: int, images: bool) -> Path:
    rng = random.Random(0)
    rows = []
    for _ in range(count):
        picture, question, answer = shapes_task.make_example(rng)
        content = [{"type": "text", "text": question}]
        if images:
            content.insert(0, {"type": "image", "image": shapes_task.png_bytes(picture.resize((side, side), Image.NEAREST))})
        rows.append({"prompt": [{"role": "user", "content": content}], "label": answer})
    return write_rows(path, rows)


def profiled_step(run: LocalRun, path: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        metrics = run.train_step().metrics
    averages = prof.key_averages()
    path.write_text(
        averages.table(sort_by="cuda_time_total", row_limit=30) + "\n" + averages.table(sort_by="cpu_time_total", row_limit=30)
    )
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--no-images", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--picture", type=int, default=448)
    parser.add_argument("--shape", choices=("3b", "tiny"), default="3b")
    parser.add_argument("--vllm-memory", type=float, default=0.35)
    parser.add_argument("--profile", action="store_true", help="profile the last step: its top CUDA and CPU ops to OUT")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/trellis-vlm")
    model = work / f"vl-{args.shape}"
    if not (model / "config.json").exists():
        random_vl_3b(model) if args.shape == "3b" else save_tiny_vlm(model)
    data = write_pictures(work / f"pictures-{args.picture}-{not args.no_images}.parquet", 1024, args.picture, not args.no_images)
    on_gpu = torch.cuda.is_available()
    config = load_config(
        None,
        load_from=str(model),
        train_dataset={"path": str(data), "max_prompt_length": 2048},
        reward={"function": "trellis.engine.tiny.shapes_task:score"},
        total_train_steps=args.steps,
        train_batch_size=args.prompts,
        prompt_repeat_k=args.group,
        rollout={"backend": "vllm" if on_gpu else "transformers", "max_new_tokens": args.new_tokens,
                 "gpu_memory_utilization": args.vllm_memory},
        train_worker={"pack_max_length": 8192, "offload_when_idle": False},
        work_dir=str(work / "runs"),
        experiment_name=f"vl-{args.shape}-{'text' if args.no_images else 'images'}",
        exp_tracker="jsonl",
    )
    reports, starts = [], []
    with LocalRun(config) as run:
        for index in range(args.steps):
            starts.append(time.perf_counter())
            if args.profile and index == args.steps - 1:
                reports.append(profiled_step(run, args.out / f"profile_{'text' if args.no_images else 'images'}.txt"))
            else:
                reports.append(run.train_step().metrics)
            print({k: round(v, 4) for k, v in reports[-1].items() if k.startswith(("time/", "throughput/", "mismatch/k3"))}, flush=True)
    steady = reports[args.warmup:]
    summary = {
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "shape": args.shape,
        "images": not args.no_images,
        "picture_px": args.picture,
        "samples_per_step": args.prompts * args.group,
        "warmup_steps": args.warmup,
        "measured_steps": len(steady),
        "prompt_len_mean": statistics.median(r.get("response/prompt_len/mean", float("nan")) for r in steady),
        "response_len_mean": statistics.median(r["response/response_len/mean"] for r in steady),
        "rollout_tokens_per_s": [r["throughput/rollout_tgs"] for r in steady],
        "training_tokens_per_s": [r["throughput/training_tgs"] for r in steady],
        "step_s": [r["time/step"] for r in steady],
        "wall_steps_s": [after - before for before, after in zip(starts, starts[1:])][args.warmup:],
        "k3": [r["mismatch/k3_kl"] for r in steady],
        "peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
        "steps": reports,
    }
    name = f"vlm_steps_{args.shape}_{'images' if summary['images'] else 'text'}.json"
    (args.out / name).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "steps"}, indent=1))


if __name__ == "__main__":
    main()
    os._exit(0)  # vLLM's engine threads would hold the process open
