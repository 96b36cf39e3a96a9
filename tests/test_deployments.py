"""The deployment definitions users launch runs from are valid against a real Prefect API."""

import asyncio
from pathlib import Path

import yaml
from prefect.client.orchestration import get_client
from prefect.testing.utilities import prefect_test_harness

from deployments.serve import deployment
from engine.config import TrellisConfig

ROOT = Path(__file__).resolve().parents[1]


def test_prefect_yaml_declares_the_training_deployment_with_a_valid_config():
    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    assert "definitions" in spec
    (train,) = spec["deployments"]
    module, _, flow_name = train["entrypoint"].partition(":")
    assert (ROOT / module).exists() and flow_name == "rl_train"
    TrellisConfig.model_validate(train["parameters"]["config"])  # the parameter is schema-checked
    assert train["schedules"][0]["cron"] == "0 2 * * *"


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
