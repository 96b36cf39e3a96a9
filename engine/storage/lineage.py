"""Lineage: what produced what, so any result can be traced back to the flow runs behind it.

    evaluation ← HF export ← checkpoint ← trajectories ← flow runs     (← the checkpoint it forked from)

- every trajectory row carries the orchestrator run that wrote it (``flow_run_id``: the Prefect flow
  run of its step) and the checkpoint its policy version was saved as (``checkpoint``; the initial
  model for version 0);
- every step leaves ``{run}/lineage/{split}/step=NNNNNN.json``: its flow run, its lake partition and
  the policy versions in it;
- every checkpoint holds ``lineage.json``: the checkpoint (or model) it continued and the steps, flow
  runs and lake partitions it trained on since;
- a run that started from another run's checkpoint (``--fork``, or ``load_checkpoint_cfg``) records it
  in ``{run}/lineage/run.json``; evaluations and exports of a checkpoint record themselves under
  ``{run}/lineage/evaluations/`` and ``{run}/lineage/exports/``.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from trellis.engine.parquet_reads import read_parquet
from trellis.engine.storage.checkpoints import (
    CheckpointError,
    SaveStore,
    read_json,
    write_json,
)
from trellis.engine.storage.rollbacks import read_trips
from trellis.engine.storage.store import Store

_STEP_IN_NAME = re.compile(r"step-(\d+)/?$")
_PARTITION = re.compile(r"split=([^/]+)/step=(\d+)/")
_TRACED_COLUMNS = ("rollout_id", "policy_version", "reward", "checkpoint", "flow_run_id")
LINEAGE_FILE = "lineage.json"


def lineage_root(run_uri: str) -> str:
    return f"{run_uri.rstrip('/')}/lineage"


def step_record_uri(run_uri: str, split: str, step: int) -> str:
    return f"{lineage_root(run_uri)}/{split}/step={step:06d}.json"


def checkpoint_step(uri: str) -> int | None:
    """The step a ``.../step-NNNNNN`` folder holds, from its name."""
    match = _STEP_IN_NAME.search(uri)
    return int(match.group(1)) if match else None


def _read_or_none(source: Store) -> dict[str, Any] | None:
    try:
        return read_json(source)
    except CheckpointError:
        return None


# -- written by the run ----------------------------------------------------------------------------


def run_origin(config) -> dict[str, Any]:
    """Where the run's first policy came from: another run's checkpoint, or a model folder."""
    explicit = config.load_checkpoint_cfg.checkpoint_path
    if explicit:
        uri = explicit.rstrip("/")
        return {"kind": "checkpoint", "uri": uri, "step": checkpoint_step(uri), "run": uri.rsplit("/", 2)[0]}
    return {"kind": "model", "uri": config.load_from, "step": 0}


def record_run_origin(config, start) -> None:
    """``{run}/lineage/run.json``, written when a run starts fresh or from another checkpoint than its
    own (a resume keeps what its first start wrote)."""
    own = start.checkpoint is not None and start.checkpoint.startswith(config.checkpoint_uri)
    if start.action not in ("fresh", "restore", "restart") or own:
        return
    write_json(
        {"run": config.run_uri, "experiment_name": config.experiment_name, "origin": run_origin(config), "at": time.time()},
        Store(f"{lineage_root(config.run_uri)}/run.json", config.storage_options),
    )


def policy_checkpoints(config, versions: Iterable[int]) -> dict[int, str | None]:
    """The checkpoint (or model) each policy version was saved as; None for one that never was."""
    store = SaveStore(Store(config.checkpoint_uri, config.storage_options))
    origin = run_origin(config)
    found: dict[int, str | None] = {}
    for version in sorted(set(versions)):
        if store.is_complete(version):
            found[version] = store.uri(version)
        elif version == origin["step"]:
            found[version] = origin["uri"]
        else:
            found[version] = None
    return found


def record_step(
    config, *, split: str, step: int, partition: str, flow_run_id: str | None, checkpoints: Mapping[int, str | None]
) -> str:
    uri = step_record_uri(config.run_uri, split, step)
    record = {
        "step": step,
        "split": split,
        "flow_run_id": flow_run_id,
        "partition": partition,
        "policy_versions": sorted(checkpoints),
        "checkpoints": {str(v): c for v, c in sorted(checkpoints.items())},
        "at": time.time(),
    }
    write_json(record, Store(uri, config.storage_options))
    return uri


def checkpoint_lineage(config, step: int) -> dict[str, Any]:
    """What the checkpoint of ``step`` continued and trained on: written into it before it is sealed."""
    store = SaveStore(Store(config.checkpoint_uri, config.storage_options))
    earlier = [s for s in store.complete_steps() if s < step]
    if earlier:
        parent = {"kind": "checkpoint", "uri": store.uri(earlier[-1]), "step": earlier[-1], "run": config.run_uri}
    else:
        parent = _read_or_none(Store(f"{lineage_root(config.run_uri)}/run.json", config.storage_options))
        parent = parent["origin"] if parent else run_origin(config)
    first = int(parent.get("step") or 0) + 1
    trained_on = []
    for trained in range(first, step + 1):
        record = _read_or_none(Store(step_record_uri(config.run_uri, "train", trained), config.storage_options))
        if record is not None:
            trained_on.append({k: record[k] for k in ("step", "flow_run_id", "partition", "policy_versions")})
    return {
        "run": config.run_uri,
        "step": step,
        "checkpoint": store.uri(step),
        "parent": parent,
        "trained_on": trained_on,
        "flow_runs": sorted({r["flow_run_id"] for r in trained_on if r["flow_run_id"]}),
    }


def record_checkpoint_lineage(config, step: int) -> None:
    lineage = checkpoint_lineage(config, step)
    write_json(lineage, Store(f"{lineage['checkpoint']}/{LINEAGE_FILE}", config.storage_options))


def record_evaluation(
    run: Store, *, step: int, checkpoint: str, flow_run_id: str | None, partition: str, metrics: Mapping[str, float],
) -> str:
    target = run.join("lineage", "evaluations", f"step={step:06d}.json")
    record = {"step": step, "checkpoint": checkpoint, "flow_run_id": flow_run_id, "partition": partition,
              "metrics": dict(metrics), "at": time.time()}
    write_json(record, target)
    return target.uri


def record_export(run: Store, *, step: int, checkpoint: str, export_uri: str, flow_run_id: str | None) -> str:
    target = run.join("lineage", "exports", f"step={step:06d}.json")
    previous = _read_or_none(target) or {"exports": []}
    exports = [e for e in previous["exports"] if e["uri"] != export_uri]
    exports.append({"uri": export_uri, "checkpoint": checkpoint, "flow_run_id": flow_run_id, "at": time.time()})
    write_json({"step": step, "exports": exports}, target)
    return target.uri


# -- read by operators -----------------------------------------------------------------------------


@dataclass
class Link:
    """One link of a chain: what it is, where it lives, and the flow runs that made it."""

    kind: str
    description: str
    uri: str | None = None
    flow_runs: list[str] = field(default_factory=list)


def lineage_chain(run: Store, step: int) -> list[Link]:
    """evaluation ← export ← checkpoint ← trajectories ← flow runs ← origin, for the checkpoint of ``step``."""
    run_uri = run.uri
    store = SaveStore(run.join("checkpoints"))
    checkpoint = store.uri(step)
    if not store.is_complete(step):
        complete = store.complete_steps()
        state = "is incomplete" if store.store(step).exists() else "does not exist"
        raise CheckpointError(
            f"The checkpoint of step {step} {state} ({checkpoint}). Complete checkpoints of this run: "
            f"{', '.join(map(str, complete)) or 'none'}."
        )
    chain: list[Link] = []
    evaluation = _read_or_none(run.join("lineage", "evaluations", f"step={step:06d}.json"))
    if evaluation is not None:
        shown = ", ".join(f"{k} {v:.3f}" for k, v in sorted(evaluation["metrics"].items()) if "/" not in k and k != "samples")
        chain.append(Link("evaluation", shown, evaluation["partition"], [evaluation["flow_run_id"]] if evaluation["flow_run_id"] else []))
    exports = _read_or_none(run.join("lineage", "exports", f"step={step:06d}.json"))
    for export in (exports or {}).get("exports", []):
        chain.append(Link("export", "HF folder", export["uri"], [export["flow_run_id"]] if export["flow_run_id"] else []))
    trained_export = SaveStore(run.join("hf"))
    if trained_export.is_complete(step):
        chain.append(Link("export", "HF folder written by the run", trained_export.uri(step)))
    lineage = _read_or_none(store.store(step).join(LINEAGE_FILE))
    if lineage is None:  # written by a trellis without lineage: say what is known
        chain.append(Link("checkpoint", f"step {step} (no lineage recorded)", checkpoint))
        return chain
    chain.append(Link("checkpoint", f"step {step}", checkpoint))
    for trained in lineage["trained_on"]:
        versions = ",".join(map(str, trained["policy_versions"]))
        flow_runs = [trained["flow_run_id"]] if trained["flow_run_id"] else []
        chain.append(Link("trajectories", f"step {trained['step']} (policy versions {versions})", trained["partition"], flow_runs))
    parent = lineage["parent"]
    same_run = parent["kind"] == "checkpoint" and parent.get("run", "").rstrip("/") == run_uri.rstrip("/")
    chain += rolled_back_branches(run, after=int(parent["step"]) if same_run else 0, before=step)
    if parent["kind"] == "checkpoint":
        what = f"step {parent['step']}" + ("" if same_run else f" of {parent.get('run')} (forked from)")
        chain.append(Link("continues", what, parent["uri"]))
    else:
        chain.append(Link("continues", "the initial model", parent["uri"]))
    return chain



def rolled_back_branches(run: Store, *, after: int, before: int) -> list[Link]:
    """The branches the stability guard cut off between two checkpoints of a chain: each rollback that went
    back to a step in [``after``, ``before``), with the steps it set aside (``engine.storage.rollbacks``)."""
    links = []
    for trip in read_trips(run):
        if trip.get("action") == "rollback" and after <= trip["to_step"] < before:
            steps = trip["discarded"]
            links.append(Link("rolled back", f"steps {steps[0]}-{steps[-1]} after step {trip['to_step']}: {', '.join(trip['rules'])} "
                              f"tripped at step {trip['step']} (rollback {trip['rollback']}; set aside)", trip["archive"]))
    return links


def trace_sample(run: Store, rollout_id: str) -> dict[str, Any]:
    """One trajectory row's lineage: its split and step, policy version, checkpoint and flow run."""
    import pyarrow.compute as pc

    from trellis.engine.storage.lake import LakeError

    run_uri = run.uri
    fs, path = run.join("trajectories").fs()
    if not fs.exists(path):
        raise LakeError(f"{run_uri} has no trajectories.")
    # One file at a time through fsspec (engine.parquet_reads): a pyarrow dataset over a Python
    # filesystem lets Arrow's threads call into the interpreter and aborted ~1 exit in 6 (apache/arrow#34314).
    rows = []
    for part in sorted(fs.glob(f"{path}/split=*/step=*/*.parquet")):
        table = read_parquet(fs, part, columns=_TRACED_COLUMNS)
        table = table.filter(pc.equal(table["rollout_id"], rollout_id))
        split, step = _PARTITION.search(part).groups()
        rows += [{"split": split, "step": int(step), **row} for row in table.to_pylist()]
    if not rows:
        raise LakeError(f"No trajectory row of {run_uri} has rollout_id {rollout_id!r}.")
    row = min(rows, key=lambda r: (r["split"] != "train", r["split"]))  # the row as trained, before any copy
    return {"split": row["split"], "step": row["step"], "policy_version": row["policy_version"], "reward": row["reward"],
            "checkpoint": row.get("checkpoint"), "flow_run_id": row.get("flow_run_id")}
