"""The registries a config's choices resolve through: every rollout backend and advantage estimator a
config can name has a row (what it needs, how it is built or computed), and no row exists that a config
cannot name; an unknown name is refused with the choices. A backend's capabilities match what its class
does, and decide the rules a run is held to. Tried: a backend and an estimator trellis does not have,
by config, by name and at build time; a backend that cannot abort, in a disaggregated run."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import get_args

import pytest
import torch

from trellis.engine.algo.advantages import ESTIMATORS, estimator, grpo, pass_at_k, rloo
from trellis.engine.config import AdvantageConfig
from trellis.engine.config.backends import ROLLOUT_BACKENDS, backend_traits, configurable_backends
from trellis.engine.config.loading import ConfigError, load_config
from trellis.engine.devices import rollout_device
from trellis.engine.rollout.backends.registry import BUILDERS, build_rollout_backend

ROLLOUT = Path(__file__).resolve().parents[1] / "engine" / "rollout" / "backends"
# Where each backend's class is: read as source, so that vLLM need not be installed.
BACKEND_CLASSES = {"transformers": (ROLLOUT / "transformers_backend.py", "TransformersRollout"),
                   "vllm": (ROLLOUT / "vllm_backend.py", "VllmRollout")}
ON_CPU = {"train_worker": {"device": "cpu"}, "load_from": "my-model", "train_dataset": {"path": "prompts.parquet"},
          "reward": {"function": "myreward:score"},
          "total_train_steps": 1}


def test_every_backend_a_config_can_name_has_its_traits_and_its_builder():
    assert configurable_backends() == set(ROLLOUT_BACKENDS) == set(BUILDERS) == {"transformers", "vllm"}


def test_every_estimator_a_config_can_name_is_computed_by_its_own_function():
    """A name left out of the table would fail here, not fall through to another estimator."""
    names = set(get_args(AdvantageConfig.model_fields["estimator"].annotation))
    assert names == set(ESTIMATORS)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    lengths = torch.tensor([4, 8, 8, 2, 8, 8, 8, 8])
    results = {
        name: estimator(name).advantages([rewards], AdvantageConfig(estimator=name), [lengths])[0] for name in sorted(names)
    }
    assert torch.allclose(results["grpo"], grpo(rewards, AdvantageConfig().eps))
    assert torch.allclose(results["rloo"], rloo(rewards))
    assert torch.allclose(results["pass_at_k"], pass_at_k(rewards, AdvantageConfig().pass_at_k))
    distinct = {tuple(round(v, 5) for v in advantages.tolist()) for advantages in results.values()}
    assert len(distinct) == len(names)  # no two names compute the same thing on this group
    assert [name for name, e in ESTIMATORS.items() if e.whole_batch] == ["reinforce_pp"]


def test_unknown_names_are_refused_with_the_choices():
    with pytest.raises(ConfigError, match=r"rollout.backend: Input should be 'transformers' or 'vllm'"):
        load_config(None, rollout={"backend": "sglang"})
    with pytest.raises(ConfigError, match=r"advantage.estimator: Input should be 'grpo'"):
        load_config(None, advantage={"estimator": "ppo"})
    with pytest.raises(ValueError, match=r"Unknown rollout backend 'sglang'; trellis has transformers, vllm"):
        backend_traits("sglang")
    with pytest.raises(ValueError, match=r"Unknown advantage estimator 'ppo'; trellis has drgrpo, grpo, opo, pass_at_k, reinforce_pp, rloo"):
        estimator("ppo")
    config = load_config(None, **ON_CPU)
    unknown = config.model_copy(update={"rollout": config.rollout.model_copy(update={"backend": "sglang"})})  # past validation
    with pytest.raises(ValueError, match=r"Unknown rollout backend 'sglang'; trellis builds transformers, vllm"):
        build_rollout_backend(unknown, tokenizer=None)


def methods_of(path: Path, class_name: str) -> set[str]:
    tree = ast.parse(path.read_text())
    (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
    return {node.name for node in cls.body if isinstance(node, ast.FunctionDef)}


def test_each_backends_capabilities_say_what_its_class_does():
    assert set(BACKEND_CLASSES) == set(ROLLOUT_BACKENDS)
    for name, (path, class_name) in BACKEND_CLASSES.items():
        methods, traits = methods_of(path, class_name), backend_traits(name)
        assert traits.exports_served_weights == ("served_weights" in methods), name
        assert not traits.supports_abort or {"abort", "resume_generation"} <= methods, name


def test_a_backend_that_cannot_abort_is_refused_for_the_disaggregated_trainer(monkeypatch):
    """The producer pauses generation in flight for each weight sync: its backend must be able to stop."""
    disaggregated = {**ON_CPU, "trainer": "disaggregated", "total_train_steps": 10}
    load_config(None, **disaggregated)
    monkeypatch.setitem(ROLLOUT_BACKENDS, "transformers", dataclasses.replace(ROLLOUT_BACKENDS["transformers"], supports_abort=False))
    with pytest.raises(ConfigError, match=r"rollout.backend=transformers cannot abort it: use trainer: colocated"):
        load_config(None, **disaggregated)
    load_config(None, **ON_CPU)  # a colocated run never aborts


def test_the_backend_traits_decide_where_the_rollout_runs():
    assert rollout_device(load_config(None, **ON_CPU)).type == "cpu"
    assert rollout_device(load_config(None, rollout={"backend": "vllm"}, **ON_CPU)).type == "cuda"
    assert backend_traits("vllm").needs_gpu and not backend_traits("transformers").needs_gpu
