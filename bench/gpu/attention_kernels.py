"""Packed-row (varlen, causal, GQA) attention kernels on one GPU: PyTorch's FA2 against FlashAttention-4.

The shape of a Qwen2.5-3B layer (16 query heads, 2 KV heads, head dim 128, bf16) on an 8k-token packed
row, with GRPO-shaped sequences (128-token prompt + 64-1536 response tokens) or one 8064-token sequence.
For each kernel: forward + backward time (median of 10 after 3 warm-ups), TFLOP/s at the causal count
train_mfu.py uses (6 x heads x head_dim x sum(len^2) per forward + backward), and the largest
difference of the output and the three input gradients from FA2's.

    python bench/gpu/attention_kernels.py OUT_DIR

writes OUT_DIR/h200_attention_kernels.json.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trellis.engine.train.varlen_attention import _fa4, _flash  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, ROW = 16, 2, 128, 8192


def lengths(shape: str, seed: int = 0) -> list[int]:
    rng, out = random.Random(seed), []
    while True:
        length = 128 + rng.randint(64, 1536) if shape == "grpo" else ROW - 128
        if sum(out) + length > ROW:
            return out
        out.append(length)


def fa2(q, k, v, cu, max_len):
    return _flash(q, k, v, cu, max_len, None)  # what trellis's packed rows run today


def fa4(q, k, v, cu, max_len):
    return _fa4(q, k, v, cu, max_len, None)  # train_worker.attention_kernel: fa4


def run(kernel, q, k, v, cu, max_len, grad_out):
    for t in (q, k, v):
        t.grad = None
    out = kernel(q, k, v, cu, max_len)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def timed(kernel, *args) -> float:
    for _ in range(3):
        run(kernel, *args)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(kernel, *args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "shapes": {}}
    for shape in ("grpo", "long"):
        lens = lengths(shape)
        total, max_len = sum(lens), max(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        torch.manual_seed(0)
        q = torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(total, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        grad_out = torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        args = (q, k, v, cu, max_len, grad_out)
        flops = 6 * HEADS * HEAD_DIM * sum(n * n for n in lens)
        reference = [t.clone() for t in run(fa2, *args)]
        entry = {"sequences": len(lens), "tokens": total}
        for name, kernel in (("fa2_torch", fa2), ("fa4", fa4)):
            try:
                got = run(kernel, *args)
                seconds = timed(kernel, *args)
            except Exception as error:  # FA4 missing or failing: FA2's figures still stand
                entry[name] = {"error": f"{type(error).__name__}: {error}"[:1500]}
                continue
            entry[name] = {
                "fwd_bwd_ms": seconds * 1e3,
                "tflops": flops / seconds / 1e12,
                "max_abs_diff_vs_fa2": {n: float((a.float() - b.float()).abs().max()) for n, a, b in zip(("out", "dq", "dk", "dv"), got, reference)},
            }
        if "fwd_bwd_ms" in entry.get("fa4", {}):
            entry["fa4_speedup"] = entry["fa2_torch"]["fwd_bwd_ms"] / entry["fa4"]["fwd_bwd_ms"]
        results["shapes"][shape] = entry
        print(shape, json.dumps(entry), flush=True)
    (out_dir / "h200_attention_kernels.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
