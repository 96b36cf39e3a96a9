"""``deployments/prefect.yaml``, generated from ``configs/*.yaml`` so that the two cannot drift:
one deployment of ``rl_train`` per config, whose ``config`` parameter is that file's contents.

    trellis deployments render          # rewrite deployments/prefect.yaml
    trellis deployments render --check  # exit 1 if it is out of date (a test does the same)
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import yaml

from trellis.engine.config.loading import load_config

ROOT = Path(__file__).resolve().parents[1]
PREFECT_YAML = ROOT / "deployments" / "prefect.yaml"

HEADER = """\
# Prefect deployments of trellis, GENERATED from configs/*.yaml by `trellis deployments render`:
# edit a config, then render again (a test fails while this file and the configs disagree).
# Four per config: rl_train (train), evaluate_checkpoint, rescore and export (the run's results).
#
# `trellis server up` starts a Prefect server, a `process` work pool with its worker, and deploys
# this file from the repository root; then:
#
#   prefect deployment run 'rl_train/tiny-reverse' --watch
#   prefect deployment run 'evaluate_checkpoint/tiny-reverse' -p checkpoint=10
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
    hourly: &hourly
      interval: 3600
      active: false   # an example: evaluate whatever the run saved last, every hour

deployments:
"""

DEPLOYMENTS = """\
  - name: {name}
    description: GRPO from {source}
    entrypoint: flows/rl_train.py:rl_train
    work_pool: *local_pool
    schedules:
      - *nightly
    parameters:
      config: &{name}
{config}\
  - name: {name}
    description: Evaluate the latest complete checkpoint (or a given one) of the run of {source}
    entrypoint: flows/evaluate_checkpoint.py:evaluate_checkpoint
    work_pool: *local_pool
    schedules:
      - *hourly
    parameters:
      config: *{name}
  - name: {name}
    description: Score the stored trajectories of the run of {source} again with another reward function
    entrypoint: flows/rescore.py:rescore
    work_pool: *local_pool
    parameters:
      config: *{name}
      reward_function: {rescore_with}
  - name: {name}
    description: Apply a stored step of the run of {source} again with changed settings, and compare the two updates
    entrypoint: flows/replay.py:replay
    work_pool: *local_pool
    parameters:
      config: *{name}
      step: 1
      changes: ["loss.clip_eps_high=0.28"]
  - name: {name}
    description: Export a checkpoint of the run of {source} as an HF folder
    entrypoint: flows/export.py:export
    work_pool: *local_pool
    parameters:
      config: *{name}
"""

# What the example rescore deployment scores with: a softer verifier for the bundled task, else the
# run's own function (edit it in the UI).
RESCORE_WITH = {"trellis.engine.tiny.reverse_task:score": "trellis.engine.tiny.reverse_task:partial_score"}


def deployment_name(config_path: Path) -> str:
    return config_path.stem.replace("_", "-")


def render(config_paths: list[Path]) -> str:
    """The whole prefect.yaml for these configs (each is validated first)."""
    parts = [HEADER]
    for path in sorted(config_paths):
        reward = load_config(path).reward.function
        raw = yaml.safe_load(path.read_text())
        config = textwrap.indent(yaml.safe_dump(raw, sort_keys=False, default_flow_style=False), " " * 8)
        source = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        parts.append(
            DEPLOYMENTS.format(name=deployment_name(path), source=source, config=config, rescore_with=RESCORE_WITH.get(reward, reward))
        )
    return "".join(parts)


def bundled_configs() -> list[Path]:
    return sorted((ROOT / "configs").glob("*.yaml"))
