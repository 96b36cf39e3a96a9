"""Checkpoint write and read speed: trellis's trainer checkpoint (safetensors weights + optimizer +
scheduler/RNG, written through fsspec) against a plain ``torch.save`` / ``torch.load`` of the same
model and optimizer state to the same disk, alternately, medians printed as ratios.

    python bench/checkpoint_io.py [--hidden 768 --layers 12] [--rounds 3] [--out bench/results/checkpoint_io.json]

The model is a random-initialised Qwen2 (~110M parameters by default) with AdamW state populated,
so a checkpoint is about 1.3 GB; on CPU that is what a 0.5B model's would be on a shared disk, scaled.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from trellis.engine.config import TrellisConfig
from trellis.engine.storage.store import Store
from trellis.engine.tiny.model import build_tiny_checkpoint
from trellis.engine.train.worker import TrainingWorker


def build_worker(root: Path, hidden: int, layers: int) -> TrainingWorker:
    tiny = build_tiny_checkpoint(root / "tiny", warmup=False)  # only its tokenizer is reused
    config = Qwen2Config(
        vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=2, tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(root / "model")
    AutoTokenizer.from_pretrained(tiny).save_pretrained(root / "model")
    trellis = TrellisConfig(
        load_from=str(root / "model"), train_dataset={"path": "unused"}, total_train_steps=1, reward={"function": "trellis.engine.tiny.reverse_task:score"},
        train_worker={"device": "cpu"},
    )
    worker = TrainingWorker(trellis, total_train_steps=1, pad_token_id=0)
    for parameter in worker.model.parameters():  # populate the AdamW moments
        parameter.grad = torch.zeros_like(parameter)
    worker.optimizer.step()
    worker.optimizer.zero_grad(set_to_none=True)
    return worker


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench/results/checkpoint_io.json")
    args = parser.parse_args()
    torch.set_num_threads(2)

    root = Path(tempfile.mkdtemp(prefix="trellis-ckpt-bench-"))
    try:
        worker = build_worker(root, args.hidden, args.layers)
        params = sum(p.numel() for p in worker.model.parameters())
        times: dict[str, list[float]] = {"trellis_save": [], "torch_save": [], "trellis_load": [], "torch_load": []}
        sizes = {}
        for round_index in range(args.rounds):
            ours, peer = root / f"trellis-{round_index}", root / f"torch-{round_index}.pt"

            started = time.perf_counter()
            worker.save_checkpoint(Store(str(ours)), save_optimizer=True)
            times["trellis_save"].append(time.perf_counter() - started)

            started = time.perf_counter()
            torch.save({"model": worker.model.state_dict(), "optimizer": worker.optimizer.state_dict()}, peer)
            times["torch_save"].append(time.perf_counter() - started)

            started = time.perf_counter()
            worker.load_checkpoint(Store(str(ours)), load_optimizer=True)
            times["trellis_load"].append(time.perf_counter() - started)

            started = time.perf_counter()
            state = torch.load(peer, map_location="cpu", weights_only=True)
            worker.model.load_state_dict(state["model"])
            worker.optimizer.load_state_dict(state["optimizer"])
            times["torch_load"].append(time.perf_counter() - started)
            del state

            sizes = {"trellis_bytes": folder_bytes(ours), "torch_bytes": peer.stat().st_size}
            shutil.rmtree(ours)
            peer.unlink()
        medians = {name: statistics.median(values) for name, values in times.items()}
        result = {
            "parameters": params,
            **sizes,
            "median_s": medians,
            "trellis_save_gb_per_s": sizes["trellis_bytes"] / medians["trellis_save"] / 1e9,
            "ratio_save_vs_torch": medians["trellis_save"] / medians["torch_save"],
            "ratio_load_vs_torch": medians["trellis_load"] / medians["torch_load"],
            "rounds": times,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))


if __name__ == "__main__":
    main()
