"""The trajectory lake: every sample of every step as a Parquet row, through fsspec.

Layout: ``{run}/trajectories/split={train|eval}/step=000012/part-0.parquet`` (Hive partitions, so
``pyarrow.dataset`` and DuckDB read ``split`` and ``step`` as columns). A part is written whole or not
at all (``Store.replace_bytes``: renamed into place on a disk, one PUT on an object store), so a reader
never sees half a file, and rewriting a step (a retried task) replaces its part instead of adding rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from trellis.engine.data.samples import RolloutSample, Status
from trellis.engine.moe.codec import decode, encode
from trellis.engine.parquet_reads import read_parquet
from trellis.engine.storage.lake_images import IMAGE_TYPE, fetched, image_cells, images_of, messages_of, prompt_cells, store_inline_images
from trellis.engine.storage.store import Store

SCHEMA = pa.schema(
    [
        ("run", pa.string()),
        ("train_step", pa.int64()),
        ("policy_version", pa.int64()),
        ("rollout_id", pa.string()),
        ("group_id", pa.string()),
        ("session_id", pa.string()),
        ("task_name", pa.string()),
        ("data_source", pa.string()),
        ("status", pa.string()),
        ("finish_reason", pa.string()),
        ("error_msg", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("label", pa.string()),
        ("response", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("rollout_logprobs", pa.list_(pa.float32())),
        ("response_mask", pa.list_(pa.int8())),
        ("response_versions", pa.list_(pa.int32())),  # the policy version of each response token
        # MoE: the rollout engine's expert ids per response token, raw [R, layers, K] uint8 (int16 past
        # 256 experts) bytes with their shape; see engine.moe.codec. Null for dense models.
        ("routed_experts", pa.binary()),
        ("routed_experts_shape", pa.list_(pa.int32())),
        ("epoch", pa.int64()),
        ("prompt_index", pa.int64()),
        ("max_new_tokens", pa.int32()),  # the prompt's own cap on response tokens, null for the run's
        ("reward", pa.float64()),
        ("reward_payload", pa.string()),  # JSON: payloads differ in shape between reward functions
        ("prompt_len", pa.int32()),
        ("response_len", pa.int32()),
        ("extra", pa.string()),  # JSON of the dataset's extra columns
        ("agent", pa.string()),  # JSON of multi-turn agent fields, null for single-turn samples
        ("flow_run_id", pa.string()),  # the orchestrator run (Prefect flow run of the step) that wrote the row
        ("checkpoint", pa.string()),  # what policy_version was saved as (null: never saved); see engine.storage.lineage
        ("prompt_parts", pa.string()),  # JSON of messages made of text and image parts; null for plain text
        ("images", pa.list_(IMAGE_TYPE)),  # references to the prompt's images; see engine.storage.lake_images
    ]
)


@dataclass(frozen=True)
class RowLineage:
    """Where rows came from: the flow run writing them, and the checkpoint of each policy version."""

    flow_run_id: str | None = None
    checkpoints: Mapping[int, str | None] = field(default_factory=dict)


def partition_uri(run_uri: str, split: str, step: int) -> str:
    return f"{run_uri.rstrip('/')}/trajectories/split={split}/step={step:06d}"


def to_row(
    sample: RolloutSample, run: str, lineage: RowLineage | None = None, *, routing: bool = True,
    stored_images: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``routing``: keep the sample's routed experts (rollout.store_routed_experts). ``stored_images``:
    where the lake keeps the inline images, by hash (``store_inline_images``)."""
    lineage = lineage or RowLineage()
    routed, routed_shape = encode(sample.routed_experts if routing else None)
    prompt, prompt_parts = prompt_cells(sample.messages)
    return {
        "run": run,
        "train_step": sample.train_step,
        "policy_version": sample.policy_version,
        "rollout_id": sample.rollout_id,
        "group_id": sample.group_id,
        "session_id": sample.session_id,
        "task_name": sample.task_name,
        "data_source": sample.data_source,
        "status": sample.status.value,
        "finish_reason": sample.finish_reason,
        "error_msg": sample.error,
        "prompt": prompt,
        "label": None if sample.label is None else str(sample.label),
        "response": sample.response,
        "prompt_ids": sample.prompt_ids,
        "response_ids": sample.response_ids,
        "rollout_logprobs": sample.logprobs,
        "response_mask": sample.response_mask,
        "response_versions": sample.response_versions or [sample.policy_version] * len(sample.response_ids),
        "routed_experts": routed,
        "routed_experts_shape": routed_shape,
        "epoch": sample.epoch,
        "prompt_index": sample.prompt_index,
        "max_new_tokens": sample.max_new_tokens,
        "reward": sample.reward,
        "reward_payload": json.dumps(sample.reward_payload, default=str),
        "prompt_len": len(sample.prompt_ids),
        "response_len": len(sample.response_ids),
        "extra": json.dumps(sample.extra, default=str),
        "agent": None if sample.agent is None else json.dumps(sample.agent, default=str),
        "flow_run_id": lineage.flow_run_id,
        "checkpoint": lineage.checkpoints.get(sample.policy_version),
        "prompt_parts": prompt_parts,
        "images": image_cells(sample.images, stored_images or {}),
    }


def write_samples(
    samples: list[RolloutSample], *, root: Store, run: str, split: str, step: int, lineage: RowLineage | None = None,
    routing: bool = True,
) -> str:
    """Write one step's samples as one Parquet part under ``root`` (the run's folder); return the part's URI.
    ``routing``: keep each sample's routed experts (rollout.store_routed_experts)."""
    stored = store_inline_images(samples, root)
    rows = [to_row(s, run, lineage, routing=routing, stored_images=stored) for s in samples]
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    return write_part(table, Store(partition_uri(root.uri, split, step), root.options))


def produced_uri(run_uri: str, round_index: int) -> str:
    """Where the disaggregated producer's groups land as they are scored, before any training step."""
    return f"{run_uri.rstrip('/')}/produced/round={round_index:06d}"


def write_part(table: pa.Table, folder: Store, *, part: int = 0) -> str:
    """``table`` as ``{folder}/part-{part}.parquet``, written under a temporary name and renamed,
    so a reader never sees half a file and writing a part again replaces it."""
    return write_table(table, folder.join(f"part-{part}.parquet"))


def write_table(table: pa.Table, target: Store) -> str:
    """``table`` as the Parquet file ``target``, whole or not at all (``Store.replace_bytes``)."""
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    target.replace_bytes(buffer.getvalue().to_pybytes())
    return target.uri


class LakeError(RuntimeError):
    """A lake partition is missing or cannot be turned back into samples."""


def stored_steps(run: Store, split: str) -> list[int]:
    """Steps that have a part in ``{run}/trajectories/split={split}``."""
    fs, folder = run.join("trajectories", f"split={split}").fs()
    fs.invalidate_cache()
    if not fs.exists(folder):
        return []
    steps = []
    for entry in fs.ls(folder, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("step=") and fs.exists(f"{entry.rstrip('/')}/part-0.parquet"):
            steps.append(int(name.removeprefix("step=")))
    return sorted(steps)


def read_groups(run: Store, split: str, step: int) -> list[list[RolloutSample]]:
    """One stored step back as groups of samples, in the order they were produced: what
    ``debug_train`` replays into training (token ids, rollout logprobs, rewards, statuses)."""
    uri = f"{partition_uri(run.uri, split, step)}/part-0.parquet"
    fs, path = Store(uri, run.options).fs()
    if not fs.exists(path):
        raise LakeError(f"No stored batch for step {step}: {uri} does not exist.")
    rows = read_parquet(fs, path).to_pylist()
    groups: dict[str, list[RolloutSample]] = {}
    for row in sorted(rows, key=lambda r: r["rollout_id"]):
        sample = from_row(row)
        sample.images = [fetched(image, run.options) for image in sample.images]
        groups.setdefault(row["group_id"], []).append(sample)
    return list(groups.values())


def from_row(row: dict[str, Any]) -> RolloutSample:
    return RolloutSample(
        rollout_id=row["rollout_id"],
        group_id=row["group_id"],
        session_id=row["session_id"],
        prompt_index=row.get("prompt_index", -1),
        messages=messages_of(row["prompt"], row.get("prompt_parts")),
        prompt_ids=list(row["prompt_ids"]),
        label=row["label"],
        data_source=row["data_source"],
        task_name=row["task_name"],
        extra=json.loads(row["extra"] or "{}"),
        response_ids=list(row["response_ids"]),
        logprobs=list(row["rollout_logprobs"]),
        response=row["response"],
        finish_reason=row["finish_reason"],
        response_mask=None if row["response_mask"] is None else list(row["response_mask"]),
        response_versions=list(row.get("response_versions") or []),
        routed_experts=decode(row.get("routed_experts"), row.get("routed_experts_shape")),
        epoch=row.get("epoch", 0),
        max_new_tokens=row.get("max_new_tokens"),
        status=Status(row["status"]),
        error=row["error_msg"],
        reward=row["reward"],
        reward_payload=json.loads(row["reward_payload"] or "{}"),
        policy_version=row["policy_version"],
        train_step=row["train_step"],
        agent=json.loads(row["agent"]) if row.get("agent") else None,
        images=images_of(row.get("images")),
    )


def summary(samples: list[RolloutSample]) -> dict[str, float]:
    """The reference's per-step trajectory summary (reward and response-length statistics)."""
    rewards = [s.reward for s in samples if s.reward is not None]
    lengths = [float(len(s.response_ids)) for s in samples]

    def stats(values: list[float], prefix: str) -> dict[str, float]:
        if not values:
            return {}
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
        return {f"{prefix}_mean": mean, f"{prefix}_std": std, f"{prefix}_max": max(values), f"{prefix}_min": min(values)}

    return {**stats(rewards, "reward"), **stats(lengths, "response_len"), "total_len": float(len(samples))}
