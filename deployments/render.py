"""``deployments/prefect.yaml``, generated from ``configs/*.yaml`` so that the two cannot drift:
one deployment of ``rl_train`` per config, whose ``config`` parameter is that file's contents.

    trellis deployments render          # rewrite deployments/prefect.yaml
    trellis deployments render --check  # exit 1 if it is out of date (a test does the same)
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import yaml

from engine.config.loading import load_config

ROOT = Path(__file__).resolve().parents[1]
PREFECT_YAML = ROOT / "deployments" / "prefect.yaml"

HEADER = """\
# Prefect deployments of trellis, GENERATED from configs/*.yaml by `trellis deployments render`:
# edit a config, then render again (a test fails while this file and the configs disagree).
#
# From the repository root, with a Prefect server running (`prefect server start`) and a work pool
# (`prefect work-pool create trellis-local --type process`):
#
#   prefect deploy --prefect-file deployments/prefect.yaml --all
#   prefect worker start --pool trellis-local
#   prefect deployment run 'rl_train/tiny-reverse' --watch
#
# The `config` parameter is a TrellisConfig: the UI shows its schema and checks every edit. Flow
# retries come from its `cluster.flow_retries`.
name: trellis
prefect-version: 3.4.0

definitions:
  work_pools:
    local: &local_pool
      name: trellis-local
      work_queue_name: default
  schedules:
    nightly: &nightly
      cron: "0 2 * * *"
      timezone: UTC
      active: false   # an example: switch it on in the UI

deployments:
"""

DEPLOYMENT = """\
  - name: {name}
    description: {description}
    entrypoint: flows/rl_train.py:rl_train
    work_pool: *local_pool
    schedules:
      - *nightly
    parameters:
      config:
{config}"""


def deployment_name(config_path: Path) -> str:
    return config_path.stem.replace("_", "-")


def render(config_paths: list[Path]) -> str:
    """The whole prefect.yaml for these configs (each is validated first)."""
    parts = [HEADER]
    for path in sorted(config_paths):
        load_config(path)
        raw = yaml.safe_load(path.read_text())
        config = textwrap.indent(yaml.safe_dump(raw, sort_keys=False, default_flow_style=False), " " * 8)
        description = f"GRPO from {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
        parts.append(DEPLOYMENT.format(name=deployment_name(path), description=description, config=config))
    return "".join(parts)


def bundled_configs() -> list[Path]:
    return sorted((ROOT / "configs").glob("*.yaml"))
