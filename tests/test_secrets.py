"""Credentials stay out of env.json, logs and serialized configs (the flow-level check, against
Prefect's records and an S3 run, is in test_s3.py)."""

from __future__ import annotations

import json
import logging

import pytest

from trellis.engine.config import TrellisConfig
from trellis.engine.config.loading import ConfigError, load_config
from trellis.engine.secrets import (
    REDACTED,
    install_log_redaction,
    redact,
    redact_mapping,
    scoped_log_redaction,
    write_runtime_environment,
)

SECRETS = {
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI-K7MDENG-bPxRfiCY",
    "HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz",
    "WANDB_API_KEY": "0123456789abcdef0123",
    "DB_PASSWORD": "hunter2-but-longer",
    "OPENAI_CREDENTIALS": "sk-proj-abcdef123456",
}


@pytest.fixture(autouse=True)
def _redaction_left_as_found():
    """The tests here install log redaction, which is process-wide: later tests must not inherit it."""
    with scoped_log_redaction():
        yield


def test_env_json_masks_every_credential_and_keeps_the_rest(tmp_path, monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DATABASE_URL", "postgresql://trellis:pa55word-xyz@db.internal:5432/runs")
    monkeypatch.setenv("TRELLIS_PLAIN_SETTING", "visible-value")
    uri = write_runtime_environment(str(tmp_path / "run"), {})
    text = (tmp_path / "run" / "logs" / "env.json").read_text()
    assert uri.endswith("logs/env.json")
    for value in [*SECRETS.values(), "pa55word-xyz"]:
        assert value not in text
    environment = json.loads(text)["environment"]
    assert all(environment[name] == REDACTED for name in SECRETS)
    assert environment["DATABASE_URL"] == f"postgresql://trellis:{REDACTED}@db.internal:5432/runs"
    assert environment["TRELLIS_PLAIN_SETTING"] == "visible-value"


def test_a_runs_recorded_config_keeps_its_settings_and_masks_its_secrets(tmp_path):
    """logs/config.json (what `trellis replay` rebuilds a run from): storage options left out, a URL's
    password masked, settings named like secrets (prompt_key, max_new_tokens) and a worker's plain
    env_vars kept as they are, and the file loads back as the same config. (A secret in env_vars is
    refused by the config itself.)"""
    from trellis.engine.config.loading import config_from_mapping
    from trellis.engine.run.plan import record_run_config

    config = load_config(
        "configs/tiny_reverse.yaml", work_dir=str(tmp_path), storage_options={"key": "AKIA-storage-123", "secret": "storage-secret-456"},
        cluster={"runtime_env": {"env_vars": {"LOG_LEVEL": "debug"}}},
        tokenizer_path="https://user:url-pass-321@models.example/tok",
    )
    record_run_config(config)
    text = (tmp_path / "tiny_reverse" / "logs" / "config.json").read_text()
    for secret in ("AKIA-storage-123", "storage-secret-456", "url-pass-321"):
        assert secret not in text
    recorded = json.loads(text)
    assert "storage_options" not in recorded and recorded["cluster"]["runtime_env"]["env_vars"] == {"LOG_LEVEL": "debug"}
    assert recorded["train_dataset"]["prompt_key"] == config.train_dataset.prompt_key
    assert recorded["rollout"]["max_new_tokens"] == config.rollout.max_new_tokens
    assert recorded["tokenizer_path"] == f"https://user:{REDACTED}@models.example/tok"
    reloaded = config_from_mapping({**recorded, "tokenizer_path": config.tokenizer_path}, storage_options=config.storage_options)
    assert reloaded == config


def test_log_records_are_scrubbed_whoever_logs_them(monkeypatch, caplog):
    monkeypatch.setenv("TRELLIS_TEST_SECRET_TOKEN", "tok-0f9e8d7c6b5a")
    install_log_redaction({"secret": "from-storage-options-42"})
    caplog.set_level(logging.INFO)
    logging.getLogger("some.library").info("connecting with %s and %s", "tok-0f9e8d7c6b5a", "from-storage-options-42")
    logging.getLogger("ray.worker").warning("url https://user:hunter22@example.com/x")
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0] == f"connecting with {REDACTED} and {REDACTED}"
    assert "hunter22" not in messages[1]


def test_a_config_never_serializes_its_storage_credentials():
    options = {"key": "AKIA-EXAMPLE-1234", "secret": "s3cr3t-example-5678", "endpoint_url": "http://127.0.0.1:9000"}
    config = TrellisConfig(load_from="m", train_dataset={"path": "d", "storage_options": options}, reward={"function": "r:score"},
                           total_train_steps=1, storage_options=options)
    assert config.storage_options["secret"] == "s3cr3t-example-5678"  # the run itself uses the real value
    dumped = config.model_dump_json()
    for value in ("AKIA-EXAMPLE-1234", "s3cr3t-example-5678"):
        assert value not in dumped and value not in repr(config)
    assert json.loads(dumped)["storage_options"]["endpoint_url"] == "http://127.0.0.1:9000"
    assert redact_mapping({"nested": {"api_key": "x" * 10}}) == {"nested": {"api_key": REDACTED}}


def test_a_masked_config_coming_back_is_refused_with_a_clear_error(tmp_path):
    """A deployment parameter copied from the Prefect UI carries the mask, not the secret."""
    config_file = tmp_path / "run.yaml"
    config_file.write_text("load_from: m\ntrain_dataset: {path: d}\ntotal_train_steps: 1\nstorage_options: {secret: '**********'}\n")
    with pytest.raises(ConfigError, match="AWS_SECRET_ACCESS_KEY"):
        load_config(config_file)


def leaks_its_input(sample):
    raise PermissionError(f"storage refused key {sample['label']}")


def test_tracebacks_and_reward_errors_are_scrubbed_too():
    """Tried: logger.exception on an error whose message holds a credential (as a storage client's
    can), and a reward function that raises with one. Neither the formatted traceback nor the error
    stored with the sample carries it."""
    import io

    from trellis.engine.config import RewardConfig
    from trellis.engine.rollout.rewards.runner import RewardRunner

    secret = "AKIA-LEAKY-0123456789"
    install_log_redaction({"aws_secret_access_key": secret})
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log = logging.getLogger("trellis.test.traceback")
    log.addHandler(handler)
    try:
        try:
            raise OSError(f"403 for credentials {secret}")
        except OSError:
            log.exception("upload failed with %s", secret)
    finally:
        log.removeHandler(handler)
    written = stream.getvalue()
    assert "Traceback" in written and "OSError: 403 for credentials" in written
    assert secret not in written and REDACTED in written

    sample = {"response": "r", "label": secret, "prompt": [], "data_source": "d", "task_name": "t"}
    with RewardRunner(RewardConfig(function=f"{__name__}:leaks_its_input")) as runner:
        (result,) = runner.score([sample])
    assert result.error == f"reward function raised PermissionError: storage refused key {REDACTED}"


def test_scoped_redaction_leaves_logging_as_it_found_it(caplog):
    """Tried: redaction installed inside the scope, then a record made after it. Inside, the value is
    masked; after, the record factory is the one from before and the value is no longer known."""
    caplog.set_level(logging.INFO)
    factory = logging.getLogRecordFactory()
    with scoped_log_redaction():
        install_log_redaction({"secret": "scoped-value-7788"})
        logging.getLogger("trellis.test.scope").info("inside %s", "scoped-value-7788")
        assert redact("scoped-value-7788") == REDACTED
    logging.getLogger("trellis.test.scope").info("after %s", "scoped-value-7788")
    assert [record.getMessage() for record in caplog.records] == [f"inside {REDACTED}", "after scoped-value-7788"]
    assert logging.getLogRecordFactory() is factory and redact("scoped-value-7788") == "scoped-value-7788"
