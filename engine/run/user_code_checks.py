"""The config's functions (rewards, agent tools and entrypoints, group filter, eval metric), checked
by importing them as the workers will. Light on purpose: the cluster's look at its workers' environment
(``engine.cluster.environment_probe``) runs these checks in a fresh worker process, before any run
worker exists, and should not cost it the engine's imports (torch, transformers: ~5 s)."""

from __future__ import annotations

from pathlib import Path

from trellis.engine.config import TrellisConfig
from trellis.engine.rollout.rewards.runner import resolve_function
from trellis.engine.user_code import UserCodeError, load_attribute, load_function

UserCodeCheck = tuple[str, str, str]  # (config key, spec, kind: reward / object / function)
_LOADERS = {"reward": resolve_function, "object": load_attribute, "function": load_function}


def user_code_checks(config: TrellisConfig) -> tuple[UserCodeCheck, ...]:
    """What the config names in user code, and what each must be."""
    checks = [("reward", spec, "reward") for reward in config.rewards for spec in (reward.function, *reward.by_data_source.values())]
    checks += [("agent.tools", agent.tools, "object") for agent in config.agents if agent.tools is not None]
    checks += [("agent.entrypoint", agent.entrypoint, "function") for agent in config.agents if agent.entrypoint is not None]
    checks += [(key, spec, "function") for key, spec in (("dynamic_sampling.group_filter", config.dynamic_sampling.group_filter),
                                                         ("eval_metric", config.eval_metric)) if spec]
    return tuple(dict.fromkeys(checks))


def user_code_problems(checks: tuple[UserCodeCheck, ...], base_dir: str | Path | None = None) -> list[str]:
    """Each check imported as the workers will (from ``base_dir``, default the current directory)."""
    problems = []
    for name, spec, kind in checks:
        try:
            _LOADERS[kind](spec, base_dir)
        except UserCodeError as error:
            problems.append(f"{name}: {error}")
    return problems
