"""The deployment definitions users launch runs from are valid against a real Prefect API, and
prefect.yaml is the rendering of configs/*.yaml (the two cannot drift)."""

import asyncio
from pathlib import Path

import yaml
from prefect.client.orchestration import get_client
from prefect.flows import load_flow_from_entrypoint

from trellis.deployments.render import PREFECT_YAML, bundled_configs, render
from trellis.deployments.serve import deployment
from trellis.engine.config import TrellisConfig
from trellis.engine.config.loading import load_config

ROOT = Path(__file__).resolve().parents[1]


# What the deployments must hold, written out here rather than taken from render.py: per flow, its
# parameters beyond ``config`` and its schedule (the examples ship switched off).
FLOWS = {
    "rl_train": ([], [{"cron": "0 2 * * *", "timezone": "UTC", "active": False}]),
    "evaluate_checkpoint": ([], [{"interval": 3600, "active": False}]),
    "rescore": (["reward_function"], None),
    "replay": (["step", "changes"], None),
    "export": ([], None),
}
CONFIGS = {
    "tiny-lookup": "tiny_lookup.yaml", "tiny-reverse": "tiny_reverse.yaml", "tiny-reverse-async": "tiny_reverse_async.yaml",
    "tiny-shapes": "tiny_shapes.yaml",
}


def test_prefect_yaml_is_rendered_from_the_configs():
    assert PREFECT_YAML.read_text() == render(bundled_configs()), "run `trellis deployments render`"


def test_prefect_yaml_holds_one_deployment_of_each_flow_per_config_with_its_parameters():
    """Checked against the flows and configs themselves, not render(): each entrypoint loads as the
    flow of that name, Prefect's own validation of the flow's signature accepts the parameters, the
    config is the file's contents, rescore scores with a softer verifier for the bundled task and
    with the run's own function otherwise, and the example schedules are off. Tried in render.py:
    a nightly schedule left on (``active: true``), and rescore's default falling back to
    ``exact_match`` instead of the run's function: both fail it (the rendering check alone did not)."""
    spec = yaml.safe_load(PREFECT_YAML.read_text())
    deployments = {(d["entrypoint"].rpartition(":")[2], d["name"]): d for d in spec["deployments"]}
    assert sorted(deployments) == sorted((flow, name) for flow in FLOWS for name in CONFIGS)
    for (flow_name, name), deployment_spec in deployments.items():
        assert deployment_spec["entrypoint"] == f"flows/{flow_name}.py:{flow_name}"
        flow = load_flow_from_entrypoint(f"{ROOT}/{deployment_spec['entrypoint']}")
        assert flow.name == flow_name  # what `prefect deployment run '{flow}/{name}'` names
        parameters = deployment_spec["parameters"]
        extra, schedules = FLOWS[flow_name]
        assert sorted(parameters) == sorted(["config", *extra]), (flow_name, name)
        flow.validate_parameters(parameters)  # Prefect's check: the flow takes them, with these types
        config = yaml.safe_load((ROOT / "configs" / CONFIGS[name]).read_text())
        assert parameters["config"] == config
        TrellisConfig.model_validate(parameters["config"])  # the parameter is schema-checked
        assert deployment_spec["work_pool"] == {"name": "trellis-local", "work_queue_name": "default"}
        assert deployment_spec.get("schedules") == schedules, (flow_name, name)
        if flow_name == "rescore":
            own = load_config(ROOT / "configs" / CONFIGS[name]).reward.function
            softer = {"trellis.engine.tiny.reverse_task:score": "trellis.engine.tiny.reverse_task:partial_score"}.get(own, own)
            assert parameters["reward_function"] == softer, name
    assert deployments[("rescore", "tiny-reverse")]["parameters"]["reward_function"] == "trellis.engine.tiny.reverse_task:partial_score"


def test_a_changed_config_changes_the_rendering(tmp_path):
    changed = tmp_path / "tiny_reverse.yaml"
    changed.write_text((ROOT / "configs" / "tiny_reverse.yaml").read_text().replace("total_train_steps: 50", "total_train_steps: 60"))
    assert render([changed]) != PREFECT_YAML.read_text()
    assert yaml.safe_load(render([changed]))["deployments"][0]["parameters"]["config"]["total_train_steps"] == 60


def test_serve_entry_point_registers_a_scheduled_deployment(prefect_api):
    """On the shared test API (conftest's ``prefect_api``: 180 s for the server to come up, where a
    30 s default was seen exceeded on 2 busy cores)."""
    async def read(deployment_id):
        async with get_client() as client:
            return await client.read_deployment(deployment_id)

    deployment_id = deployment(ROOT / "configs" / "tiny_reverse.yaml", cron="0 2 * * *").apply()
    stored = asyncio.run(read(deployment_id))
    assert stored.name == "tiny-reverse"
    assert stored.parameters["config"]["experiment_name"] == "tiny_reverse"
    assert stored.schedules and stored.schedules[0].schedule.cron == "0 2 * * *"
    assert "config" in stored.parameter_openapi_schema["properties"]
