"""What one 3B decoder layer's projections run at, separate as the HF model holds them or fused (q/k/v in
one matmul, gate/up in one), forward and backward with weight gradients, the way trellis trains: fp32
weights under bf16 autocast. Qwen2.5-3B shape (hidden 2048, 16 query and 2 key-value heads of 128,
intermediate 11008), 16,384 tokens a micro-batch (``pack16k``). Issue 30 item 4 asks whether fusing
them lifts the matmuls' ~670 TFLOP/s.

    python bench/gpu/fused_projections.py OUT_DIR      (writes OUT_DIR/fused_projections.json)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

HIDDEN, Q, KV, FFN, TOKENS = 2048, 2048, 256, 11008, 16384
REPEATS, ROUNDS = 20, 5


def linear_set(shapes: list[tuple[int, int]], fused: bool) -> list[torch.nn.Linear]:
    if fused:
        return [torch.nn.Linear(shapes[0][0], sum(out for _, out in shapes), bias=False, device="cuda")]
    return [torch.nn.Linear(inp, out, bias=False, device="cuda") for inp, out in shapes]


def timed(layers: list[torch.nn.Linear], x: torch.Tensor) -> float:
    """Seconds for REPEATS forward + backward passes (input and weight gradients)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPEATS):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs = [layer(x) for layer in layers]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / REPEATS


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    groups = {"qkv": [(HIDDEN, Q), (HIDDEN, KV), (HIDDEN, KV)], "gate_up": [(HIDDEN, FFN), (HIDDEN, FFN)],
              "o": [(Q, HIDDEN)], "down": [(FFN, HIDDEN)]}
    x_of = {inp: torch.randn(TOKENS, inp, device="cuda", requires_grad=True) for inp in (HIDDEN, FFN)}
    results: dict = {}
    for name, shapes in groups.items():
        flops = 6 * TOKENS * sum(i * o for i, o in shapes)  # forward 2, backward 4
        sides = {"separate": linear_set(shapes, False)} | ({"fused": linear_set(shapes, True)} if len(shapes) > 1 else {})
        times: dict[str, list[float]] = {side: [] for side in sides}
        for layers in sides.values():
            timed(layers, x_of[shapes[0][0]])  # warm-up
        for round_index in range(ROUNDS):
            for side in sides if round_index % 2 == 0 else reversed(list(sides)):
                times[side].append(timed(sides[side], x_of[shapes[0][0]]))
        results[name] = {
            side: {"ms": statistics.median(t) * 1e3, "min_ms": min(t) * 1e3, "max_ms": max(t) * 1e3,
                   "tflop_s": flops / statistics.median(t) / 1e12} for side, t in times.items()
        }
    separate = sum(r["separate"]["ms"] for r in results.values())
    fused = sum(r.get("fused", r["separate"])["ms"] for r in results.values())
    results["layer_projections_ms"] = {"separate": separate, "fused": fused, "fused / separate": fused / separate}
    results["device"] = torch.cuda.get_device_name()
    (out / "fused_projections.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1), flush=True)


if __name__ == "__main__":
    main()
