"""trellis's colocated GPU step against TRL's GRPOTrainer with vLLM colocated, on one GPU, in one call.

Both train the same random Qwen2-0.5B-shaped model on the bundled task with the same batch: 32 prompts
x 8 samples = 256 completions of up to 256 new tokens per optimizer step, fp32 master weights under
bf16 autocast, no KL term, vLLM for generation, the trainer resident (no sleep mode, no offload).

- ``trl``: GRPOTrainer, ``vllm_mode="colocate"``, per-device batch 32 x 8 accumulation steps,
  ``vllm_gpu_memory_utilization=0.3``, ``vllm_enable_sleep_mode=False``, run in a child process;
- ``trellis``: ``flow_steps.py --backend vllm --resident-trainer [--compile]``: the in-process engine step,
  then the Prefect flow on a fresh local Ray cluster (trainer and rollout actors sharing the GPU);
  ``--trellis-compile`` turns on ``train_worker.compile`` (TRL keeps its defaults).

Contestants run one after the other (``--order``), each in its own process, so each starts on a free
GPU. For each: the median step wall time after warm-up, ``e2e_effective_tgs`` = tokens trained (prompt
+ response) over the measured steps / their wall time, and the peak GPU memory the device reported
(``nvidia-smi``, sampled every 0.2 s, so vLLM's pool counts for both).

    python bench/gpu/trl_peer.py OUT_DIR [--steps 6] [--order trl,trellis] [--trellis-compile]

writes OUT_DIR/h200_trl_peer.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORK = Path("/tmp/trellis-gpu")
WARMUP_STEPS = 2


class PeakGpuMemory:
    """The most device memory in use (MiB) while the block runs, as nvidia-smi reports it."""

    def __enter__(self) -> PeakGpuMemory:
        self.peak_mib, self._done = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
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
        self._thread.join()


def run_child(command: list[str], log: Path, env: dict[str, str]) -> float:
    with PeakGpuMemory() as memory, open(log, "w") as handle:
        subprocess.run(command, check=True, stdout=handle, stderr=subprocess.STDOUT, env=env)
    return memory.peak_mib / 1024


def trl_contestant(args: argparse.Namespace, round_: int) -> dict:
    out = args.out / f"trl_{round_}.json"
    env = dict(os.environ)
    if os.environ.get("TRELLIS_VLLM_SITE"):  # vLLM runs in TRL's own process
        env["PYTHONPATH"] = f"{os.environ['TRELLIS_VLLM_SITE']}:{env.get('PYTHONPATH', '')}"
    command = [sys.executable, str(Path(__file__)), str(args.out), "--trl-child", str(out), "--steps", str(args.steps)]
    peak_gib = run_child(command, args.out / f"trl_{round_}.log", env)
    result = json.loads(out.read_text())
    measured = slice(WARMUP_STEPS, None)
    wall, tokens = result["step_s"][measured], result["tokens"][measured]
    return {"step_s": statistics.median(wall), "steps_s": result["step_s"], "e2e_effective_tgs": sum(tokens) / sum(wall),
            "completion_len_mean": statistics.mean(result["completion_len"][measured] or [float("nan")]), "peak_gpu_gib": peak_gib,
            "trl": result["versions"]}


def trellis_contestant(args: argparse.Namespace, round_: int) -> dict:
    out = args.out / f"trellis_{round_}"
    command = [sys.executable, str(HERE / "flow_steps.py"), str(out), "--backend", "vllm", "--resident-trainer",
               "--steps", str(args.steps - WARMUP_STEPS + 1), "--rounds", "1"] + (["--compile"] if args.trellis_compile else [])
    peak_gib = run_child(command, args.out / f"trellis_{round_}.log", dict(os.environ))
    result = json.loads((out / "flow_steps_vllm.json").read_text())
    flow = result["modes"]["overlap"]
    records = {r["step"]: r for r in result["flow_steps"]}
    # flow_steps measures the overlap round's steps first; their records follow in step order
    steps = sorted(records)[: len(flow["steps_s"])]
    tokens = [records[s]["throughput/effective_tgs"] * records[s]["time/step"] for s in steps]
    engine = json.loads((out / "engine_steps_vllm_resident.json").read_text())
    engine_tokens = [r["throughput/effective_tgs"] * r["time/step"] for r in engine["steps"][1:]]
    engine_wall = [r["time/step"] for r in engine["steps"][1:]]
    return {"step_s": flow["step_s"], "steps_s": flow["steps_s"], "e2e_effective_tgs": sum(tokens) / sum(flow["steps_s"]),
            "workers_idle_fraction": flow["workers_idle_fraction"],
            "response_len_mean": statistics.mean(records[s]["response/response_len/mean"] for s in steps),
            "in_process_step_s": engine["step_s"], "in_process_e2e_effective_tgs": sum(engine_tokens) / sum(engine_wall),
            "peak_gpu_gib": peak_gib}


def trl_child(out: Path, steps: int) -> None:
    """TRL's GRPOTrainer as its docs set it up for one GPU with vLLM colocated."""
    import pyarrow.parquet as pq
    import torch
    import transformers
    import trl
    import vllm
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(HERE))
    from engine_steps import random_qwen2_05b

    from engine.tiny.model import build_tokenizer
    from engine.tiny.reverse_task import write_dataset

    model_dir, data = WORK / "qwen2-05b-random", WORK / "train.parquet"
    if not (model_dir / "config.json").exists():
        random_qwen2_05b(build_tokenizer(), model_dir)
    if not data.exists():
        write_dataset(data, 2048, seed=0)
    rows = pq.read_table(data).to_pylist()
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]} for r in rows])

    def reverse_reward(completions, label, **_):
        return [1.0 if c[0]["content"].strip() == answer else 0.0 for c, answer in zip(completions, label)]

    record = {"step_s": [], "tokens": [], "completion_len": []}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            self.started, self.seen = time.perf_counter(), state.num_input_tokens_seen

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            record["step_s"].append(time.perf_counter() - self.started)
            record["tokens"].append(state.num_input_tokens_seen - self.seen)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                record["completion_len"].append(logs["completions/mean_length"])

    config = GRPOConfig(
        output_dir=str(WORK / "trl_out"),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        vllm_enable_sleep_mode=False,
        per_device_train_batch_size=32,
        gradient_accumulation_steps=8,
        num_generations=8,
        max_completion_length=256,
        bf16=True,
        beta=0.0,
        learning_rate=1e-6,
        temperature=1.0,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[reverse_reward], args=config, train_dataset=dataset,
                          processing_class=build_tokenizer(), callbacks=[Clock()])
    trainer.train()
    record["versions"] = {"trl": trl.__version__, "vllm": vllm.__version__, "transformers": transformers.__version__,
                          "torch": torch.__version__, "param_dtype": str(next(trainer.model.parameters()).dtype)}
    out.write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=6, help=f"optimizer steps per contestant, the first {WARMUP_STEPS} not measured")
    parser.add_argument("--order", default="trl,trellis")
    parser.add_argument("--trellis-compile", action="store_true", help="train_worker.compile=true for trellis")
    parser.add_argument("--trl-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.trl_child:
        trl_child(args.trl_child, args.steps)
        os._exit(0)  # vLLM's engine threads would hold the process open
    runs: dict[str, list[dict]] = {"trl": [], "trellis": []}
    for round_, name in enumerate(args.order.split(",")):
        try:
            runs[name].append((trl_contestant if name == "trl" else trellis_contestant)(args, round_))
        except Exception as error:  # the other contestant still runs; the log says what broke
            runs[name].append({"error": f"{type(error).__name__}: {error}"[:1000]})
        print(name, json.dumps(runs[name][-1]), flush=True)
    summary = {"samples_per_step": 256, "max_new_tokens": 256, "warmup_steps": WARMUP_STEPS, "trellis_compile": args.trellis_compile,
               "runs": runs}
    ok = {name: [r for r in rs if "error" not in r] for name, rs in runs.items()}
    if ok["trl"] and ok["trellis"]:
        trl_step = statistics.median(r["step_s"] for r in ok["trl"])
        trl_tgs = statistics.median(r["e2e_effective_tgs"] for r in ok["trl"])
        flow_step = statistics.median(r["step_s"] for r in ok["trellis"])
        flow_tgs = statistics.median(r["e2e_effective_tgs"] for r in ok["trellis"])
        engine_tgs = statistics.median(r["in_process_e2e_effective_tgs"] for r in ok["trellis"])
        summary.update(trl_step_s=trl_step, trellis_flow_step_s=flow_step,
                       flow_speedup_vs_trl=trl_step / flow_step, flow_tgs_vs_trl=flow_tgs / trl_tgs,
                       engine_tgs_vs_trl=engine_tgs / trl_tgs)
    (args.out / "h200_trl_peer.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
