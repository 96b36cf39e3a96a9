"""A mixture-of-experts policy on one GPU, against a dense one of the same active size, in one call.

The MoE is a random-init Qwen3-MoE of a realistic shape (``MOE_SHAPE``: 24 layers of 64 experts, top-8,
about 2.6B parameters of which about 0.5B are active per token, bf16 checkpoint); the dense side is
engine_steps.py's random Qwen2-0.5B shape. Each side is ``engine_steps.py --backend vllm
--resident-trainer`` in a process of its own (its own vLLM engine), colocated, the same prompts, batch
and lengths; the sides alternate over ``--rounds``:

- ``dense``: the Qwen2-0.5B shape;
- ``moe-none``: the MoE with its routing recorded at rollout (vLLM's ``enable_return_routed_experts``)
  but not replayed: router agreement between vLLM and the trainer, and the k3 mismatch, as they are;
- ``moe-r3``: the MoE with rollout routing replay: the trainer routes each response token as vLLM did.

Reports per side: step time, rollout and training tokens/s, router agreement, k3 mismatch, the
trainer's peak memory. vLLM's MoE kernels are stripped from ../shared/gpu's pack:
bench/gpu/pack_moe_kernels.sh packs them (its header says how to put them in place).

    python bench/gpu/moe_steps.py OUT_DIR [--steps 5] [--rounds 1] [--sides dense,moe-none,moe-r3]
        [--prompts 32] [--group 8] [--new-tokens 256] [--vllm-memory 0.35]
    python bench/gpu/moe_steps.py OUT_DIR --cpu-check   # CPU: the plumbing on a tiny MoE, transformers rollout
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_steps import result_path, step_argv, vllm_child_env  # noqa: E402

from trellis.engine.tiny.model import build_tokenizer  # noqa: E402

HERE = Path(__file__).resolve().parent
WORK = Path("/tmp/trellis-gpu")
MOE_SHAPE = dict(
    hidden_size=1024, moe_intermediate_size=512, intermediate_size=3072, num_experts=64, num_experts_per_tok=8,
    num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4, head_dim=64, norm_topk_prob=True,
)
TINY_MOE_SHAPE = dict(  # --cpu-check
    hidden_size=64, moe_intermediate_size=32, intermediate_size=128, num_experts=8, num_experts_per_tok=2,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, norm_topk_prob=True,
)
SIDES = {
    "dense": {"routing_replay": "none", "return_routed_experts": False},
    "moe-none": {"routing_replay": "none", "return_routed_experts": True},
    "moe-r3": {"routing_replay": "r3", "return_routed_experts": False},
}
FIGURES = ("time/step", "throughput/rollout_tgs", "throughput/training_tgs", "router/agreement", "mismatch/k3_kl",
           "memory/train_peak_gib")


def random_moe(out: Path, shape: dict, vocab_size: int) -> Path:
    """A randomly initialised Qwen3-MoE of ``shape``, saved in bf16 with the tiny tokenizer."""
    if (out / "config.json").exists():
        return out
    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=vocab_size, **shape, max_position_embeddings=4096, tie_word_embeddings=True, router_aux_loss_coef=0.0,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # 2.6B parameters take minutes on the host
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def active_and_total(config: dict) -> tuple[float, float]:
    """Parameters a token runs through, and all of them (billions), from a Qwen3-MoE config."""
    hidden, layers, heads, kv, head_dim = (config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                               "num_key_value_heads", "head_dim"))
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    expert = 3 * hidden * config["moe_intermediate_size"]
    embedding = config["vocab_size"] * hidden
    total = layers * (attention + config["num_experts"] * expert + hidden * config["num_experts"]) + embedding
    active = layers * (attention + config["num_experts_per_tok"] * expert + hidden * config["num_experts"]) + embedding
    return active / 1e9, total / 1e9


def run_side(side: str, out: Path, args: argparse.Namespace, moe_dir: Path) -> dict:
    side_args = argparse.Namespace(
        out=out, steps=args.steps, prompts=args.prompts, group=args.group, new_tokens=args.new_tokens,
        backend="transformers" if args.cpu_check else "vllm", vllm_memory=args.vllm_memory, lr=None,
        model=moe_dir if side != "dense" else args.dense_model, torch_threads=None, routing_replay=SIDES[side]["routing_replay"],
        return_routed_experts=SIDES[side]["return_routed_experts"], resident_trainer=not args.cpu_check, compile=False,
    )
    command = [sys.executable, str(HERE / "engine_steps.py"), *step_argv(side_args), "--warmup", "1"]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "run.log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=vllm_child_env(), timeout=args.side_timeout)
    summary = json.loads(result_path(side_args).read_text())
    measured = summary["steps"][1:]
    figures = {name: [step[name] for step in measured if name in step] for name in FIGURES}
    return {"figures": figures, "wall_steps_s": summary["wall_steps_s"], "response_len_mean": summary["response_len_mean"],
            "peak_gpu_mem_gib": summary["peak_gpu_mem_gib"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=5, help="per side and round, the first not measured")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--vllm-memory", type=float, default=0.35)
    parser.add_argument("--side-timeout", type=float, default=420.0, help="seconds one side's process may run")
    parser.add_argument("--cpu-check", action="store_true", help="a tiny MoE and the tiny dense model, transformers rollout")
    parser.add_argument("--dense-model", type=Path, help="--cpu-check: the dense model folder (trellis tiny-model)")
    args = parser.parse_args()
    sides = args.sides.split(",")
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        parser.error(f"unknown sides {unknown}; choose from {', '.join(SIDES)}")
    if args.cpu_check and "dense" in sides and args.dense_model is None:
        parser.error("--cpu-check with the dense side needs --dense-model")
    args.out.mkdir(parents=True, exist_ok=True)
    shape, vocab = (TINY_MOE_SHAPE, len(build_tokenizer())) if args.cpu_check else (MOE_SHAPE, 151936)
    moe_dir = random_moe(WORK / ("tiny-moe-random" if args.cpu_check else "qwen3-moe-64x8-random"), shape, vocab)
    active, total = active_and_total({**shape, "vocab_size": vocab})
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for round_index in range(args.rounds):
        order = sides if round_index % 2 == 0 else sides[::-1]
        for side in order:
            try:
                results[side].append(run_side(side, args.out / f"{side}_{round_index + 1}", args, moe_dir))
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
                results[side].append({"error": f"{type(error).__name__}: see {side}_{round_index + 1}/run.log"})
            print(f"round {round_index + 1} {side:9s} {json.dumps(results[side][-1])[:400]}", flush=True)

    def median(side: str, name: str) -> float | None:
        values = [v for run in results[side] for v in run.get("figures", {}).get(name, [])]
        return statistics.median(values) if values else None

    table = {side: {name: median(side, name) for name in FIGURES} for side in sides}
    summary = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "moe_shape": shape, "moe_active_b": round(active, 3), "moe_total_b": round(total, 3),
        "steps": args.steps, "rounds": args.rounds, "prompts": args.prompts, "group": args.group,
        "new_tokens": args.new_tokens, "vllm_memory": args.vllm_memory, "medians": table, "runs": results,
    }
    (args.out / "moe_steps.json").write_text(json.dumps(summary, indent=1))
    print(f"MoE: {active:.2f}B active of {total:.2f}B")
    print(f"{'side':10s}" + "".join(f"{name:>26s}" for name in FIGURES))
    for side in sides:
        print(f"{side:10s}" + "".join(f"{'-' if v is None else f'{v:.4g}':>26s}" for v in table[side].values()))


if __name__ == "__main__":
    main()
