"""Export a stored policy (a run's checkpoint, or an HF folder) as an HF folder at any fsspec URI:
``save_pretrained`` model and tokenizer, plus ``lineage.json`` saying what it was made from."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from trellis.engine.config import TrellisConfig
from trellis.engine.run.checkpoint_source import PolicySource, load_policy, resolve_source
from trellis.engine.storage.checkpoints import staging_folder
from trellis.engine.storage.store import Store
from trellis.engine.storage.lineage import record_export


def default_export_uri(config: TrellisConfig, source: PolicySource) -> str:
    return f"{config.run_uri}/exports/step-{source.step:06d}"


def export_checkpoint(
    config: TrellisConfig, checkpoint: str | None = None, out_uri: str | None = None, flow_run_id: str | None = None
) -> tuple[PolicySource, str]:
    source = resolve_source(config, checkpoint)
    out = (out_uri or default_export_uri(config, source)).rstrip("/")
    model = load_policy(config, source)
    with staging_folder(Store(out, config.storage_options)) as folder:
        model.save_pretrained(folder, safe_serialization=True)
        AutoTokenizer.from_pretrained(config.tokenizer_source).save_pretrained(folder)
        with open(f"{folder}/lineage.json", "w") as handle:
            json.dump({"run": config.run_uri, "step": source.step, "source": source.uri, "flow_run_id": flow_run_id}, handle, indent=2)
    record_export(Store(config.run_uri, config.storage_options), step=source.step, checkpoint=source.uri, export_uri=out, flow_run_id=flow_run_id)
    return source, out
