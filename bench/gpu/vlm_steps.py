"""Colocated GRPO steps of a random-init Qwen2.5-VL-3B-shaped policy on one GPU, with images or without.

The shapes task's pictures scaled up to ``--picture`` pixels a side (448: 256 image tokens a prompt),
rolled out by vLLM and trained in bf16 by the same engine code CI runs on CPU. ``--no-images`` runs the
same questions with the picture left out, for the cost of the images. Reports rollout and training
tokens/s, step time (and the wall time between steps), the trainer's peak memory and the rollout vs
trainer k3 mismatch: small only where pixels and multimodal positions agree on both sides.

    python bench/gpu/vlm_steps.py OUT_DIR [--no-images] [--steps 4] [--prompts 32] [--group 8] [--new-tokens 256]
        [--picture 448] [--shape 3b|tiny] [--flow images,text]

``--flow ORDER``: the same steps through the Prefect flow (``rl_train``) on a local Ray head started here,
a trainer actor and a vLLM rollout actor sharing the GPU, once per entry of ORDER (``images``, ``text``)
in that order within one process, the workers released between runs. A step's wall time is one
``rl_step`` flow run's start to the next one's.

``--shape tiny``: the tiny Qwen2-VL of the CPU tests, on whatever device there is (a smoke run).
``--parts`` (in process): each step's fit split into the trainer's host-side vision inputs (decoding,
the image processor, positions), the vision tower's forward (inside the micro-batches' or ahead of them) and the language model's forward, each
timed with the GPU synchronized around it; the rest of the fit is backward, loss and optimizer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for the flow bench's helpers
from trellis_flow_step import start_head, step_starts  # noqa: E402  (sets Prefect's lean server first)

import torch  # noqa: E402
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


class FitParts:
    """Seconds spent in parts of the fit, summed until ``take``; installed by patching the trainer's
    functions (this process's LocalRun holds the trainer)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def install(self) -> None:
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
        from transformers.models.qwen2_vl import modeling_qwen2_vl

        from trellis.engine.train import worker

        worker.with_vision = self._timed("host_vision_inputs", worker.with_vision, sync=False)
        worker.ImageTable.__init__ = self._timed("host_vision_inputs", worker.ImageTable.__init__, sync=False)
        for model, text in ((modeling_qwen2_5_vl.Qwen2_5_VLModel, modeling_qwen2_5_vl.Qwen2_5_VLTextModel),
                            (modeling_qwen2_vl.Qwen2VLModel, modeling_qwen2_vl.Qwen2VLTextModel)):
            model.get_image_features = self._timed("vision_tower_forward", model.get_image_features)
            text.forward = self._timed("language_model_forward", text.forward)

    def take(self) -> dict[str, float]:
        taken = {f"parts/{k}_s": v for k, v in self.seconds.items()} | {f"parts/{k}_calls": v for k, v in self.calls.items()}
        self.seconds, self.calls = {}, {}
        return taken

    def _timed(self, name: str, function, sync: bool = True):
        def timed(*args, **kwargs):
            if sync and torch.cuda.is_available():
                torch.cuda.synchronize()
            started = time.perf_counter()
            out = function(*args, **kwargs)
            if sync and torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
            self.calls[name] = self.calls.get(name, 0) + 1
            return out

        return timed


def run_config(args: argparse.Namespace, model: Path, images: bool, *, rollout: dict | None = None, **overrides):
    """The measured run; each gets a fresh work folder, so that none resumes an earlier one's checkpoint."""
    work = Path("/tmp/trellis-vlm")
    data = write_pictures(work / f"pictures-{args.picture}-{images}.parquet", 1024, args.picture, images)
    on_gpu = torch.cuda.is_available()
    return load_config(
        None,
        load_from=str(model),
        train_dataset={"path": str(data), "max_prompt_length": 2048},
        reward={"function": "trellis.engine.tiny.shapes_task:score"},
        total_train_steps=args.steps,
        train_batch_size=args.prompts,
        prompt_repeat_k=args.group,
        rollout={"backend": "vllm" if on_gpu else "transformers", "max_new_tokens": args.new_tokens,
                 "gpu_memory_utilization": args.vllm_memory, **(rollout or {})},
        train_worker={"pack_max_length": 8192, "offload_when_idle": False},
        work_dir=tempfile.mkdtemp(prefix="runs-", dir=work),
        experiment_name=f"vl-{args.shape}-{'images' if images else 'text'}",
        exp_tracker="jsonl",
        **overrides,
    )


def in_process(args: argparse.Namespace, model: Path) -> tuple[list[dict], list[float]]:
    """The steps' metrics and the wall seconds between consecutive step starts, in this process."""
    reports, starts = [], []
    parts = FitParts()
    if args.parts:
        parts.install()
    with LocalRun(run_config(args, model, not args.no_images)) as run:
        for index in range(args.steps):
            starts.append(time.perf_counter())
            if args.profile and index == args.steps - 1:
                reports.append(profiled_step(run, args.out / f"profile_{'text' if args.no_images else 'images'}.txt"))
            else:
                reports.append(run.train_step().metrics)
            reports[-1].update(parts.take())
            print({k: round(v, 4) for k, v in reports[-1].items() if k.startswith(("time/", "throughput/", "mismatch/k3", "parts/"))}, flush=True)
    return reports, [after - before for before, after in zip(starts, starts[1:])]


def through_flow(args: argparse.Namespace, model: Path, images: bool, address: str) -> tuple[list[dict], list[float]]:
    """One ``rl_train`` flow run of ``--steps`` steps on the cluster at ``address``: each step's metrics
    (as the run's metrics.jsonl has them) and the wall seconds between consecutive rl_step starts."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from trellis.flows.rl_train import rl_train

    vllm_site = os.environ.get("TRELLIS_VLLM_SITE")
    runtime_env = {"env_vars": {"PYTHONPATH": f"{vllm_site}:${{PYTHONPATH}}"}} if vllm_site else None
    config = run_config(
        args, model, images, rollout={"runtime_env": runtime_env},
        cluster={"address": address, "release_workers_at_end": True, "torch_threads": 4, "home": "/tmp/trellis-vlm/cluster"},
    )
    since_s = time.time()
    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        rl_train(config)
    starts = asyncio.run(step_starts(since_s))
    metrics = Path(config.work_dir) / config.experiment_name / "logs" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()][-args.steps:]
    for record in records:
        print({k: round(v, 4) for k, v in record.items() if k.startswith(("time/", "throughput/", "mismatch/k3", "memory/"))}, flush=True)
    steps = sorted(starts)
    return records, [starts[b] - starts[a] for a, b in zip(steps, steps[1:])]


def summarize(args: argparse.Namespace, images: bool, reports: list[dict], walls: list[float], flow: bool) -> dict:
    steady = reports[args.warmup:]
    on_gpu = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "shape": args.shape,
        "through": "prefect flow, ray actors" if flow else "in process (LocalRun)",
        "images": images,
        "picture_px": args.picture,
        "samples_per_step": args.prompts * args.group,
        "warmup_steps": args.warmup,
        "measured_steps": len(steady),
        "prompt_len_mean": statistics.median(r.get("response/prompt_len/mean", float("nan")) for r in steady),
        "response_len_mean": statistics.median(r["response/response_len/mean"] for r in steady),
        "rollout_tokens_per_s": [r["throughput/rollout_tgs"] for r in steady],
        "training_tokens_per_s": [r["throughput/training_tgs"] for r in steady],
        "step_s": [r["time/step"] for r in steady],
        "fit_s": [r["time/fit"] for r in steady],
        "wall_steps_s": walls[args.warmup:],
        "k3": [r["mismatch/k3_kl"] for r in steady],
        "fit_parts_s": {k: [r[k] for r in steady] for k in steady[0] if k.startswith("parts/")},
        # in process: the whole process's (vLLM's engine included); through the flow: the trainer's
        "peak_gpu_mem_gib": (max((r["memory/train_peak_gib"] for r in steady if "memory/train_peak_gib" in r), default=None)
                             if flow else torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None),
        "steps": reports,
    }


def write_summary(args: argparse.Namespace, summary: dict) -> None:
    via = "flow_" if summary["through"].startswith("prefect") else ""
    name = f"vlm_steps_{via}{args.shape}_{'images' if summary['images'] else 'text'}.json"
    (args.out / name).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "steps"}, indent=1), flush=True)


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
    parser.add_argument("--parts", action="store_true", help="time the fit's vision inputs, vision tower and language model")
    parser.add_argument("--flow", default=None, help="through the Prefect flow, e.g. images,text: one run each, in that order")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = Path("/tmp/trellis-vlm") / f"vl-{args.shape}"
    if not (model / "config.json").exists():
        random_vl_3b(model) if args.shape == "3b" else save_tiny_vlm(model)
    if args.flow is None:
        reports, walls = in_process(args, model)
        write_summary(args, summarize(args, not args.no_images, reports, walls, flow=False))
        return
    import ray

    head, address = start_head(f"--num-gpus={torch.cuda.device_count()}")
    try:  # results are written before Ray shuts down
        for kind in args.flow.split(","):
            reports, walls = through_flow(args, model, kind == "images", address)
            write_summary(args, summarize(args, kind == "images", reports, walls, flow=True))
    finally:
        ray.shutdown()
        head.terminate()
        head.wait(timeout=60)


if __name__ == "__main__":
    main()
    os._exit(0)  # vLLM's engine threads would hold the process open
