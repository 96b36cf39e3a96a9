"""The disaggregated asynchronous trainer against the colocated one, on the GPUs of one machine, with
response lengths that have a long tail.

Same model (random-init Qwen2-0.5B shape, bf16 rollout on vLLM), same prompts, same length mix, same
warm-up and measured steps, both as Prefect flows on a local Ray cluster that trellis starts:

- ``colocated``: trainer and rollout share one GPU; with ``--workers N``, N GPUs each hold a trainer rank
  (one FSDP2 group over NCCL) and a rollout worker, and the batch grows N-fold (same batch per GPU);
- ``disaggregated``: 1 trainer GPU + 1 rollout GPU, ``max_staleness`` 1 (``--max-staleness``), partial
  rollout on, expired groups generated again at once (``--tail-trigger N``: set aside for the tail lane);
  weights go trainer -> rollout over NCCL.

The modes run alternately (A B A B: ``--rounds`` of each), each run in its own process on a fresh
cluster; every figure is its median over the rounds with the spread (min .. max) beside it. First,
the settings each run read back from its own config and metrics are printed side by side and checked
equal (model, prompts, samples, length mix, warm-up and measured steps): one that differs fails the bench.

Each prompt caps its response at a length drawn from a lognormal (mean ~1k tokens, at most 8k), the
dataset's ``max_new_tokens`` column; the random model never stops by itself, so every response runs
to its cap and the tail is real. Reported per mode: trained tokens per second over the measured
steps (after the warm-up), the same per GPU held, step time, the weight-sync pause, each GPU's idle
fraction (NVML utilization sampled every 0.2 s over the measured steps), and for the asynchronous
run the staleness of every trained token (from the trajectory lake).

The trained lengths differ: the producer hands over groups in the order they end, so the first
batches of an asynchronous run hold the short responses and the long ones arrive steps later. The
figures are therefore normalised by trained tokens (tokens/s, never steps/s), and the trained
response length of both modes is printed beside them; ``--sigma 0`` gives every response the same
length, so both train the same lengths.

    python bench/gpu/async_vs_colocated.py OUT_DIR [--mode both|colocated|disaggregated] [--rounds 2]
        [--steps 6] [--warmup 2] [--prompts 32] [--share-one-gpu] [--workers N] [--shape 0.5b|1.5b] [--smoke]

Four runs of the long-tail workload take ~20 minutes, more than one 600 s device call: run one mode per
call (``--mode colocated --rounds 1 --round 1``, then disaggregated round 1, disaggregated round 2,
colocated round 2, into folders of their own), then ``--combine FOLDER...`` reports over them as if
they were one alternated call (settings checked equal, ratios paired by round). The device image lacks
pebble and duckdb, which trellis imports: carry ``.whl`` (the trl_peer wheels) with ``rayprefect-1`` and
``pip install --no-index --no-deps .whl/pebble-*.whl .whl/duckdb-*.whl`` first.

Scaling over GPUs: ``--mode colocated --workers 2`` against ``--workers 1`` (``--sigma 0``).

``--smoke``: the same code on CPU (tiny model, transformers backend, short caps, small batch).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for _compare

from trellis.flows.prefect_settings import use_lean_temporary_server  # noqa: E402

use_lean_temporary_server()  # before Prefect is imported: each run starts its temporary server as the CLI does

from _compare import alternated  # noqa: E402
from async_report import MODES, combine, report  # noqa: E402
from engine_steps import random_qwen2_05b  # noqa: E402
from host_load import add_end_leftovers_argument, clean_host  # noqa: E402
from process_exit import exit_now  # noqa: E402
from run_facts import caps_digest, staleness_histogram, weights_digest  # noqa: E402

from trellis.engine.cluster.head import stop_head  # noqa: E402
from trellis.engine.config.loading import load_config  # noqa: E402
from trellis.engine.storage.lake_query import goodput_device_seconds, run_goodput  # noqa: E402
from trellis.engine.tiny.model import build_tiny_checkpoint, build_tokenizer  # noqa: E402
from trellis.engine.tiny.reverse_task import write_dataset  # noqa: E402
from trellis.flows.rl_train import rl_train  # noqa: E402


def long_tail_caps(count: int, *, mean: float, cap: int, sigma: float, seed: int) -> list[int]:
    """Per-prompt response caps from a lognormal of the given mean, clipped to [16, cap]."""
    mu = np.log(mean) - sigma**2 / 2
    return np.clip(np.random.default_rng(seed).lognormal(mu, sigma, count), 16, cap).astype(int).tolist()


def write_long_tail_dataset(path: Path, count: int, args: argparse.Namespace) -> Path:
    write_dataset(path, count, seed=0)
    table = pq.read_table(path)
    caps = long_tail_caps(count, mean=args.mean_len, cap=args.max_len, sigma=args.sigma, seed=1)
    pq.write_table(table.append_column("max_new_tokens", pa.array(caps, pa.int64())), path)
    return path


class Sampler:
    """On a thread, every ``period_s``: NVML utilization of every GPU (none on a machine without NVML)
    and how many steps ``metrics`` holds, so that a window of steps has wall-clock bounds."""

    def __init__(self, metrics: Path, period_s: float = 0.2) -> None:
        self.samples: list[tuple[float, list[int]]] = []
        self.steps_logged: list[tuple[float, int]] = []
        self._metrics = metrics
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._read = lambda h: pynvml.nvmlDeviceGetUtilizationRates(h).gpu
        except Exception:  # no NVML here (CPU smoke run)
            self._handles = []
        self._thread = threading.Thread(target=self._sample, args=(period_s,), daemon=True)
        self._thread.start()

    def _sample(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            now = time.time()
            if self._handles:
                self.samples.append((now, [self._read(h) for h in self._handles]))
            if self._metrics.exists():
                self.steps_logged.append((now, len(self._metrics.read_text().splitlines())))

    def reached(self, steps: int) -> float:
        """When ``steps`` steps had been logged."""
        return next(t for t, logged in self.steps_logged if logged >= steps)

    def idle_fraction(self, start: float, end: float) -> list[float]:
        """Per GPU, 1 - mean utilization over [start, end]."""
        window = [u for t, u in self.samples if start <= t <= end]
        return [1.0 - statistics.mean(u[i] for u in window) / 100.0 for i in range(len(window[0]))] if window else []

    def close(self) -> None:
        self._stop.set()


def run_config(work: Path, args: argparse.Namespace):
    smoke = args.smoke
    if smoke:
        model = build_tiny_checkpoint(work / "tiny-model")
    else:
        model = work / f"qwen2-{args.shape}-random-16k"
        if not (model / "config.json").exists():
            random_qwen2_05b(build_tokenizer(), model, max_positions=args.max_len + 512, shape=args.shape)
    data = write_long_tail_dataset(work / f"long_tail_{args.max_len}.parquet", 4096, args)
    vllm_site = os.environ.get("TRELLIS_VLLM_SITE")
    disaggregated = args.mode == "disaggregated"
    settings = dict(
        load_from=str(model),
        train_dataset={"path": str(data), "max_prompt_length": 64},
        reward={"function": "trellis.engine.tiny.reverse_task:score"},
        work_dir=str(work / "runs"),
        experiment_name=f"{args.mode}-round{args.round}-{int(time.time())}",
        total_train_steps=args.steps,
        train_batch_size=args.prompts * args.workers,
        prompt_repeat_k=args.group,
        checkpoint_interval=-1,
        hf_interval=-1,
        auto_resume=False,
        exp_tracker="jsonl",
        rollout={
            "backend": "transformers" if smoke else "vllm",
            "max_new_tokens": args.max_len,
            # a colocated engine shares its GPU with the trainer; disaggregated engines split the rollout GPU(s)
            "gpu_memory_utilization": (0.85 if disaggregated and not args.share_one_gpu else 0.4)
            / (args.rollout_workers if disaggregated else 1),
            "runtime_env": {"env_vars": {"PYTHONPATH": f"{vllm_site}:${{PYTHONPATH}}"}} if vllm_site else None,
        },
        train_worker={"pack_max_length": 2 * args.max_len if not smoke else 512},
        cluster={"home": str(work / "cluster"), "head_port": free_port(), "release_workers_at_end": True, "flow_retries": 0},
    )
    if disaggregated:
        settings.update(
            trainer="disaggregated",
            replay_buffer={"kind": "async", "max_staleness": args.max_staleness, "enable_partial_rollout": True,
                           "tail_batch_trigger_size": args.tail_trigger},
            train_resources={"accelerators_per_worker": 0.5 if args.share_one_gpu else 1},
            rollout_resources={
                "num_workers": args.rollout_workers,
                "accelerators_per_worker": (0.5 if args.share_one_gpu else 1) / args.rollout_workers,
            },
        )
    else:
        settings.update(train_resources={"num_workers": args.workers}, rollout_resources={"num_workers": args.workers})
    return load_config(None, **settings)


def free_port() -> int:
    """A port for this run's own Ray head (another cluster on the machine may hold Ray's default)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def weight_bytes(config) -> int:
    """Bytes of the weights one sync sends: bf16 to vLLM, float32 to a CPU rollout."""
    from safetensors import safe_open

    per_element = 4 if config.rollout.backend == "transformers" else 2
    total = 0
    for shard in Path(config.load_from).glob("*.safetensors"):
        with safe_open(shard, framework="pt") as handle:
            for name in handle.keys():
                total += math.prod(handle.get_slice(name).get_shape())
    return total * per_element


def run_settings(config, records: dict[int, dict], args: argparse.Namespace, held_gpus: int) -> dict:
    """What the run really ran with, read back from its own config and metrics."""
    measured = [s for s in sorted(records) if s > args.warmup]
    rollout = config.rollout
    return {
        "model (weights digest)": f"{Path(config.load_from).name} ({weights_digest(Path(config.load_from))})",
        "prompts x samples per step": f"{config.train_batch_size} x {config.prompt_repeat_k}",
        "length mix (response caps)": f"lognormal mean {args.mean_len:g}, max {args.max_len}, sigma {args.sigma:g}",
        "prompts + caps digest": caps_digest(Path(config.train_dataset.path)),
        "rollout engine": rollout.backend,
        "max new tokens, temperature": f"{rollout.max_new_tokens}, {rollout.temperature}",
        "learning rate, KL coefficient": f"{config.optim.lr:g}, {config.loss.kl_coef:g}",
        "train micro-batch tokens (pack_max_length)": config.train_worker.pack_max_length,
        "warm-up steps": args.warmup,
        "measured steps": f"{measured[0]}..{measured[-1]} ({len(measured)})" if measured else "none",
        "tokens counted": "prompt + response tokens of every trained sample (metrics: training_tokens)",
        "trainer": config.trainer,
        "max_staleness, tail lane trigger": f"{config.replay_buffer.max_staleness}, {config.replay_buffer.tail_batch_trigger_size}"
        if config.trainer == "disaggregated" else "(colocated: none)",
        "GPUs held": held_gpus or "none (CPU)",
        "vLLM gpu_memory_utilization": rollout.gpu_memory_utilization if rollout.backend == "vllm" else "no vLLM",
        "rollout engines": config.rollout_resources.num_workers,
    }


def summarize(config, records: dict[int, dict], gpus: Sampler, started: float, args: argparse.Namespace) -> dict:
    steady = [records[s] for s in sorted(records) if s > args.warmup]
    window_start, window_end = gpus.reached(args.warmup), gpus.reached(max(records))
    wall = window_end - window_start
    tokens = sum(r["response/training_tokens"] for r in steady)
    # the response tokens (up to and including EOS) of the samples trained: the mean length times the samples it is over
    response_tokens = sum(r["response/response_len/mean"] * r["response/batch_size"] for r in steady)
    held_gpus = 0 if args.smoke else 2 if args.mode == "disaggregated" and not args.share_one_gpu else args.workers
    last = records[max(records)]
    timings = {k: statistics.median(r.get(k, 0.0) for r in steady) for k in steady[-1] if k.startswith(("time/", "timing/"))}
    idle = gpus.idle_fraction(window_start, window_end)
    return {
        "mode": args.mode + (" (both sides on one GPU)" if args.share_one_gpu and args.mode == "disaggregated" else ""),
        "round": args.round,
        "settings": run_settings(config, records, args, held_gpus),
        "gpus_held": held_gpus,
        "model_shape": "tiny (smoke)" if args.smoke else args.shape,
        "rollout_workers": args.workers if args.mode == "colocated" else args.rollout_workers,
        "train_peak_gib_per_rank": max((r.get("memory/train_peak_gib", 0.0) for r in steady), default=None),
        "weight_bytes": weight_bytes(config),
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "measured_steps": len(steady),
        "samples_per_step": args.prompts * args.workers * args.group,
        "trained_tokens": tokens,
        "trained_response_tokens": response_tokens,
        "response_len_mean": response_tokens / sum(r["response/batch_size"] for r in steady),
        "response_len_max": max(r["response/response_len/max"] for r in steady),
        "step_s_median": statistics.median(r["time/step"] for r in steady),
        "measured_wall_s": wall,
        "trained_tokens_per_s": tokens / wall,
        "trained_response_tokens_per_s": response_tokens / wall,
        "trained_tokens_per_s_per_gpu": tokens / wall / held_gpus if held_gpus else None,
        "e2e_effective_tgs_whole_run": last["throughput/e2e_effective_tgs"],
        "started_at": started,
        "run_wall_s": time.time() - started,
        "timings_median_s": timings,
        # step by step: a median hides whether one slow stretch or every step moved (a lease's slow cores)
        "timings_by_step_s": {k: [round(r.get(k, 0.0), 4) for r in steady] for k in ("time/step", "time/rollout", "time/fit", "time/get_batch")
                              if any(k in r for r in steady)},
        "weight_sync_s_median": timings.get("time/sync_weights", 0.0),
        "weight_sync_bytes_per_s": weight_bytes(config) / max(timings.get("time/sync_weights", 0.0), 1e-9),
        # the producer stands still from the start of its pause to its continue (no save or eval here)
        "producer_paused_s_median": sum(timings.get(f"time/{p}", 0.0) for p in ("pause_produce", "sync_weights", "continue_produce"))
        if args.mode == "disaggregated" else None,
        "gpu_idle_fraction": idle,
        "gpu_idle_fraction_mean": statistics.mean(idle) if idle else None,
        "mismatch_k3_median": statistics.median(r["mismatch/k3_kl"] for r in steady) if "mismatch/k3_kl" in steady[0] else None,
        "async": {k: last[k] for k in last if k.startswith("async/")},
        "staleness": staleness_histogram(config.run_uri) if args.mode == "disaggregated" else None,
        **goodput_figures(records, args.warmup),
    }


def goodput_figures(records: dict[int, dict], warmup: int) -> dict:
    """Where the measured steps' device-seconds went (engine.run.goodput's split), and the run's goodput %."""
    measured = goodput_device_seconds({s: r for s, r in records.items() if s > warmup})
    whole = sum(measured.values()) or float("nan")
    discarded = sum(v for k, v in measured.items() if k.startswith("discarded/"))
    return {
        "goodput_percent": 100.0 * measured.get("trained_tokens", 0.0) / whole,
        "goodput_percent_whole_run": run_goodput(records),
        "goodput_idle_share": measured.get("idle", 0.0) / whole,
        "goodput_discarded_share": discarded / whole,
        "goodput_device_s": measured,
        "goodput_share": {k: v / whole for k, v in sorted(measured.items())},
    }


def run_one(args: argparse.Namespace) -> None:
    """One run of one mode, in this (child) process; its summary goes to ``args.result``."""
    args.mode = args.child
    work = Path(os.environ.get("TRELLIS_BENCH_WORK", "/tmp/trellis-gpu/async"))
    work.mkdir(parents=True, exist_ok=True)
    config = run_config(work, args)
    gpus = Sampler(Path(config.run_uri, "logs", "metrics.jsonl"))
    started = time.time()
    try:
        rl_train(config)
        lines = Path(config.run_uri, "logs", "metrics.jsonl").read_text().splitlines()
        records = {r["step"]: r for r in map(json.loads, lines) if "time/step" in r}
        summary = summarize(config, records, gpus, started, args)
    finally:
        gpus.close()
        stop_head(config.cluster)
    args.result.write_text(json.dumps(summary, indent=1))


def compare(args: argparse.Namespace) -> dict:
    """Every mode ``--rounds`` times, alternated, each run in a child process; then the report."""
    modes = MODES if args.mode == "both" else (args.mode,)
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    order = [(round_ + args.round - 1, mode) for round_, mode in alternated(modes, args.rounds)]
    print("order:", " ".join(f"{mode}[{round_}]" for round_, mode in order), flush=True)
    for round_, mode in order:
        result = args.out / f"run_{mode}_{round_}.json"
        command = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--child", mode, "--round", str(round_),
                   "--result", str(result)]
        with clean_host(f"round {round_} {mode}", end_leftovers_first=args.end_leftovers) as witness, open(args.out / f"run_{mode}_{round_}.log", "w") as log:
            subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
        runs[mode].append(json.loads(result.read_text()) | witness)
        result.write_text(json.dumps(runs[mode][-1], indent=1))  # --combine reads the run files: the host's speed goes with them
        r = runs[mode][-1]
        print(f"round {round_} {mode:13s} trained tokens/s {r['trained_tokens_per_s']:,.0f}  step median {r['step_s_median']:.2f} s  "
              f"trained response len {r['response_len_mean']:.1f}  trained tokens {r['trained_tokens']:,.0f}", flush=True)
    return report(runs, [f"{mode}[{round_}]" for round_, mode in order])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--mode", choices=("both", *MODES), default="both", help="both: the two modes alternated")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternated")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the measured window")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--mean-len", type=float, default=1024)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--sigma", type=float, default=1.0, help="of the lognormal of response caps")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny model, transformers backend, small batch")
    add_end_leftovers_argument(parser)
    parser.add_argument("--share-one-gpu", action="store_true", help="disaggregated: both sides on one GPU, half each")
    parser.add_argument("--workers", type=int, default=1, help="colocated: GPUs, each a trainer rank and a rollout worker")
    parser.add_argument("--shape", choices=("0.5b", "1.5b"), default="0.5b", help="of the random Qwen2 model")
    parser.add_argument("--rollout-workers", type=int, default=1, help="disaggregated: vLLM engines sharing the rollout GPU(s)")
    parser.add_argument("--max-staleness", type=int, default=1, help="disaggregated: replay_buffer.max_staleness")
    parser.add_argument("--tail-trigger", type=int, default=0,
                        help="disaggregated: replay_buffer.tail_batch_trigger_size (0: expired groups generated again at once)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=1, help="the first round's number (a single-mode run made for --combine)")
    parser.add_argument("--combine", type=Path, nargs="+", metavar="RUN_FOLDER",
                        help="no run: the report over the run_<mode>_<round>.json files of earlier calls, in the order they started")
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.mean_len, args.max_len = min(args.mean_len, 8), min(args.max_len, 24)
        args.prompts, args.group, args.steps = min(args.prompts, 8), min(args.group, 4), min(args.steps, 5)
    if args.steps <= args.warmup:
        parser.error("--steps must be more than --warmup")
    if args.rounds < (2 if args.mode == "both" else 1):
        parser.error("--rounds: a comparison needs at least two rounds of each mode, alternated (or single-mode runs "
                     "in separate calls, then --combine)")
    if args.child:
        run_one(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.combine:
        summary = combine(args.combine)
        (args.out / "async_vs_colocated_combined.json").write_text(json.dumps(summary, indent=1))
        exit_now(1 if summary["unequal_settings"] else 0)
    summary = compare(args)
    suffix = ("_one_gpu" if args.share_one_gpu else "") + (f"_{args.workers}_workers" if args.workers > 1 else "")
    suffix += f"_{args.rollout_workers}_engines" if args.rollout_workers > 1 else ""
    suffix += "_smoke" if args.smoke else ""
    (args.out / f"async_vs_colocated_{args.mode}{suffix}_{args.shape}.json").write_text(json.dumps(summary, indent=1))
    if summary["unequal_settings"]:
        exit_now(1)


if __name__ == "__main__":
    main()
    exit_now()
