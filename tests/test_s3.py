"""The whole flow with its storage on ``s3://``, against moto's S3 server started on loopback:
trajectories, checkpoints, HF exports and logs land there, a resume reads them back, and the
credentials never appear in anything trellis writes or reports."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path

import fsspec
import pytest
from prefect.client.orchestration import get_client
from transformers import AutoModelForCausalLM, AutoTokenizer

from trellis.engine.storage.checkpoints import SaveStore
from trellis.engine.storage.store import Store
from trellis.flows.rl_train import rl_train
from helpers import lake_rows, logged_metrics, moto_s3_server, tiny_config

BUCKET = "trellis-test"


@pytest.fixture(scope="module")
def s3_endpoint():
    with moto_s3_server() as endpoint:
        yield endpoint


def test_a_run_on_s3_stores_everything_there_resumes_from_it_and_leaks_no_secret(
    tiny_model, reverse_data, tmp_path, ray_cluster, prefect_api, s3_endpoint, monkeypatch
):
    key, secret, token = (f"{what}-{secrets.token_hex(8)}" for what in ("AKIATRELLIS", "s3secret", "hf-token"))
    monkeypatch.setenv("TRELLIS_TEST_API_TOKEN", token)
    storage = {"key": key, "secret": secret, "endpoint_url": s3_endpoint}
    s3 = fsspec.filesystem("s3", **storage)
    s3.mkdir(BUCKET)
    config = tiny_config(
        tiny_model, reverse_data, f"s3://{BUCKET}/runs", experiment_name="on_s3", storage_options=storage,
        total_train_steps=2, hf_interval=2, exp_tracker="tensorboard", cluster={"address": ray_cluster["address"]},
    )
    rl_train(config)
    assert SaveStore(Store(config.checkpoint_uri, storage)).complete_steps() == [2]

    longer = config.model_copy(update={"total_train_steps": 3, "auto_resume": True})
    rl_train(longer)  # new workers; everything they start from is read back from S3

    assert SaveStore(Store(config.checkpoint_uri, storage)).complete_steps() == [2, 3]
    assert SaveStore(Store(config.hf_uri, storage)).complete_steps() == [2, 3]
    rows = lake_rows(config)
    assert sorted({r["train_step"] for r in rows}) == [1, 2, 3] and len(rows) == 3 * 128
    assert [r["policy_version"] for r in rows if r["train_step"] == 3][0] == 2  # the restored weights sampled step 3
    assert sorted(logged_metrics(config)) == [0, 1, 2, 3]

    export = tmp_path / "hf"
    s3.get(f"{BUCKET}/runs/on_s3/hf/step-000003/", str(export), recursive=True)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(export), AutoTokenizer.from_pretrained(export)
    prompt = tokenizer("reverse abc", return_tensors="pt")
    assert model.generate(**prompt, max_new_tokens=3, do_sample=False).shape[1] == prompt["input_ids"].shape[1] + 3

    env = json.loads(s3.cat(f"{BUCKET}/runs/on_s3/logs/env.json"))
    assert env["environment"]["TRELLIS_TEST_API_TOKEN"] == "**********"
    assert "torch" in env["versions"]
    _assert_nowhere([key, secret, token], s3, f"{BUCKET}/runs/on_s3")
    assert '"**********"' in asyncio.run(_prefect_records())  # the config parameters were stored, secrets masked


def test_credentials_in_the_launching_shell_follow_the_run_to_a_cluster_started_without_them(
    tiny_model, reverse_data, ray_cluster, prefect_api, s3_endpoint, monkeypatch
):
    """The Ray head was started (by the session fixture) before these variables existed, so its
    workers cannot see them; the config names only the endpoint. The run still writes its lake and
    checkpoints to the bucket, and the secret is nowhere in the bucket, Prefect's records or Ray's logs."""
    key, secret = f"AKIASHELL{secrets.token_hex(6)}", f"shell-secret-{secrets.token_hex(12)}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    storage = {"endpoint_url": s3_endpoint}
    s3 = fsspec.filesystem("s3", **storage)
    s3.mkdir("shell-creds")
    config = tiny_config(
        tiny_model, reverse_data, "s3://shell-creds/runs", experiment_name="shell_creds", storage_options=storage,
        total_train_steps=2, enable_initial_evaluate=False, cluster={"address": ray_cluster["address"]},
    )
    rl_train(config)
    assert SaveStore(Store(config.checkpoint_uri, storage)).complete_steps() == [2]
    assert len(lake_rows(config)) == 2 * 128
    _assert_nowhere([key, secret], s3, "shell-creds/runs/shell_creds")


async def _prefect_records() -> str:
    async with get_client() as client:
        runs = await client.read_flow_runs()
        artifacts = await client.read_artifacts()
        logs = await client.read_logs()
    return json.dumps(
        [[r.name, r.parameters] for r in runs] + [[a.key, a.data] for a in artifacts] + [entry.message for entry in logs],
        default=str,
    )


def _assert_nowhere(values: list[str], s3, prefix: str) -> None:
    """No secret in any object the run stored, in Prefect's records of it, or in the Ray logs."""
    for path in s3.find(prefix):
        body = s3.cat(path)
        for value in values:
            assert value.encode() not in body, f"a secret is in s3://{path}"
    assert s3.find(prefix), "the run stored nothing"

    reported = asyncio.run(_prefect_records())
    assert "flow-run" in reported or "rl_run" in reported  # the runs' records were read
    for value in values:
        assert value not in reported

    ray_logs = Path("/tmp/ray/session_latest/logs")
    for log in ray_logs.rglob("*") if ray_logs.exists() else []:
        if log.is_file():
            text = log.read_bytes()
            for value in values:
                assert value.encode() not in text, f"a secret is in {log}"
