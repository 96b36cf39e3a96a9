"""The bundled task learned on the GPU with vLLM rollout: the same config as CPU CI, only the
backends change (vLLM rollout in bf16, trainer on CUDA with fp32 master weights under bf16 autocast).
Held-out accuracy must rise, and the train/rollout logprob mismatch must stay near zero, or the
rollout logprobs or the weight sync are wrong.

    python bench/gpu/vllm_learning.py OUT_DIR [--steps 50] [--moe] [--quantization fp8] [--rollout-is token]

``--moe``: the tiny mixture-of-experts policy (``trellis tiny-model --moe``) with rollout routing replay
(``routing_replay: r3``): vLLM hands back each response token's experts and the trainer routes it
through them; needs vLLM's MoE kernels (bench/gpu/pack_moe_kernels.sh). Also reports router agreement.
``--quantization``: vLLM generates in FP8 and re-quantizes the weights at every sync; the mismatch
figures then measure FP8 against the trainer, and ``--rollout-is`` corrects the loss for it.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import warnings
from pathlib import Path

from trellis.engine.config.loading import load_config
from trellis.engine.run.local import LocalRun
from trellis.engine.tiny.model import build_tiny_checkpoint
from trellis.engine.tiny.reverse_task import EVAL_SEED_OFFSET, write_dataset

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


def tiny_task(work: Path, moe: bool = False) -> dict:
    """The bundled task's model and datasets under ``work``, as config settings."""
    return dict(
        load_from=str(build_tiny_checkpoint(work / ("moe" if moe else "model"), moe=moe)),
        train_dataset={"path": str(write_dataset(work / "train.parquet", 4096, seed=0)), "max_prompt_length": 64},
        eval_dataset={"path": str(write_dataset(work / "eval.parquet", 512, seed=EVAL_SEED_OFFSET)), "max_prompt_length": 64},
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--moe", action="store_true", help="the tiny MoE policy with routing replay r3")
    parser.add_argument("--quantization", choices=("none", "fp8"), default="none", help="rollout.quantization")
    parser.add_argument("--rollout-is", choices=("none", "token", "sequence"), default="none", help="loss.rollout_is.level (truncate at 2)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/trellis-gpu/tiny")
    config = load_config(
        "configs/tiny_reverse.yaml",
        **tiny_task(work, args.moe),
        work_dir=str(work / "runs"),
        total_train_steps=args.steps,
        checkpoint_interval=-1,
        hf_interval=-1,
        auto_resume=False,
        deterministic=False,
        rollout={"backend": "vllm", "temperature": 0.6, "max_new_tokens": 8, "gpu_memory_utilization": 0.3,
                 "quantization": args.quantization},
        train_worker={"device": "cuda", "routing_replay": "r3" if args.moe else "none"},
        loss={"rollout_is": {"level": args.rollout_is}},
    )
    started = time.perf_counter()
    with LocalRun(config) as run:
        reports = run.run()
    wall = time.perf_counter() - started
    steps = [r.metrics for r in reports if r.step > 0]
    evals = {r.step: r.metrics["eval/accuracy"] for r in reports if "eval/accuracy" in r.metrics}
    after_sync = [m for m in steps[1:]]  # sync every step: each later batch was sampled by freshly synced weights
    result = {
        "steps": args.steps,
        "policy": "tiny MoE, routing_replay r3" if args.moe else "tiny dense",
        "quantization": args.quantization,
        "rollout_is": args.rollout_is,
        "wall_s": wall,
        "eval_accuracy": evals,
        "reward_first5": statistics.mean(m["response/rewards/mean"] for m in steps[:5]),
        "reward_last5": statistics.mean(m["response/rewards/mean"] for m in steps[-5:]),
        "mismatch_k3_kl_median": statistics.median(m["mismatch/k3_kl"] for m in after_sync),
        "mismatch_abs_logprob_diff_median": statistics.median(m["mismatch/abs_logprob_diff"] for m in after_sync),
        "mismatch_abs_logprob_diff_max": max(m["mismatch/abs_logprob_diff_max"] for m in after_sync),
        "router_agreement_median": statistics.median([m["router/agreement"] for m in steps if "router/agreement" in m] or [float("nan")]),
        "router_replayed_tokens_last": steps[-1].get("router/replayed_tokens") if args.moe else None,
        "time_median_s": {k: statistics.median(m[k] for m in steps if k in m) for k in steps[-1] if k.startswith("time/")},
    }
    name = f"vllm_learning{'_moe' if args.moe else ''}{'' if args.quantization == 'none' else '_' + args.quantization}"
    name += "" if args.rollout_is == "none" else f"_is_{args.rollout_is}"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
    main()
    import os

    os._exit(0)
