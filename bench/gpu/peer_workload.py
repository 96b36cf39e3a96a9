"""What trl_peer.py and verl_peer.py share: the workload every contestant trains (the model folder, the
prompts, the batch of a GPU step and of a CPU smoke run), where it lives, and the peak GPU memory a
contestant's process reached."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import threading
from pathlib import Path

WORK = Path("/tmp/trellis-gpu")
WARMUP_STEPS = 2
# A GPU step: 32 prompts x 8 samples of up to 256 tokens; TRL reaches 256 completions with 8 accumulation steps.
GPU = dict(prompts=32, group=8, new_tokens=256, accumulation=8, lr=1e-6, temperature=1.0)
SMOKE = dict(prompts=4, group=4, new_tokens=8, accumulation=1, lr=1e-6, temperature=1.0)
TOKENS_COUNTED = "response tokens up to and including EOS, of every trained sample"


class PeakGpuMemory:
    """The most device memory in use (MiB) while the block runs, as nvidia-smi reports it (None without one)."""

    def __enter__(self) -> PeakGpuMemory:
        self.peak_mib: int | None = 0 if shutil.which("nvidia-smi") else None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        if self.peak_mib is not None:
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.2):
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout.split()
            if out:
                self.peak_mib = max(self.peak_mib, int(out[0]))

    def __exit__(self, *_) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()


def run_child(command: list[str], log: Path, env: dict[str, str]) -> float | None:
    with PeakGpuMemory() as memory, open(log, "w") as handle:
        subprocess.run(command, check=True, stdout=handle, stderr=subprocess.STDOUT, env=env)
    return memory.peak_mib / 1024 if memory.peak_mib is not None else None


def shared(args: argparse.Namespace) -> dict:
    return SMOKE if args.smoke else GPU


def model_dir(args: argparse.Namespace) -> Path:
    return WORK / ("tiny-model" if args.smoke else "qwen2-05b-random")


def prepare_model_and_data(args: argparse.Namespace) -> tuple[Path, Path]:
    """The model and prompts both sides read (built once, before the first contestant)."""
    from trellis.engine.tiny.model import build_tiny_checkpoint, build_tokenizer
    from trellis.engine.tiny.reverse_task import write_dataset

    model, data = model_dir(args), WORK / "train.parquet"
    if not (model / "config.json").exists():
        if args.smoke:
            build_tiny_checkpoint(model)
        else:
            from engine_steps import random_qwen2_05b

            random_qwen2_05b(build_tokenizer(), model)
    if not data.exists():
        write_dataset(data, 2048, seed=0)
    return model, data
