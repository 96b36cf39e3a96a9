"""The deployment definitions users launch runs from are valid against a real Prefect API, and
prefect.yaml is the rendering of configs/*.yaml (the two cannot drift)."""

import asyncio
from pathlib import Path

import yaml
from prefect.client.orchestration import get_client
from prefect.testing.utilities import prefect_test_harness

from deployments.render import PREFECT_YAML, bundled_configs, render
from deployments.serve import deployment
from engine.config import TrellisConfig

ROOT = Path(__file__).resolve().parents[1]


def test_prefect_yaml_is_rendered_from_the_configs():
    assert PREFECT_YAML.read_text() == render(bundled_configs()), "run `trellis deployments render`"
    spec = yaml.safe_load(PREFECT_YAML.read_text())
    deployments = {(d["entrypoint"].rpartition(":")[2], d["name"]): d for d in spec["deployments"]}
    names = ["tiny-lookup", "tiny-reverse", "tiny-reverse-async"]  # one of each flow per file of configs/
    flows = ["evaluate_checkpoint", "export", "rescore", "rl_train"]
    assert sorted(deployments) == [(flow, name) for flow in flows for name in names]
    for (flow_name, name), deployment_spec in deployments.items():
        module = deployment_spec["entrypoint"].partition(":")[0]
        assert (ROOT / module).exists() and module == f"flows/{flow_name}.py"
        config_file = ROOT / "configs" / f"{name.replace('-', '_')}.yaml"
        assert deployment_spec["parameters"]["config"] == yaml.safe_load(config_file.read_text())
        TrellisConfig.model_validate(deployment_spec["parameters"]["config"])  # the parameter is schema-checked
        assert deployment_spec["work_pool"]["name"] == "trellis-local"
        if flow_name == "rl_train":
            assert deployment_spec["schedules"][0]["cron"] == "0 2 * * *"
        if flow_name == "evaluate_checkpoint":
            assert deployment_spec["schedules"][0]["interval"] == 3600
    assert deployments[("rescore", "tiny-reverse")]["parameters"]["reward_function"] == "engine.tiny.reverse_task:partial_score"


def test_a_changed_config_changes_the_rendering(tmp_path):
    changed = tmp_path / "tiny_reverse.yaml"
    changed.write_text((ROOT / "configs" / "tiny_reverse.yaml").read_text().replace("total_train_steps: 50", "total_train_steps: 60"))
    assert render([changed]) != PREFECT_YAML.read_text()
    assert yaml.safe_load(render([changed]))["deployments"][0]["parameters"]["config"]["total_train_steps"] == 60


def test_serve_entry_point_registers_a_scheduled_deployment():
    async def read(deployment_id):
        async with get_client() as client:
            return await client.read_deployment(deployment_id)

    with prefect_test_harness():
        deployment_id = deployment(ROOT / "configs" / "tiny_reverse.yaml", cron="0 2 * * *").apply()
        stored = asyncio.run(read(deployment_id))
    assert stored.name == "tiny-reverse"
    assert stored.parameters["config"]["experiment_name"] == "tiny_reverse"
    assert stored.schedules and stored.schedules[0].schedule.cron == "0 2 * * *"
    assert "config" in stored.parameter_openapi_schema["properties"]
