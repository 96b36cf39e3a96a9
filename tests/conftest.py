"""Shared fixtures: the tiny model is built once per session, offline, exactly as users build it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.tiny.model import build_tiny_checkpoint
from engine.tiny.reverse_task import EVAL_SEED_OFFSET, write_dataset



@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def reverse_data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    return {
        "train": write_dataset(root / "train.parquet", 4096, seed=0),
        "eval": write_dataset(root / "eval.parquet", 512, seed=EVAL_SEED_OFFSET),
    }


@pytest.fixture(autouse=True)
def _quiet_logs(caplog):
    caplog.set_level(logging.WARNING)
