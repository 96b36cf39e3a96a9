"""Weight sync between two GPUs, 0.5B model: trellis's NCCL broadcast (``engine.weights.broadcast``,
what ``push_weights`` runs for a trainer and a rollout worker on different cards) against the host
round trip that the object-store path makes at the least (GPU -> host -> the other GPU, no
serialization counted), in the same run.

Both move the trainer's float32 weights into a bf16 model on the other GPU: bucketed into flat bf16
buffers and broadcast, or copied tensor by tensor through host memory.

    python bench/gpu/weight_broadcast.py OUT_DIR [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from engine_steps import random_qwen2_05b  # noqa: E402

from trellis.engine.tiny.model import build_tokenizer  # noqa: E402
from trellis.engine.weights.broadcast import RECEIVER, SENDER, WeightGroup, free_address  # noqa: E402
from trellis.engine.weights.buckets import flatten, layouts  # noqa: E402


def load_into(model: torch.nn.Module, weights) -> None:
    targets = model.state_dict()
    with torch.no_grad():
        for name, tensor in weights.items():
            targets[name].copy_(tensor)


def receiver(model_dir: str, address, bucket_layouts, rounds: int, done) -> None:
    torch.cuda.set_device(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    group = WeightGroup(address, RECEIVER, timeout_s=120)
    for _ in range(rounds):
        load_into(model, group.receive(bucket_layouts))
        torch.cuda.synchronize()
        done.put(time.perf_counter())
    group.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = random_qwen2_05b(build_tokenizer(), Path("/tmp/trellis-gpu/qwen2-05b-random"))
    torch.cuda.set_device(0)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    state = trainer.state_dict()
    parameters = sum(t.numel() for t in state.values())

    context = multiprocessing.get_context("spawn")
    done = context.Queue()
    address = free_address("127.0.0.1", "bench-weights", nccl=True)
    bucket_layouts = layouts(state, float_dtype=torch.bfloat16)
    process = context.Process(target=receiver, args=(str(model_dir), address, bucket_layouts, args.rounds + 1, done))
    process.start()
    group = WeightGroup(address, SENDER, timeout_s=120)
    broadcast_s = []
    for round_ in range(args.rounds + 1):  # the first round builds the NCCL communicator
        torch.cuda.synchronize()
        started = time.perf_counter()
        group.send(flatten(state, float_dtype=torch.bfloat16, device=torch.device("cuda", 0)))
        finished = done.get(timeout=300)
        if round_:
            broadcast_s.append(finished - started)
    process.join(timeout=120)
    group.close()

    rollout = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda:1")
    host_s = []
    for _ in range(args.rounds):
        torch.cuda.synchronize(0)
        started = time.perf_counter()
        load_into(rollout, {name: tensor.to(torch.bfloat16).cpu().to("cuda:1") for name, tensor in state.items()})
        torch.cuda.synchronize(1)
        host_s.append(time.perf_counter() - started)

    broadcast, host = statistics.median(broadcast_s), statistics.median(host_s)
    result = {
        "devices": [torch.cuda.get_device_name(i) for i in range(2)],
        "parameters": parameters,
        "bf16_gb": parameters * 2 / 1e9,
        "nccl_broadcast_s": broadcast_s,
        "host_round_trip_s": host_s,
        "nccl_broadcast_median_s": broadcast,
        "host_round_trip_median_s": host,
        "broadcast_vs_host": broadcast / host,
        "broadcast_gb_per_s": parameters * 2 / 1e9 / broadcast,
    }
    (args.out / "h200_weight_broadcast.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
