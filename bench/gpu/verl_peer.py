"""trellis's colocated GPU step against verl's GRPO trainer (FSDP + vLLM, its sync v1 trainer), on one GPU,
in one call.

Both train the workload of ``trl_peer.py``: the same random Qwen2-0.5B-shaped model folder and
tokenizer, the bundled reverse task's prompts, 32 prompts x 8 samples = 256 completions of up to 256 new
tokens per step, one optimizer step per batch, no KL term, lr 1e-6, temperature 1.0, vLLM at
``--vllm-memory`` (0.3) of the GPU, tensor parallel 1, fp32 master weights under bf16 compute. verl is
started as its users start it, ``python -m verl.trainer.main_ppo`` with Hydra overrides (``verl_config.overrides()``
lists every one); everything else keeps verl 0.9.1's defaults, among them: the v1 ``sync`` trainer over
TransferQueue, the async vLLM server replica with sleep mode (vLLM frees its weights and KV cache after
each rollout and takes the new weights over CUDA IPC before the next), old log-probs recomputed by the
actor, ``use_remove_padding`` (packed sequences), gradient checkpointing ON, ``use_torch_compile`` (the
log-prob/entropy helpers only), no dynamic batch size, FSDP with fp32 master weights and bf16 compute,
AdamW with grad clip 1.0, verl masking the logits past ``len(tokenizer)`` (the random model's vocabulary is
151,936; the tokenizer's a few hundred, so verl samples EOS about once in 300 tokens where the other
sides, sampling the whole vocabulary, never do: see ``ignore_eos`` below).

Changed from verl's defaults, and why:
- ``attn_implementation=sdpa``: verl asks transformers for ``flash_attention_2``, which needs the
  flash-attn package; it has no wheel on PyPI for torch 2.11 (the device's), so the device has none.
  transformers builds the block-diagonal mask of packed sequences from ``position_ids`` for sdpa.
- ``ppo_micro_batch_size_per_gpu=32`` and ``log_prob_micro_batch_size_per_gpu=32``: verl has no default
  (it refuses to start without one, or dynamic batch size); 32 is TRL's per-device batch in trl_peer.py.
- ``data.max_prompt_length=64`` (default 512): the prompts are ~15 tokens; verl pads every prompt to this.
- ``rollout.ignore_eos=True`` (``--keep-eos``: verl's default, False): on this random model every TRL and
  trellis completion runs to 256 tokens (bench/RESULTS.md, 2026-12-03); verl, masking the vocabulary
  tail, would stop ~60% of its samples early at EOS while its rollout still lasts as long as its longest
  sample, so it would train fewer tokens in a step of about the same length. With ``ignore_eos`` every
  side trains 256 x 256 response tokens a step.
- validation, checkpoints and wandb off; ``trainer.logger=[console,file]``: the file logger's JSONL is
  what the figures are read from.

Figures, as trl_peer.py computes them: the step wall time is verl's own ``timing_s/step`` (its
``marked_timer("step")`` around rollout, reward, old log-probs, advantages, the update and the weight
sync to vLLM); the first ``WARMUP_STEPS`` are not measured; trained response tokens =
``response_length/mean`` (tokens up to and including EOS) x the samples of the step
(``perf/total_num_tokens`` / (prompt + response mean), 32 x 8 where a step lacks them); tokens/s = their
sum over the sum of the measured steps' times; peak GPU memory from nvidia-smi. ``wall_between_lines_s``
checks verl's timer: the wall time between the metrics lines of consecutive steps, which also holds the
per-step metrics and logging that ``timing_s/step`` leaves out.

``--order verl,trellis`` runs trellis's side as trl_peer.py does (``flow_steps.py --backend vllm
--resident-trainer --early-launch-only --flow-only``) after verl, in the same call, each in its own
process; ``--rounds`` alternates them.

    python bench/gpu/verl_peer.py OUT_DIR [--steps 10] [--rounds 1] [--order verl,trellis]
        [--vllm-memory 0.3] [--verl-timeout 420] [--no-remove-padding] [--no-grad-ckpt] [--keep-eos]
        [--set KEY=VALUE ...]
    python bench/gpu/verl_peer.py OUT_DIR --dry-run   # CPU: data, reward file, overrides, composed config

On the H200 machine, once ../shared/gpu's vllm-1 and rayprefect-1 chunks have been sent (earlier calls on
the same warm machine), in a call that carries .gpu/tools, .gpu/vllm-2 and .whl-verl
(bench/gpu/verl_wheels.sh makes it):

    source .gpu/tools/unpack.sh; test -f /tmp/vllm-site/.done -a -f /tmp/rayprefect.done || exit 3;
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site
    .whl-verl/*.whl || exit 4; export PYTHONPATH=$PWD:/tmp/site; python3 bench/gpu/verl_peer.py $OUT
    > $OUT/verl_peer.out 2>&1; echo rc=$?; tail -c 6000 $OUT/verl_peer.out; tail -c 4000 $OUT/verl_1.log

verl's processes get vLLM's site (``$TRELLIS_VLLM_SITE``, which unpack.sh exports) on their PYTHONPATH
from this script: its Ray cluster is started by verl's driver (``address=local``), so every Ray worker
and vLLM engine process inherits the driver's environment.

writes OUT_DIR/h200_verl_peer.json (the command verl ran with is in it), verl's log (verl_<round>.log),
its per-step metrics (verl_<round>.jsonl), the config its Hydra run saved (verl_<round>_config.yaml) and
verl_runs_so_far.json after each contestant (what a call cut short still returns).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))  # engine/, for the model and prompts
sys.path.insert(0, str(HERE.parent))  # bench/, for _compare
sys.path.insert(0, str(HERE))
from _compare import alternated  # noqa: E402
from host_load import add_end_leftovers_argument  # noqa: E402
from peer_report import report, run_contestant  # noqa: E402
from peer_workload import WARMUP_STEPS, WORK, PeakGpuMemory, prepare_model_and_data  # noqa: E402
from verl_config import dry_run, overrides, verl_data, verl_defaults_kept, verl_env, verl_settings  # noqa: E402
from verl_records import phase_medians, read_steps  # noqa: E402

CONTESTANTS = ("verl", "trellis", "trellis-eager", "trellis-compiled")
DIFFER_BY_DESIGN = {
    "compiled": "each side's default (verl compiles its log-prob/entropy helpers, not the model)",
    "tokens counted from": "each side's own records",
    "activation checkpointing": "each side's default (verl: on; trellis: off)",
}
FIGURES = {"step_s": ".3f", "trained_response_tokens_per_s": ",.0f", "trained_response_tokens": ",.0f", "response_len_mean": ".1f",
           "peak_gpu_gib": ".1f", "workers_idle_fraction": ".3f", "core_loop_ms_median": ".1f"}


def run_verl(args: argparse.Namespace, round_: int, model: Path, train: Path, val: Path) -> dict:
    metrics, log = args.out / f"verl_{round_}.jsonl", args.out / f"verl_{round_}.log"
    metrics.unlink(missing_ok=True)
    command = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides(args, model, train, val, round_)]
    started, error = time.perf_counter(), None
    with PeakGpuMemory() as memory, LineClock(metrics) as clock, open(log, "w") as handle:
        child = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=verl_env(args, metrics),
                                 cwd=str(WORK), start_new_session=True)
        try:
            rc = child.wait(timeout=args.verl_timeout)
            if rc != 0:
                error = f"verl exited with {rc}: see {log.name}"
        except subprocess.TimeoutExpired:
            error = f"verl ran past --verl-timeout {args.verl_timeout} s: see {log.name}"
        finally:
            end_session(child)
    wall = time.perf_counter() - started
    hydra_config = WORK / f"verl_hydra_{round_}" / ".hydra" / "config.yaml"
    if hydra_config.exists():
        (args.out / f"verl_{round_}_config.yaml").write_text(hydra_config.read_text())
    steps = read_steps(metrics, log)
    peak_gib = memory.peak_mib / 1024 if memory.peak_mib is not None else None
    measured = [s for s in steps if s["step"] > WARMUP_STEPS]
    if len(measured) < 2:
        return {"error": error or f"only {len(steps)} steps logged: see {log.name}", "steps_logged": len(steps), "wall_s": wall,
                "steps": steps, "command": command}
    wall_steps = [s["timing_s/step"] for s in measured]
    tokens = [s["response_length/mean"] * s["samples"] for s in measured]
    samples = sum(s["samples"] for s in measured)
    result = {"step_s": statistics.median(wall_steps), "steps_s": [s["timing_s/step"] for s in steps],
              "trained_response_tokens": sum(tokens), "trained_response_tokens_per_s": sum(tokens) / sum(wall_steps),
              "response_len_mean": sum(tokens) / samples, "peak_gpu_gib": peak_gib, "wall_s": wall,
              "phases_s": phase_medians(measured), "steps": steps, "command": command,
              # wall time between the metrics lines of consecutive steps, the measured ones: a check on timing_s/step
              "wall_between_lines_s": [b - a for a, b in zip(clock.times, clock.times[1:])][WARMUP_STEPS - 1:],
              "settings": {"warm-up steps": WARMUP_STEPS, "measured steps": len(measured)}}
    try:  # the figures stand even if the saved config cannot be read
        result["settings"] = {**verl_settings(args, hydra_config, model, train), **result["settings"]}
        result["verl_defaults_kept"] = verl_defaults_kept(hydra_config)
    except Exception as failure:
        result["settings_error"] = f"{type(failure).__name__}: {failure}"[:500]
    if error:
        result["note"] = error  # the measured steps still count; the log says what broke after them
    return result


def end_session(child: subprocess.Popen) -> None:
    """End verl's driver and whatever it left in its session (Ray's processes, vLLM's engine), then wait
    for the GPU to empty."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.perf_counter() + 15
        try:
            os.killpg(child.pid, sig)
            while time.perf_counter() < deadline:
                os.killpg(child.pid, 0)  # raises once no process of the session is left
                time.sleep(0.2)
        except ProcessLookupError:
            break
    if child.poll() is None:
        child.wait()
    wait_for_free_gpu()


class LineClock:
    """When each line of verl's metrics file appeared (verl's file logger writes one unbuffered line per
    step, after the step's metrics): the wall time between two lines is everything a step took, logging
    included, a check on verl's own ``timing_s/step``."""

    def __init__(self, path: Path):
        self.path, self.times = path, []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> LineClock:
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._done.wait(0.05):
            try:
                lines = self.path.read_bytes().count(b"\n")
            except FileNotFoundError:
                continue
            self.times.extend([time.perf_counter()] * (lines - len(self.times)))

    def __exit__(self, *_) -> None:
        self._done.set()
        self._thread.join()


def wait_for_free_gpu(limit_s: float = 60.0) -> None:
    """The next contestant starts on a free GPU: wait until nvidia-smi shows (almost) nothing in use."""
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            return
        if not out or int(out[0]) < 2048:
            return
        time.sleep(1)


def trellis_side(args: argparse.Namespace, round_: int, name: str) -> dict:
    from trl_peer import trellis_contestant

    args.smoke = False
    return trellis_contestant(args, round_, name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=WARMUP_STEPS + 8, help=f"optimizer steps per contestant, the first {WARMUP_STEPS} not measured")
    parser.add_argument("--rounds", type=int, default=1, help="of every contestant, alternated")
    add_end_leftovers_argument(parser)
    parser.add_argument("--order", default="verl", help=f"contestants in their order within a round, from {', '.join(CONTESTANTS)}")
    parser.add_argument("--vllm-memory", type=float, default=0.3)
    parser.add_argument("--torch-threads", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--max-prompt-length", type=int, default=64)
    parser.add_argument("--verl-timeout", type=float, default=420.0, help="seconds verl may run before it is stopped")
    parser.add_argument("--no-remove-padding", action="store_true", help="verl's padded path instead of its default packing")
    parser.add_argument("--no-grad-ckpt", action="store_true", help="activation checkpointing off (verl's default is on)")
    parser.add_argument("--keep-eos", action="store_true", help="verl stops at EOS (its default); else every sample runs to 256 tokens")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="one more Hydra override for verl")
    parser.add_argument("--dry-run", action="store_true", help="CPU: build data, compose and check verl's config; run nothing")
    args = parser.parse_args()
    if args.steps < WARMUP_STEPS + 2:
        parser.error(f"--steps: {WARMUP_STEPS} warm-up steps and at least 2 measured ones")
    names = list(dict.fromkeys(args.order.split(",")))
    if set(names) - set(CONTESTANTS):
        parser.error(f"--order: unknown contestant(s) {sorted(set(names) - set(CONTESTANTS))}")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    args.smoke = args.dry_run  # trl_peer's helpers: the tiny model on a CPU
    model, data = prepare_model_and_data(args)
    train, val = verl_data(model, data, args.max_prompt_length)
    if args.dry_run:
        dry_run(args, model, train, val)
        return
    runs: dict[str, list[dict]] = {name: [] for name in names}
    order = alternated(names, args.rounds)
    print("order:", " ".join(f"{name}[{round_}]" for round_, name in order), flush=True)
    for round_, name in order:
        run = partial(run_verl, args, round_, model, train, val) if name == "verl" else partial(trellis_side, args, round_, name)
        runs[name].append(run_contestant(f"round {round_} {name}", run, end_leftovers_first=args.end_leftovers))
        r = runs[name][-1]
        print(f"round {round_} {name:16s} " + (r["error"] if "error" in r else
              f"step median {r['step_s']:.3f} s  trained response tokens/s {r['trained_response_tokens_per_s']:,.0f}  "
              f"trained response tokens {r['trained_response_tokens']:,.0f}  response mean {r['response_len_mean']:.1f}"), flush=True)
        (args.out / "verl_runs_so_far.json").write_text(json.dumps(runs, indent=1))
    summary = report(args, runs, order, peer="verl", figure_formats=FIGURES, differ_by_design=DIFFER_BY_DESIGN,
                     warmup_steps=WARMUP_STEPS)
    (args.out / "h200_verl_peer.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
