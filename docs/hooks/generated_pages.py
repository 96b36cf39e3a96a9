"""MkDocs hook: the pages written at build time, so that they cannot drift from their sources.

- configuration.md, from the pydantic models (``engine.config.reference``);
- the measured figures of benchmarks.md, from ``bench/RESULTS.md``, its headings one level down so
  that they sit under the page's own title (and in its table of contents).
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

from trellis.engine.config.reference import config_reference

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "RESULTS.md"
RESULTS_MARKER = "<!-- bench/RESULTS.md -->"


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "configuration.md", content=config_reference()))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if RESULTS_MARKER not in markdown:
        return markdown
    results = "\n".join("#" + line if line.startswith("#") else line for line in RESULTS.read_text().splitlines())
    return markdown.replace(RESULTS_MARKER, results)
