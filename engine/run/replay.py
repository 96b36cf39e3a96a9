"""Counterfactual replay of one stored step (``trellis replay RUN@STEP --set key=value``).

The policy is rebuilt as it stood before the step: from the run's last complete checkpoint before it,
and when that checkpoint is older, by replaying the stored steps in between with the run's own
settings (``debug_train`` on the run's lake). From there the step is applied twice to exactly the
rollouts the run stored for it: once with the run's settings, once with the changed ones. Both
updates run in this process, with no rollout worker; what differs between them is written as
``comparison.json`` and ``comparison.md`` under ``{run}/replays/step-NNNNNN-<name>/``.

With no change the first update is the run's own, bit for bit, when the run was deterministic and ran
the trainer the same way (the in-process runner, or one trainer rank with the same torch threads).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch

from trellis.engine.config import TrellisConfig
from trellis.engine.config.loading import config_from_mapping
from trellis.engine.data.prepare import IGNORE, TrainSequence, prepare_train_data
from trellis.engine.errors import SettingError
from trellis.engine.run.local import LocalRun
from trellis.engine.run.plan import run_config_uri
from trellis.engine.storage.checkpoints import SaveStore, read_json, require_complete, write_json
from trellis.engine.storage.lake import read_groups, stored_steps
from trellis.engine.storage.store import Store

logger = logging.getLogger(__name__)

# Figures of the step's fit compared side by side (what is logged for the step, when logged).
FIT_FIGURES = (
    "train/lr", "train/pg_loss", "train/grad_norm", "train/clipfrac", "train/clipfrac_low", "train/clipfrac_high",
    "train/entropy", "train/kl_loss", "response/advantages/mean", "response/advantages/min", "response/advantages/max",
    "response/training_samples", "response/training_tokens",
)


class ReplayError(SettingError):
    """The step cannot be replayed as asked: a clear message says why."""


@dataclass
class ReplayComparison:
    run: str
    step: int
    changes: list[str]
    start: str  # where the policy before the step came from
    bridged_steps: list[int]  # stored steps replayed to reach the step
    figures: dict[str, dict[str, float | None]]  # name -> {"as_run", "changed"}
    policy_kl: float  # k3 estimate of KL(as run || changed) over the step's trained tokens
    policy_logprob_diff_max: float  # largest |log p_as_run - log p_changed| on a trained token
    advantage_diff_mean: float  # mean |A_as_run - A_changed| over trained tokens (0: same advantages)
    advantage_diff_max: float
    tokens_with_other_advantage: int
    trained_tokens: int
    identical_updates: bool  # the two updated policies hold the same weights, bit for bit
    # The as-run update against the run's own HF export of the step, bit for bit (None: no export)
    matches_run_export: bool | None = None
    folder: str = ""
    notes: list[str] = field(default_factory=list)


def stored_run_config(run: Store) -> dict[str, Any]:
    """The settings a run was launched with, as it recorded them (``logs/config.json``)."""
    source = Store(run_config_uri(run.uri), run.options)
    if not source.exists():
        raise ReplayError(
            f"{run.uri} has no logs/config.json: runs record their settings since trellis 2026-12-04; "
            "an older run cannot be replayed."
        )
    return read_json(source)


def replay_step(
    run: Store, step: int, changes: list[str], *, name: str | None = None, storage_options: Mapping[str, Any] | None = None,
) -> ReplayComparison:
    """Apply stored step ``step`` of ``run`` with the run's settings and with ``changes`` (``a.b=value``),
    from the same policy; write and return the comparison."""
    options = dict(storage_options or run.options)
    run = Store(run.uri, options)
    settings = stored_run_config(run)
    as_run = config_from_mapping(settings, storage_options=options)
    changed = config_from_mapping(settings, changes, storage_options=options)
    stored = stored_steps(run, "train")
    if step not in stored:
        raise ReplayError(f"{run.uri} holds no stored train batch for step {step} (stored: {_ranges(stored)}).")
    folder = f"{run.uri.rstrip('/')}/replays/step-{step:06d}-{name or _name_of(changes)}"
    _clear(Store(folder, options))  # a replay of the same name starts over
    start_uri, start_step = _checkpoint_before(run, as_run, step)
    origin = start_uri or f"{as_run.load_from} (where the run started)"
    bridged = list(range(start_step + 1, step))
    if missing := sorted(set(bridged) - set(stored)):
        raise ReplayError(f"Steps {_ranges(missing)} between checkpoint {start_uri} and step {step} are not stored in {run.uri}.")
    if bridged:  # the stored steps between the checkpoint and this one, once, with the run's settings
        bridge = _replay_config(settings, [], run, options, folder, "bridge", start_uri, step - 1, checkpoint_at=step - 1)
        _apply(bridge)
        start_uri = SaveStore(Store(bridge.checkpoint_uri, options)).uri(step - 1)
    updated, figures = {}, {}
    for branch, branch_changes in (("as_run", []), ("changed", list(changes))):
        replay = _replay_config(settings, branch_changes, run, options, folder, branch, start_uri, step)
        updated[branch], figures[branch] = _apply(replay)
    groups = read_groups(run, "train", step)
    sequences = {"as_run": _sequences(groups, as_run), "changed": _sequences(groups, changed)}
    advantage = _advantage_differences(sequences["as_run"], sequences["changed"])
    kl, largest = _policy_divergence(as_run, updated["as_run"], updated["changed"], sequences["as_run"])
    comparison = ReplayComparison(
        run=run.uri, step=step, changes=list(changes),
        start=origin, bridged_steps=bridged,
        figures={key: {b: figures[b].get(key) for b in figures} for key in FIT_FIGURES if any(key in f for f in figures.values())},
        policy_kl=kl, policy_logprob_diff_max=largest, identical_updates=_same_weights(updated["as_run"], updated["changed"]),
        folder=folder, matches_run_export=_matches_export(run, step, updated["as_run"]), **advantage,
    )
    if any(s.images for s in sequences["as_run"]):
        comparison.notes.append("sequences with images are left out of the policy KL (text-only scoring)")
    write_json(asdict(comparison), Store(f"{folder}/comparison.json", options))
    with Store(f"{folder}/comparison.md", options).open("w") as handle:
        handle.write(comparison_markdown(comparison))
    logger.info("Replay of step %d written to %s", step, folder)
    return comparison


def _clear(folder: Store) -> None:
    fs, path = folder.fs()
    if fs.exists(path):
        fs.rm(path, recursive=True)


def _checkpoint_before(run: Store, config: TrellisConfig, step: int) -> tuple[str | None, int]:
    """The run's last complete checkpoint before ``step``, else where the run itself started. Looked
    for where the run is now, which need not be the work_dir it was launched with."""
    saves = SaveStore(run.join("checkpoints"))
    earlier = [s for s in saves.complete_steps() if s < step]
    if earlier:
        return saves.uri(max(earlier)), max(earlier)
    own = config.load_checkpoint_cfg.checkpoint_path
    if own is not None:
        return own, int(require_complete(Store(own, config.storage_options))["step"])
    return None, 0


def _replay_config(settings: dict[str, Any], changes: list[str], run: Store, options: dict[str, Any], folder: str,
                   branch: str, start: str | None, last: int, checkpoint_at: int | None = None) -> TrellisConfig:
    """The run's settings (with ``changes``) made into an in-process ``debug_train`` run of its stored
    steps up to ``last``, from ``start``: one trainer, no rollout worker, nothing but the fit."""
    raw = {key: value for key, value in settings.items() if key not in ("replay_buffer", "checkpoint_no_save_replay_buffer")}
    load = {**raw.get("load_checkpoint_cfg", {}), "checkpoint_path": start, "load_optimizer_states": True, "load_dataset": True}
    return config_from_mapping(raw, changes, **{
        "storage_options": options, "work_dir": folder, "experiment_name": branch, "trainer": "colocated",
        "debug_train": True, "debug_rollout": False, "debug_rollout_dir": run.uri, "load_checkpoint_cfg": load,
        "auto_resume": False, "total_train_steps": last, "total_epochs": None,
        "enable_evaluate": False, "enable_initial_evaluate": False, "hf_interval": -1, "check_weights_interval": 0,
        "checkpoint_interval": checkpoint_at if checkpoint_at is not None else -1,
        "train_resources": {**raw.get("train_resources", {}), "num_workers": 1},
        "rollout_resources": {**raw.get("rollout_resources", {}), "num_workers": 1},
    })


def _apply(config: TrellisConfig) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Run the replay; the updated weights (on CPU) and the last step's logged figures."""
    with LocalRun(config) as run:
        reports = run.run()
        assert run.worker is not None  # debug_train starts a trainer
        weights = {name: tensor.detach().cpu().clone() for name, tensor in run.worker.export_weights().items()}
    return weights, dict(reports[-1].metrics) if reports else {}


def _sequences(groups, config: TrellisConfig) -> list[TrainSequence]:
    """The step's training sequences as ``config`` prepares them (in stored order: compared by rollout id)."""
    return prepare_train_data(groups, config.advantage, shuffle=False, seed=config.seed, mask_truncated=config.loss.mask_truncated).sequences


def _advantage_differences(as_run: list[TrainSequence], changed: list[TrainSequence]) -> dict[str, Any]:
    """Per trained token, how far the changed settings moved its advantage."""
    other = {s.rollout_id: s for s in changed}
    differences = []
    for sequence in as_run:
        twin = other.get(sequence.rollout_id)
        for index, label in enumerate(sequence.labels):
            if label == IGNORE:
                continue
            theirs = twin.advantages[index] if twin is not None and twin.labels[index] != IGNORE else 0.0
            differences.append(abs(sequence.advantages[index] - theirs))
    return {
        "advantage_diff_mean": sum(differences) / max(1, len(differences)),
        "advantage_diff_max": max(differences, default=0.0),
        "tokens_with_other_advantage": sum(d > 0 for d in differences),
        "trained_tokens": len(differences),
    }


@torch.no_grad()
def _policy_divergence(config: TrellisConfig, first: Mapping[str, torch.Tensor], second: Mapping[str, torch.Tensor],
                       sequences: list[TrainSequence]) -> tuple[float, float]:
    """k3 estimate of KL(first || second) on the step's trained tokens, and the largest logprob gap."""
    from trellis.engine.vision.models import policy_auto_class

    model = policy_auto_class(config.load_from).from_pretrained(config.load_from, dtype=torch.float32).eval()
    logprobs = []
    for weights in (first, second):
        unexpected = model.load_state_dict(dict(weights), strict=False).unexpected_keys
        if unexpected:
            raise KeyError(f"The scoring model has no weights named {unexpected[:5]}.")
        logprobs.append([_token_logprobs(model, s) for s in sequences if not s.images])
    k3, count, largest = 0.0, 0, 0.0
    for mine, theirs in zip(*logprobs):
        ratio = theirs - mine  # log p_second - log p_first
        k3 += float((ratio.exp() - ratio - 1).sum())
        count += ratio.numel()
        largest = max(largest, float(ratio.abs().max())) if ratio.numel() else largest
    return k3 / max(1, count), largest


def _token_logprobs(model, sequence: TrainSequence) -> torch.Tensor:
    ids = torch.tensor([sequence.input_ids])
    labels = torch.tensor(sequence.labels)
    trained = labels != IGNORE
    logits = model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits[trained], dim=-1).gather(-1, labels[trained, None]).squeeze(-1)


def _matches_export(run: Store, step: int, weights: Mapping[str, torch.Tensor]) -> bool | None:
    """Whether ``weights`` are the run's HF export of ``step``, every exported tensor bit for bit."""
    from safetensors.torch import load

    export = run.join("hf", f"step-{step:06d}")
    fs, folder = export.fs()
    files = sorted(fs.glob(f"{folder}/*.safetensors")) if fs.exists(folder) else []
    if not files:
        return None
    for path in files:
        with fs.open(path, "rb") as handle:
            for name, tensor in load(handle.read()).items():
                if name not in weights or not torch.equal(weights[name].to(tensor.dtype), tensor):
                    return False
    return True


def _same_weights(first: Mapping[str, torch.Tensor], second: Mapping[str, torch.Tensor]) -> bool:
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def _name_of(changes: list[str]) -> str:
    text = "-".join(changes) or "unchanged"
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text)[:80]


def _ranges(steps: list[int]) -> str:
    return f"{min(steps)}..{max(steps)}" if steps else "none"


def comparison_markdown(comparison: ReplayComparison) -> str:
    """The report page: what was replayed, from where, and the two updates side by side."""
    def shown(value: float | None) -> str:
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.6g}"

    lines = [
        f"# Replay of step {comparison.step}",
        "",
        f"- run: `{comparison.run}`",
        f"- changes: {', '.join(f'`{c}`' for c in comparison.changes) or 'none (the run replayed as it was)'}",
        f"- policy before the step: `{comparison.start}`"
        + (f", then stored steps {comparison.bridged_steps[0]}..{comparison.bridged_steps[-1]} replayed" if comparison.bridged_steps else ""),
        "",
        "| figure | as run | changed |",
        "| --- | --- | --- |",
        *(f"| {key} | {shown(v.get('as_run'))} | {shown(v.get('changed'))} |" for key, v in comparison.figures.items()),
        "",
        f"- KL(as run || changed) between the two updated policies, k3 over the step's {comparison.trained_tokens} trained tokens: "
        f"{comparison.policy_kl:.3g} (largest logprob gap {comparison.policy_logprob_diff_max:.3g})",
        f"- advantages: {comparison.tokens_with_other_advantage} of {comparison.trained_tokens} trained tokens changed, "
        f"mean |difference| {comparison.advantage_diff_mean:.3g}, largest {comparison.advantage_diff_max:.3g}",
        f"- the two updates are {'identical, bit for bit' if comparison.identical_updates else 'different'}",
        *([f"- the as-run update {'is' if comparison.matches_run_export else 'is NOT'} the run's own (its HF export "
           f"of step {comparison.step}, bit for bit)"] if comparison.matches_run_export is not None else []),
        *(f"- note: {note}" for note in comparison.notes),
        "",
    ]
    return "\n".join(lines)
