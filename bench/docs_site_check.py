"""Look at the docs site as a reader would, in a real browser (Debian's headless Chromium; no download):
build it with `mkdocs build --strict`, serve it on 127.0.0.1, screenshot the home page, the
configuration reference and the architecture page, and check that each rendered (not blank, the
expected headings in its DOM).

    apt-get install chromium
    .venv/bin/python bench/docs_site_check.py bench/results/docs_site       # PNGs + summary.json there

The diagrams are Mermaid, which the theme loads from a CDN when a page shows one. With no network,
pass `--mermaid path/to/mermaid.min.js` (e.g. from `npm pack mermaid@11`): the check then serves that
copy to the pages and also checks that the diagrams were drawn (an <svg> in their place).

Exit code 1 if a page did not render as expected.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import typer
from prefect_ui_check import chromium, not_blank

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = str(Path(sys.executable).with_name("mkdocs"))

# page, path, window, what its DOM must hold
PAGES = [
    ("home", "", "1400,1000", ["<h1", "trellis", "What is where", "Configuration reference"]),
    ("configuration", "configuration/", "1400,1800", ["Configuration reference", "Top level", "total_train_steps",
                                                      "Rules across sections", "Value types"]),
    ("architecture", "architecture/", "1400,3600", ["One step order, one plan", 'class="mermaid"']),
]


def build(site: Path) -> float:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([MKDOCS, "build", "--strict", "--site-dir", str(site)], cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(result.stdout + result.stderr)
    seconds = [line for line in result.stderr.splitlines() if "Documentation built in" in line]
    return float(seconds[-1].split("built in ")[1].split()[0]) if seconds else float("nan")


def use_local_mermaid(site: Path, mermaid: Path) -> None:
    """Serve a local Mermaid to the pages that draw diagrams: the theme uses a global ``mermaid`` when
    one is loaded, instead of fetching it."""
    shutil.copy(mermaid, site / "mermaid.min.js")
    for page in site.rglob("index.html"):
        html = page.read_text()
        if 'class="mermaid"' in html:
            page.write_text(html.replace("</head>", '<script src="/mermaid.min.js"></script></head>', 1))


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's signature)
        pass


def serve(site: Path) -> tuple[ThreadingHTTPServer, str]:
    handler = functools.partial(QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def browse(url: str, window: str, out: Path) -> str:
    """Screenshot ``url`` into ``out`` and return its rendered DOM."""
    base = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={window}",
            "--hide-scrollbars", "--virtual-time-budget=10000"]
    subprocess.run([*base, f"--screenshot={out}", url], check=True, capture_output=True, timeout=120)
    return subprocess.run([*base, "--dump-dom", url], check=True, capture_output=True, text=True, timeout=120).stdout


def main(
    out: Path = typer.Argument(..., help="Folder for the screenshots and summary.json."),
    mermaid: Path = typer.Option(None, help="A local mermaid.min.js to serve in place of the CDN's."),
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    site = Path(tempfile.mkdtemp(prefix="trellis-docs-site-"))
    checks = []
    try:
        build_s = build(site)
        if mermaid is not None:
            use_local_mermaid(site, mermaid)
        server, base = serve(site)
        for index, (name, path, window, expected) in enumerate(PAGES):
            png = out / f"{index}-{name}.png"
            dom = browse(base + path, window, png)
            absent = [text for text in expected if text not in dom]
            if mermaid is not None and name == "architecture" and "<svg" not in dom:
                absent.append("<svg (a drawn diagram)")
            checks.append({"page": name, "url": "/" + path, "screenshot": png.name, "missing": absent,
                           "ok": not absent and not_blank(png)})
        server.shutdown()
    finally:
        shutil.rmtree(site, ignore_errors=True)
    (out / "summary.json").write_text(json.dumps({"mkdocs_build_s": build_s, "pages": checks}, indent=2) + "\n")
    typer.echo(f"mkdocs build --strict: {build_s} s")
    for check in checks:
        typer.echo(f"{'ok ' if check['ok'] else 'BAD'} {check['page']}: {check['url']} -> {check['screenshot']} {check['missing'] or ''}")
    raise typer.Exit(code=0 if all(check["ok"] for check in checks) else 1)


if __name__ == "__main__":
    typer.run(main)
