"""The bundled task learned by the asynchronous trainer on two GPUs: the trainer on one, vLLM on the
other, max_staleness 1 with partial rollout, as a Prefect flow on a local Ray cluster trellis starts.
Held-out accuracy must rise and the train/rollout logprob mismatch stay small, or the per-token
versions, the rollout logprobs or the NCCL weight sync are wrong.

    python bench/gpu/async_learning.py OUT_DIR [--steps 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from trellis.engine.cluster.head import stop_head
from trellis.engine.config.loading import load_config
from trellis.flows.rl_train import rl_train
from vllm_learning import tiny_task  # beside this script
from process_exit import exit_now  # beside this script


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--backend", choices=("vllm", "transformers"), default="vllm")
    parser.add_argument("--share-one-gpu", action="store_true", help="both sides on one GPU, half each")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TRELLIS_BENCH_WORK", "/tmp/trellis-gpu/async-tiny"))
    vllm_site = os.environ.get("TRELLIS_VLLM_SITE")
    config = load_config(
        "configs/tiny_reverse.yaml",
        **tiny_task(work),
        work_dir=str(work / "runs"),
        experiment_name=f"async-{int(time.time())}",
        total_train_steps=args.steps,
        evaluate_step=10,
        checkpoint_interval=-1,
        hf_interval=-1,
        auto_resume=False,
        deterministic=False,  # vLLM compiles its model, which inductor's deterministic mode refuses
        exp_tracker="jsonl",
        trainer="disaggregated",
        replay_buffer={"kind": "async", "max_staleness": 1, "enable_partial_rollout": True},
        train_resources={"accelerators_per_worker": 0.5 if args.share_one_gpu else 1},
        rollout_resources={"accelerators_per_worker": 0.5 if args.share_one_gpu else 1},
        rollout={
            "backend": args.backend, "temperature": 0.6, "max_new_tokens": 8, "gpu_memory_utilization": 0.3,
            "runtime_env": {"env_vars": {"PYTHONPATH": f"{vllm_site}:${{PYTHONPATH}}"}} if vllm_site else None,
        },
        cluster={"home": str(work / "cluster"), "flow_retries": 0},
    )
    started = time.perf_counter()
    try:
        rl_train(config)
    finally:
        stop_head(config.cluster)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in Path(config.run_uri, "logs", "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/step" in r]
    result = {
        "backend": args.backend,
        "gpus": 1 if args.share_one_gpu else 2,
        "steps": args.steps,
        "wall_s": wall,
        "eval_accuracy": {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r},
        "reward_first5": statistics.mean(r["response/rewards/mean"] for r in steps[:5]),
        "reward_last5": statistics.mean(r["response/rewards/mean"] for r in steps[-5:]),
        "staleness_max": max(r["async/staleness_max"] for r in steps),
        "staleness_mean": statistics.mean(r["async/staleness_mean"] for r in steps),
        "mismatch_k3_kl_median": statistics.median(r["mismatch/k3_kl"] for r in steps[1:]),
        "mismatch_abs_logprob_diff_median": statistics.median(r["mismatch/abs_logprob_diff"] for r in steps[1:]),
        "time_median_s": {k: statistics.median(r.get(k, 0.0) for r in steps) for k in steps[-1] if k.startswith(("time/", "timing/"))},
    }
    (args.out / f"async_learning_{args.backend}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
    main()
    exit_now()
