"""What a run's workers run in: the runtime_env trellis gives them (the shipped user code as their
working directory, the user's own additions), and a look at that environment, from a throwaway Ray
task, before any worker is built: it runs trellis's code, and the config's functions import there."""

from __future__ import annotations

import json
import sys
from typing import Any

import ray

from trellis.engine.cluster.compat import upload_package
from trellis.engine.cluster.environment_probe import EnvironmentReport, inspect_environment
from trellis.engine.cluster.head import connect
from trellis.engine.config import TrellisConfig
from trellis.engine.run.code_bundle import CodeBundle, shipped_code
from trellis.engine.run.identity import trellis_code
from trellis.engine.run.plan import Role
from trellis.engine.run.preflight import InputError
from trellis.engine.run.user_code_checks import user_code_checks


class ClusterEnvironmentError(RuntimeError):
    """The cluster runs another trellis than the run's driver."""


def worker_runtime_env(config: TrellisConfig, bundle: CodeBundle | None, role: Role) -> dict[str, Any] | None:
    """``cluster.runtime_env``, the shipped code as ``working_dir`` (and the packages from outside the launch
    folder as ``py_modules``), and for the rollout worker its own ``rollout.runtime_env`` on top
    (environment variables merged)."""
    env: dict[str, Any] = dict(config.cluster.runtime_env or {})
    if bundle is not None and bundle.zip_path is not None:
        env["working_dir"] = upload_package(bundle.zip_path)
    if bundle is not None and bundle.modules:
        env["py_modules"] = [upload_package(module) for module in bundle.modules]
    if role == "rollout" and config.rollout.runtime_env:
        extra = dict(config.rollout.runtime_env)
        env_vars = {**env.get("env_vars", {}), **extra.pop("env_vars", {})}
        env.update(extra)
        if env_vars:
            env["env_vars"] = env_vars
    return env or None


_checked: set[tuple[str, ...]] = set()  # (cluster, trellis, runtime_env, functions) this process found fine


def prepare_cluster(config: TrellisConfig) -> str:
    """Connect to the run's cluster and check its workers' environment; returns its address."""
    address = connect(config.cluster)
    check_worker_environment(config, shipped_code(config), address)
    return address


def check_worker_environment(config: TrellisConfig, bundle: CodeBundle | None, address: str) -> None:
    """Refuse the run, before a worker exists, where workers would run other trellis code or could
    not import the config's functions. A check that passed is not repeated in this process."""
    runtime_env = worker_runtime_env(config, bundle, "controller")
    key = (address, trellis_code(), json.dumps(runtime_env, sort_keys=True), repr(user_code_checks(config)))
    if key in _checked:
        return
    probe = inspect_environment.options(runtime_env=runtime_env) if runtime_env else inspect_environment
    report: EnvironmentReport = ray.get(probe.remote(user_code_checks(config)), timeout=config.cluster.ray_get_timeout_s)
    if report.trellis != trellis_code():
        raise ClusterEnvironmentError(
            f"The Ray cluster at {address} runs trellis {report.trellis} ({report.python}); this run is trellis "
            f"{trellis_code()} ({sys.executable}), so its workers would run other code. Start a cluster from this "
            "environment (`trellis cluster down`, then `trellis cluster up`), or install this trellis where the "
            "cluster runs."
        )
    if report.problems:
        lines = "\n".join(f"  - {problem}" for problem in report.problems)
        raise InputError(f"Cannot start the run: on the cluster's workers\n{lines}")
    _checked.add(key)
