"""What a run's workers are built from: the user's code shipped to them, trellis's own code, and the
parts of the config they use. Live workers are re-used by a later run only when all three match
(``engine.cluster.workers``); otherwise they are rebuilt, never left scoring with old code or
writing to another run's storage.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from trellis.engine.config import TrellisConfig
from trellis.engine.run.code_bundle import CodeBundle

# Settings only the driver acts on: a later run may change them and keep the live workers.
DRIVER_ONLY = frozenset({
    "total_train_steps", "total_epochs", "auto_resume", "load_checkpoint_cfg", "enable_evaluate",
    "enable_initial_evaluate", "evaluate_step", "checkpoint_interval", "checkpoint_maxkeep", "hf_interval",
    "hf_max_keep", "checkpoint_no_save_optimizer",
})
DRIVER_ONLY_CLUSTER = frozenset({
    "address", "head_port", "home", "num_cpus", "namespace", "ray_get_timeout_s", "release_workers_at_end",
    "flow_retries", "overlap_next_rollout", "code_dir", "code_excludes", "forward_env",
})


@functools.cache
def trellis_code() -> str:
    """trellis's version and a digest of the engine package this process imports."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    try:
        version = metadata.version("trellis")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return f"{version}+{digest.hexdigest()[:16]}"


def worker_settings(config: TrellisConfig) -> dict:
    """The config as the workers use it (credentials masked, driver-only settings left out)."""
    settings = config.model_dump(mode="json", exclude=set(DRIVER_ONLY))
    settings["cluster"] = {k: v for k, v in settings["cluster"].items() if k not in DRIVER_ONLY_CLUSTER}
    return settings


@dataclass(frozen=True)
class WorkerFingerprint:
    user_code: str  # digest of the shipped bundle; "" when nothing is shipped
    trellis: str  # trellis_code() of the driver that built the workers
    settings: str  # worker_settings() as sorted JSON

    @classmethod
    def of(cls, config: TrellisConfig, bundle: CodeBundle | None) -> WorkerFingerprint:
        settings = json.dumps(worker_settings(config), sort_keys=True)
        return cls(bundle.digest if bundle is not None else "", trellis_code(), settings)

    def differences(self, built: WorkerFingerprint) -> list[str]:
        """What differs between this run and workers ``built`` with another fingerprint, in words."""
        found = []
        if built.user_code != self.user_code:
            found.append(f"the user code (shipped {built.user_code[:12] or 'nothing'}, now {self.user_code[:12] or 'nothing'})")
        if built.trellis != self.trellis:
            found.append(f"trellis ({built.trellis}, now {self.trellis})")
        if built.settings != self.settings:
            before, now = json.loads(built.settings), json.loads(self.settings)
            changed = sorted(key for key in before.keys() | now.keys() if before.get(key) != now.get(key))
            found.append(f"the config ({', '.join(changed)})")
        return found
