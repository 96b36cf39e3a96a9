"""Every validation rule of the config, each with the message a user sees."""

import re

import pytest
from pydantic import ValidationError

from trellis.engine.config.loading import ConfigError, load_config

BASE = {"load_from": "/models/tiny", "train_dataset": {"path": "train.parquet"}, "reward": {"function": "myreward:score"},
        "total_train_steps": 10}


def check(message: str, **changes):
    with pytest.raises(ConfigError) as error:
        load_config(None, **{**BASE, **changes})
    assert message in str(error.value), str(error.value)


def test_a_minimal_config_is_valid_and_frozen():
    config = load_config(None, **BASE)
    assert config.train_batch_size == 16 and config.prompt_repeat_k == 8
    assert config.tokenizer_source == "/models/tiny"
    with pytest.raises(ValidationError, match="frozen"):
        config.seed = 1  # configs are frozen: derived values live in run state


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"debug_rollout": True, "debug_train": True, "debug_rollout_dir": "d"}, "cannot both be enabled"),
        ({"debug_rollout": True}, "debug_rollout_dir must be set when debug_rollout=true"),
        ({"debug_train": True}, "debug_rollout_dir must be set when debug_train=true"),
        ({"total_train_steps": None}, "Either total_train_steps or total_epochs must be set"),
        ({"total_train_steps": 0}, "total_train_steps must be positive, got 0"),
        ({"total_train_steps": None, "total_epochs": -1}, "total_epochs must be positive, got -1"),
        ({"sync_weights_interval": 0}, "sync_weights_interval must be positive, got 0"),
        ({"checkpoint_interval": -5}, "checkpoint_interval must be positive, or -1 / null to disable it; got -5"),
        ({"hf_interval": 0}, "hf_interval must be positive"),
        ({"sync_weights_interval": 2, "checkpoint_interval": 3}, "checkpoint_interval=3 must be a multiple of sync_weights_interval=2"),
        ({"sync_weights_interval": 2, "hf_interval": 5}, "hf_interval=5 must be a multiple of sync_weights_interval=2"),
        ({"enable_evaluate": True, "eval_dataset": {"path": "e"}, "evaluate_step": 0}, "evaluate_step must be positive"),
        (
            {"enable_evaluate": True, "eval_dataset": {"path": "e"}, "sync_weights_interval": 2, "evaluate_step": 3},
            "evaluate_step=3 must be a multiple of sync_weights_interval=2",
        ),
        ({"checkpoint_maxkeep": 0}, "checkpoint_maxkeep must be positive, or -1 / null to keep all; got 0"),
        ({"enable_evaluate": True}, "eval_dataset is not set"),
        ({"loss": {"clip_eps_low": 0.3, "clip_eps_high": 0.2}}, "clip-higher only widens the upper bound"),
        ({"prompt_repeat_k": 1}, "prompt_repeat_k must be at least 2"),
        ({"advantage": {"estimator": "pass_at_k", "pass_at_k": 16}}, "advantage.pass_at_k=16 exceeds prompt_repeat_k=8"),
        ({"train_batch_size": 1, "prompt_repeat_k": 2, "train_worker": {"optimizer_steps": 4}}, "exceeds the 2 samples"),
        ({"train_worker": {"pack_max_length": 64}}, "pack_max_length=64 cannot hold a sample"),
        ({"rollout": {"temperature": -1}}, "rollout.temperature: Input should be greater than or equal to 0"),
        ({"experiment_name": "a b"}, "experiment_name: String should match pattern"),
        (
            {"train_worker": {"layout": "shared_prefix", "gradient_checkpointing": True}},
            "shared_prefix needs the prompts' KV cache, which gradient checkpointing drops",
        ),
        ({"rollout": {"backend": "vllm"}, "check_weights_interval": 1}, "check_weights_interval needs a rollout backend that exports"),
        ({"cluster": {"weight_sync": "nccl"}}, "cluster.weight_sync: Input should be 'auto', 'broadcast' or 'object_store'"),
        ({"train_worker": {"layout": "unpadded"}}, "train_worker.layout: Input should be 'auto', 'packed', 'padded' or 'shared_prefix'"),
        ({"train_worker": {"logprob_chunk_tokens": 0}}, "train_worker.logprob_chunk_tokens: Input should be greater than 0"),
        ({"train_worker": {"attention_kernel": "fa3"}}, "train_worker.attention_kernel: Input should be 'torch' or 'fa4'"),
        ({"train_worker": {"attention_kernel": "fa4", "layout": "padded"}}, "train_worker.attention_kernel: fa4 runs packed rows; layout is padded"),
        (
            {"train_worker": {"cuda_graphs": True, "compile": False, "layout": "padded", "fsdp": True}},
            "train_worker.cuda_graphs: compile is off (the graphs are compiled code); layout is padded (rows of one "
            "shape need packed); fsdp is on.",
        ),
    ],
)
def test_rule(changes, message):
    check(message, **changes)


def test_unknown_key_names_the_closest_valid_one():
    check("train_batch_sise: unknown key; did you mean 'train_batch_size'?", train_batch_sise=4)
    check("rollout.temprature: unknown key; did you mean 'temperature'?", rollout={"temprature": 0.5})


def test_a_renamed_key_names_its_replacement():
    check("train_worker.share_prompt_prefix: renamed; use train_worker.layout", train_worker={"share_prompt_prefix": True})


def test_missing_required_keys_are_listed_together():
    with pytest.raises(ConfigError) as error:
        load_config(None, total_train_steps=3)
    assert "load_from: required" in str(error.value) and "train_dataset: required" in str(error.value)
    assert "reward.function: required, but not set; name the function that scores a sample" in str(error.value)


def test_a_run_names_its_reward_function_there_is_no_default_task():
    """The bundled demo task is named by the configs that use it (configs/tiny_*.yaml), never taken by default."""
    base = {key: value for key, value in BASE.items() if key != "reward"}
    message = "reward.function: required, but not set; name the function that scores a sample, e.g. myreward:score"
    for missing in ({}, {"reward": {"timeout_s": 5}}):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, **base, **missing)
    task = {"name": "a", "train_dataset": {"path": "a.parquet"}}
    with pytest.raises(ConfigError, match=re.escape("tasks[a] has no reward and reward.function is not set")):
        load_config(None, **{**base, "train_dataset": None}, tasks=[task])
    with pytest.raises(ConfigError, match=re.escape("tasks[a].reward.function: required, but not set")):
        load_config(None, **{**base, "train_dataset": None}, tasks=[{**task, "reward": {"timeout_s": 5}}], reward={"function": "r:score"})
    own = load_config(None, **{**base, "train_dataset": None}, tasks=[{**task, "reward": {"function": "mine:score"}}])
    assert [reward.function for reward in own.rewards] == ["mine:score"]


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("load_from: /m\ntrain_dataset: {path: t.parquet}\nreward: {function: r:score}\ntotal_train_steps: 5\nrollout: {temperature: 0.9}\n")
    config = load_config(path, ["rollout.top_k=20", "seed=7"])
    assert (config.rollout.temperature, config.rollout.top_k, config.seed) == (0.9, 20, 7)


def test_bad_files_and_overrides_say_what_is_wrong(tmp_path):
    with pytest.raises(ConfigError, match="Config file not found"):
        load_config(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="must look like key=value"):
        load_config(None, ["seed"], **BASE)


@pytest.mark.parametrize("setting, on_gpu, on_cpu", [(None, True, False), (True, True, True), (False, False, False)])
def test_the_next_rollout_overlaps_the_records_by_default_only_when_it_generates_on_a_gpu(setting, on_gpu, on_cpu):
    cluster = load_config(None, **BASE, cluster={"overlap_next_rollout": setting}).cluster
    assert (cluster.overlaps_next_rollout(rollout_on_gpu=True), cluster.overlaps_next_rollout(rollout_on_gpu=False)) == (on_gpu, on_cpu)


def test_an_unknown_key_does_not_hide_the_other_problems():
    """Tried: a misspelt key, a checkpoint interval that is not a multiple of the sync interval and an
    evaluation without an eval_dataset, in one config. pydantic stops at the unknown key before the
    cross-field rules run; all three are reported, one line each."""
    with pytest.raises(ConfigError) as error:
        load_config(None, **{**BASE, "train_batch_sise": 4, "sync_weights_interval": 2, "checkpoint_interval": 3, "evaluate_step": 2,
                             "enable_evaluate": True})
    message = str(error.value)
    assert message.startswith("Invalid configuration (3 problem(s)):")
    assert "  - train_batch_sise: unknown key; did you mean 'train_batch_size'?" in message
    assert "  - config: checkpoint_interval=3 must be a multiple of sync_weights_interval=2" in message
    assert "  - config: Evaluation is enabled but eval_dataset is not set" in message


def test_replay_buffer_settings_belong_to_the_disaggregated_trainer_or_colocated_over_sampling():
    """Tried: buffer keys on a plain colocated run; over-sampling on the disaggregated trainer; over-sampling
    with a debug mode. A colocated run that over-samples takes the buffer's keys."""
    check("checkpoint_no_save_replay_buffer is set, but this run has no replay buffer", checkpoint_no_save_replay_buffer=True)
    check("replay_buffer is set, but only trainer: disaggregated, or a colocated run with", replay_buffer={"max_staleness": 1})
    check("over_sample_threshold is for trainer: colocated", trainer="disaggregated", replay_buffer={"over_sample_threshold": 0.5})
    check("replay_buffer.over_sample_threshold runs no debug mode", debug_rollout=True,
          replay_buffer={"over_sample_threshold": 0.5})
    over = load_config(None, **BASE, replay_buffer={"over_sample_threshold": 0.5, "max_staleness": 1, "enable_partial_rollout": True,
                                                   "tail_batch_trigger_size": 2}, checkpoint_no_save_replay_buffer=True)
    assert over.over_samples and over.keeps_replay_buffer and over.stale_after == 2
    check("needs replay_buffer.enable_partial_rollout", trainer="disaggregated",
          replay_buffer={"mask_offpolicy_in_partial_rollout": True})
    config = load_config(None, **BASE, trainer="disaggregated", replay_buffer={"max_staleness": 1}, sync_weights_interval=2)
    assert config.stale_after == 4


def test_several_workers_per_side_are_checked_before_anything_starts():
    """Tried as a new user would: more trainer ranks than a mini-batch has samples, CUDA graphs on
    several ranks, unequal sides colocated on GPUs, a GPU share per worker on a colocated run, and an
    HSDP shard size that does not divide the ranks."""
    check("train_resources.num_workers=9 exceeds the 8 samples of a mini-batch", train_batch_size=2, prompt_repeat_k=4,
          train_resources={"num_workers": 9})
    check("must be equal", train_resources={"num_workers": 2}, rollout={"backend": "vllm"})
    check("a colocated worker shares one GPU", rollout_resources={"accelerators_per_worker": 2})
    check("hsdp_shard_size=2 must divide train_resources.num_workers=3", train_resources={"num_workers": 3},
          train_worker={"hsdp_shard_size": 2})
    config = load_config(None, **{**BASE, "train_batch_size": 2, "prompt_repeat_k": 4},
                         train_resources={"num_workers": 3}, rollout_resources={"num_workers": 2})
    assert (config.train_resources.num_workers, config.rollout_resources.num_workers) == (3, 2)  # CPU: any split


def test_runtime_envs_take_no_secrets_and_no_code():
    """Ray shows runtime_envs in its records and dashboard; trellis ships the run's code itself."""
    check("cluster.runtime_env.env_vars holds ['HF_TOKEN']", cluster={"runtime_env": {"env_vars": {"HF_TOKEN": "hf_x"}}})
    check("rollout.runtime_env.env_vars holds ['AWS_SECRET_ACCESS_KEY']",
          rollout={"runtime_env": {"env_vars": {"AWS_SECRET_ACCESS_KEY": "k"}}})
    check("cluster.runtime_env sets ['working_dir']", cluster={"runtime_env": {"working_dir": "."}})
    assert load_config(None, **BASE, cluster={"runtime_env": {"pip": ["sympy"], "env_vars": {"OMP_NUM_THREADS": "1"}}})


def test_worker_threads_follow_the_setting_then_the_machine_s_variable_then_the_cores(monkeypatch):
    """cluster.torch_threads wins; without it TRELLIS_TORCH_THREADS (the test suite sets 1: its two
    processes share 2 cores); without both, every core. Tried: 0, -1 and 'two' in the variable, each
    refused with a SettingError that names it."""
    import os

    from trellis.engine.devices import worker_threads
    from trellis.engine.errors import SettingError

    monkeypatch.setenv("TRELLIS_TORCH_THREADS", "3")
    assert worker_threads(load_config(None, **BASE, cluster={"torch_threads": 5})) == 5
    assert worker_threads(load_config(None, **BASE)) == 3
    monkeypatch.delenv("TRELLIS_TORCH_THREADS")
    assert worker_threads(load_config(None, **BASE)) == (os.cpu_count() or 1)
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv("TRELLIS_TORCH_THREADS", bad)
        with pytest.raises(SettingError, match=f"TRELLIS_TORCH_THREADS='{bad}'"):
            worker_threads(load_config(None, **BASE))
