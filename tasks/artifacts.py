"""Prefect artifact keys: one key per run and kind, so the UI shows each artifact's history."""

from __future__ import annotations

import re

from engine.config import TrellisConfig


def artifact_key(config: TrellisConfig, what: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", f"{config.experiment_name}-{what}".lower()).strip("-")
