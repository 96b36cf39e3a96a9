"""MkDocs hook: the configuration reference page (configuration.md) is written from the pydantic models
at every build (``engine.config.reference``), so it cannot drift from them."""

from __future__ import annotations

from mkdocs.structure.files import File, Files

from engine.config.reference import config_reference


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "configuration.md", content=config_reference()))
    return files
