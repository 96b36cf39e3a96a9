"""Training throughput and MFU on packed 8k-token micro-batches of a Qwen2-shaped model (0.5B, 1.5B or
3B, random init), against a plain loop.

Every variant trains the same batch for a few optimizer steps, fp32 master weights with bf16
autocast, fused AdamW. The batch is GRPO-shaped (groups of 8 samples sharing a 128-token prompt,
responses of 64-1536 tokens, loss on response tokens), or with ``--shape long`` sequences that each
fill an 8k row:

- ``plain``: the loop everyone writes first: right-padded rows, the model's full logits, log-softmax
  in float32;
- ``trellis_<layout>[+compile|+compile_decoder][+graphs][+fsdp]``: ``TrainingWorker.fit`` itself, with
  that layout, compiled decoder layers (or the whole decoder as one graph), replayed as CUDA graphs,
  and bf16 from FSDP2's mixed-precision policy instead of autocast;
- ``<variant>+liger``: the same with Liger's fused RMSNorm, rotary and SwiGLU kernels patched into
  transformers' Qwen2 classes. The patch is global, so these variants run after all others.
- ``+keep_logits``: the chunked head keeps its logits for the backward pass instead of recomputing
  them (``train_worker.logprob_keep_logits``); ``+pack16k``: 16k-token micro-batches;
- ``+fa4``: FlashAttention-4's CuTe kernels in place of PyTorch's FA2 for the packed rows
  (``train_worker.attention_kernel: fa4``).

MFU counts the FLOPs the objective needs, whatever a variant spends on padding or recompute:
6 x body parameters per token, 6 x hidden x vocab per labelled token (the output layer), and
6 x layers x hidden x sum(len^2) for causal attention, against 989 TFLOP/s (H200 dense bf16).

    python bench/gpu/train_mfu.py OUT_DIR [--model 0.5b|1.5b|3b] [--steps 4] [--tokens 65536] [--shape grpo|long]
        [--variants plain,trellis_packed,...] [--profile | --profile-variant NAME]

writes OUT_DIR/h200_train_mfu_<shape>.json (0.5B) or OUT_DIR/h200_train_mfu_<model>_<shape>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from engine_steps import random_qwen2_05b  # noqa: E402

from trellis.engine.config.loading import load_config  # noqa: E402
from trellis.engine.algo.losses import token_logprobs  # noqa: E402
from trellis.engine.train.packing import pack, to_padded  # noqa: E402
from trellis.engine.data.prepare import IGNORE, PreparedBatch, TrainSequence  # noqa: E402
from trellis.engine.tiny.model import build_tokenizer  # noqa: E402
from trellis.engine.tiny.reverse_task import write_dataset  # noqa: E402
from trellis.engine.train.worker import TrainingWorker  # noqa: E402

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
PEAK_FLOPS = 989e12
PACK = 8192


def grpo_batch(total_tokens: int, vocab: int, seed: int = 0, shape: str = "grpo") -> list[TrainSequence]:
    """``grpo``: groups of 8 responses of 64-1536 tokens to one prompt. ``long``: single sequences
    that each fill a packed row, the shape of the plain-loop figures in shared/STACK.md."""
    rng = random.Random(seed)
    sequences: list[TrainSequence] = []
    group, lengths = (8, (64, 1536)) if shape == "grpo" else (1, (PACK - 128, PACK - 128))
    used = 0
    while used < total_tokens:
        drawn = grpo_group(rng, vocab, group, lengths)
        sequences += drawn
        used += sum(seq.num_tokens for seq in drawn)
    return sequences


def grpo_group(rng: random.Random, vocab: int, samples: int, lengths: tuple[int, int]) -> list[TrainSequence]:
    """``samples`` random responses of ``lengths`` (min, max) tokens to one random 128-token prompt, with
    advantages of +-1 and the rollout logprobs of a uniform policy, laid out as ``prepare`` lays a group."""
    prompt = [rng.randrange(vocab) for _ in range(128)]
    group = []
    for _ in range(samples):
        response = [rng.randrange(vocab) for _ in range(rng.randint(*lengths))]
        group.append(TrainSequence(
            input_ids=(prompt + response)[:-1],
            labels=[IGNORE] * 127 + response,
            advantages=[0.0] * 127 + [rng.choice((-1.0, 1.0))] * len(response),
            rollout_logprobs=[0.0] * 127 + [-11.9] * len(response),
            prompt_length=128,
        ))
    return group


def objective_flops(model, sequences: list[TrainSequence]) -> float:
    config = model.config
    body = sum(p.numel() for p in model.parameters()) - config.vocab_size * config.hidden_size
    tokens = sum(s.num_tokens for s in sequences)
    labelled = sum(sum(1 for label in s.labels if label != IGNORE) for s in sequences)
    attention_width = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    attention = 6 * config.num_hidden_layers * attention_width * sum(s.num_tokens**2 for s in sequences)
    return 6 * body * tokens + 6 * config.hidden_size * config.vocab_size * labelled + attention


def plain_loop(model_dir: Path, sequences, pad_id: int, dtype: torch.dtype = torch.float32):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda()
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    micro = [to_padded(sequences, idx, pad_id).to(torch.device("cuda")) for idx in pack(sequences, PACK)]
    tokens = float(sum(int(m.loss_mask_NL.sum()) for m in micro))

    def step():
        for batch in micro:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.float32):
                logits = model(input_ids=batch.input_ids_NL, attention_mask=batch.attention_mask_NL).logits
            logprobs = token_logprobs(logits, batch.labels_NL)
            (-(logprobs * batch.advantages_NL).sum() / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    padded_tokens = sum(m.input_ids_NL.numel() for m in micro)
    return model, step, {"micro_batches": len(micro), "pad_fraction": 1 - sum(s.num_tokens for s in sequences) / padded_tokens}


def trellis_worker(config, sequences, name: str):
    """``trellis_<layout>[+compile|+compile_decoder][+graphs][+fsdp]``: FSDP2's mixed precision instead of
    autocast; ``compile_decoder`` compiles the whole decoder as one graph instead of layer by layer;
    ``graphs`` replays the compiled code as CUDA graphs."""
    layout, *options = name.removeprefix("trellis_").split("+")
    if "liger" in options:
        use_liger()
    settings = {"layout": layout, "compile": "compile" in options or "compile_decoder" in options, "fsdp": "fsdp" in options,
                "compile_scope": "decoder" if "compile_decoder" in options else "layers", "cuda_graphs": "graphs" in options,
                "logprob_keep_logits": "keep_logits" in options, "pack_max_length": 2 * PACK if "pack16k" in options else PACK,
                "attention_kernel": "fa4" if "fa4" in options else "torch"}
    worker = TrainingWorker(
        config.model_copy(update={"train_worker": config.train_worker.model_copy(update=settings)}),
        total_train_steps=100,
        pad_token_id=0,
    )
    state = {"step": 0}

    def step():
        state["step"] += 1
        metrics = worker.fit(PreparedBatch(sequences=sequences), state["step"]).metrics
        step.peak_gib = max(step.peak_gib, metrics["memory/train_peak_gib"])  # fit resets PyTorch's peak counter

    step.peak_gib = 0.0
    return worker.model, step, {}


def use_liger() -> None:
    """Liger's RMSNorm, rotary and SwiGLU kernels in place of transformers' Qwen2 ones (the output layer
    stays trellis's chunked log-prob head, which Liger's fused cross-entropy does not replace)."""
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2

    apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)


def measure(step, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def profile(step, path: Path) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - started
    events = prof.key_averages()
    on_gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]  # kernels, not the ops that launched them
    gpu_us = sum(e.self_device_time_total for e in on_gpu)
    kernels = sum(e.count for e in on_gpu)
    by_gpu = events.table(sort_by="self_device_time_total", row_limit=30)
    by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=30)
    path.write_text(f"gpu busy {gpu_us / 1e3:.1f} ms of a {wall_s * 1e3:.0f} ms step (profiled), {kernels} kernels\n"
                    f"{by_gpu}\nBy host time:\n{by_cpu}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--model", choices=("0.5b", "1.5b", "3b"), default="0.5b")
    parser.add_argument("--profile", action="store_true", help="also write each variant's top kernels")
    parser.add_argument("--profile-variant", help="write this variant's top kernels only")
    parser.add_argument("--shape", choices=("grpo", "long"), default="grpo", help="see grpo_batch")
    parser.add_argument("--variants", default="plain,trellis_padded,trellis_packed,trellis_packed+fsdp,trellis_packed+compile")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/trellis-gpu")
    tokenizer = build_tokenizer()
    tag = args.model.replace(".", "")  # 05b, 15b, 3b
    model_dir = work / f"qwen2-{tag}-random"
    if not (model_dir / "config.json").exists():
        random_qwen2_05b(tokenizer, model_dir, max_positions=PACK, shape=args.model)
    config = load_config(
        None,
        load_from=str(model_dir),
        train_dataset={"path": str(write_dataset(work / "train.parquet", 64, seed=0))},
        reward={"function": "trellis.engine.tiny.reverse_task:score"},
        total_train_steps=100,
        train_worker={"pack_max_length": PACK},
        loss={"rollout_is": {"level": "none"}},
    )
    sequences = grpo_batch(args.tokens, 151936, shape=args.shape)
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "model": args.model, "shape": args.shape, "sequences": len(sequences),
               "tokens_per_step": sum(s.num_tokens for s in sequences), "pack_max_length": PACK, "variants": {}}
    result_file = args.out / f"h200_train_mfu_{'' if args.model == '0.5b' else tag + '_'}{args.shape}.json"
    variants = sorted(args.variants.split(","), key=lambda name: "+liger" in name)  # the patch is global: last
    for name in variants:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            if name.startswith("plain"):
                if "+liger" in name:
                    use_liger()
                dtype = torch.bfloat16 if name.startswith("plain_bf16") else torch.float32
                model, step, extra = plain_loop(model_dir, sequences, tokenizer.pad_token_id, dtype)
            else:
                model, step, extra = trellis_worker(config, sequences, name)
            warmup = measure(step, 3 if "graphs" in name else 2 if "compile" in name else 1)
            times = measure(step, args.steps)
        except Exception as error:  # a variant that fails is reported, the others still run
            results["variants"][name] = {"error": f"{type(error).__name__}: {error}"[:2000], "where": traceback.format_exc()[-3000:]}
            print(name, results["variants"][name], flush=True)
            continue
        seconds = statistics.median(times)
        flops = objective_flops(model, sequences)
        peak_gib = getattr(step, "peak_gib", None) or torch.cuda.max_memory_allocated() / 2**30
        results["variants"][name] = {
            **extra,
            "warmup_s": warmup,
            "step_s": times,
            "tokens_per_s": results["tokens_per_step"] / seconds,
            "tflops": flops / seconds / 1e12,
            "mfu": flops / seconds / PEAK_FLOPS,
            "peak_memory_gib": peak_gib,
        }
        print(name, json.dumps(results["variants"][name]), flush=True)
        result_file.write_text(json.dumps(results, indent=2))  # what finished survives a run cut short
        if args.profile or name == args.profile_variant:
            profile(step, args.out / f"profile_{name.replace('+', '-')}.txt")
        del model, step
        gc.collect()
    plain = results["variants"].get("plain", {}).get("tokens_per_s")
    for figures in results["variants"].values():
        if plain and "tokens_per_s" in figures:
            figures["speed_vs_plain"] = figures["tokens_per_s"] / plain
    result_file.write_text(json.dumps(results, indent=2))
    shown = ("mfu", "tokens_per_s", "speed_vs_plain", "error")
    print(json.dumps({n: {k: v for k, v in f.items() if k in shown} for n, f in results["variants"].items()}, indent=1))


if __name__ == "__main__":
    main()
