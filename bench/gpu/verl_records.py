"""verl's per-step figures in verl_peer.py, from its file logger (one JSON line per step) or, where that
is missing, its console lines."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from peer_workload import GPU

CONSOLE_STEP = re.compile(r"step:(\d+) - (.*)")
NUMPY_SCALAR = re.compile(r"^np\.\w+\((.*)\)$")
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf")
PICKED = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/max", "response_length/clip_ratio",
          "perf/total_num_tokens", "perf/throughput", "perf/max_memory_allocated_gb", "prompt_length/mean")


def read_steps(metrics: Path, log: Path) -> list[dict]:
    """Each logged step's figures, from verl's file logger (one JSON line per step); from its console
    lines (``step:N - key:value - ...``) where the JSONL is missing."""
    raw: dict[int, dict] = {}
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                raw[int(record["step"])] = record["data"]
    elif log.exists():
        for match in CONSOLE_STEP.finditer(log.read_text(errors="replace")):
            values = {}
            for part in match.group(2).split(" - "):
                key, _, value = part.rpartition(":")
                number = NUMBER.fullmatch(NUMPY_SCALAR.sub(r"\1", value.strip()))  # numpy 2 prints np.float64(1.5)
                if key and number:
                    values[key.strip()] = float(number.group(0))
            raw[int(match.group(1))] = values
    steps = []
    for number, data in sorted(raw.items()):
        if "timing_s/step" not in data or "response_length/mean" not in data:
            continue
        per_sample = data.get("prompt_length/mean", 0.0) + data["response_length/mean"]
        samples = round(data["perf/total_num_tokens"] / per_sample) if data.get("perf/total_num_tokens") and per_sample else None
        expected = GPU["prompts"] * GPU["group"]
        steps.append({"step": number, "timing_s/step": data["timing_s/step"], "response_length/mean": data["response_length/mean"],
                      "samples": samples if samples else expected, "samples_from_total_tokens": samples,
                      **{k: v for k, v in data.items() if k.startswith("timing_s/") or k in PICKED}})
    return steps


def phase_medians(steps: list[dict]) -> dict[str, float]:
    keys = sorted({k for s in steps for k in s if k.startswith("timing_s/")})
    return {k.removeprefix("timing_s/"): statistics.median(s[k] for s in steps if k in s) for k in keys}
