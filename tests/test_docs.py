"""The docs site builds with `mkdocs build --strict` (a broken link or anchor, or a nav entry without its
page, fails it), and its configuration reference, written from the models at build time, documents
every key of TrellisConfig, however deeply nested."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from trellis.engine.config import TrellisConfig
from trellis.engine.config.reference import _models_in, config_reference

ROOT = Path(__file__).resolve().parents[1]


def documented_keys(page: str) -> set[str]:
    """Every dotted key the page's tables document: a section heading names the keys its model sits at
    (``tasks[].train_dataset``), each table row one field of it."""
    keys, prefixes = set(), []
    for line in page.splitlines():
        if line.startswith("## "):
            prefixes = [""] if line.startswith("## Top level") else [f"{key}." for key in re.findall(r"`([^`]+)`", line)]
        elif (row := re.match(r"\| `([a-z0-9_]+)` \|", line)) and prefixes:
            keys.update(prefix + row.group(1) for prefix in prefixes)
    return keys


def every_key(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Walked here, apart from the generator, so that a key the generator misses is caught."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        for nested, suffix in _models_in(field.annotation):
            keys += every_key(nested, f"{prefix}{name}{suffix}.")
    return keys


def test_the_config_reference_documents_every_key_with_its_rules():
    page = config_reference()
    missing = sorted(set(every_key(TrellisConfig)) - documented_keys(page))
    assert missing == []
    assert "| `total_train_steps` |" in page and "| `load_from` | [path or URI](#location) | **required** |" in page
    # every cross-field rule appears with its messages, placeholders as written
    assert "must be a multiple of sync_weights_interval={sync}" in page
    assert "Either total_train_steps or total_epochs must be set." in page
    # a section's own checks, and those of the helpers it calls
    assert "train_worker.layout: shared_prefix needs the prompts' KV cache" in page
    assert "trellis ships the run's code itself" in page


def test_the_site_builds_strict_with_the_generated_reference(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        pytest.skip("mkdocs is in the dev extra: make setup installs it")
    site = tmp_path / "site"
    result = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(site)], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    reference = (site / "configuration" / "index.html").read_text()
    assert "total_train_steps" in reference and "replay_buffer" in reference
    assert (site / "architecture" / "index.html").read_text().count('class="mermaid"') >= 2  # the step DAGs
    assert "Measured figures" in (site / "benchmarks" / "index.html").read_text()  # bench/RESULTS.md, included


def test_the_readme_stays_a_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "make run" in readme and "make test" in readme
    for link in re.findall(r"\]\(((?:docs|bench|examples)/[^)#]+)", readme):
        assert (ROOT / link).exists(), link
