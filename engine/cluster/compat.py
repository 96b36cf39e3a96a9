"""Where the Ray versions trellis supports differ or need a nudge, in one place (torch's and
transformers' are in ``engine.compat``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ray._private import ray_constants
from ray._private.runtime_env import packaging
from ray._raylet import Config
from ray.exceptions import RayActorError, RayTaskError


def use_private_ray_head(token_file: str | None) -> None:
    """Prepare this process to connect to a Ray head that listens on loopback only and, with a
    ``token_file``, asks for its token (Ray 2.5x-2.6x).

    Ray turns any loopback address into the machine's network address unless it is told the cluster
    is one machine (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), and it reads that setting, and its
    authentication mode, once when imported: both are refreshed here for a process that already
    imported Ray."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    if token_file is None or "RAY_AUTH_TOKEN" in os.environ or "RAY_AUTH_TOKEN_PATH" in os.environ:
        return  # no token, or the user chose one
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = token_file
    Config.initialize("")


def upload_package(zip_path: str) -> str:
    """Put a local zip in the cluster's package store (the GCS) and return its ``gcs://`` URI, which
    any actor's ``runtime_env`` may name as ``working_dir``: Ray uploads local folders and zips
    itself only for a whole job (``ray.init``), while each run here ships its own code to its own
    actors. These are the calls Ray makes for a job's ``working_dir``; content-addressed, so a zip
    already uploaded is not sent again."""
    package = Path(zip_path)
    uri = packaging.get_uri_for_package(package)
    if not packaging.package_exists(uri):
        packaging.upload_package_to_gcs(uri, package.read_bytes())
    packaging.pin_runtime_env_uri(uri)  # kept while the workers that use it start
    return uri


# Ray's errors keep less than they show. An actor's failed constructor reaches the driver as an
# ActorDiedError that holds the constructor's RayTaskError only as its first argument, and a method's
# error is raised as a copy (`as_instanceof_cause`) that keeps the cause but not which actor or method
# failed: those are left in the text's first line, `ray::[name:]Class.method() (pid=..., repr=...)`.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FAILED_CALL = re.compile(r"ray::(?:\S+?:)?\w+\.(?P<method>\w+)\(\).*?repr=(?P<repr>[^,)]*)\)")


def creation_error(error: RayActorError) -> RayTaskError | None:
    """What an actor's constructor raised, if ``error`` says that is why the actor died."""
    if error.actor_init_failed and error.args and isinstance(error.args[0], RayTaskError):
        return error.args[0]
    return None


def failed_call(error: RayTaskError) -> tuple[str | None, str | None]:
    """The ``repr`` of the actor whose call raised ``error`` (the actor shells make it their name) and
    the method called; ``None`` where Ray did not say."""
    found = _FAILED_CALL.search(_ANSI.sub("", str(error).split("\n", 1)[0]))
    return (found["repr"], found["method"]) if found else (None, None)
