"""Where the Ray versions trellis supports differ or need a nudge, in one place (torch's and
transformers' are in ``engine.compat``)."""

from __future__ import annotations

import os
from pathlib import Path

from ray._private import ray_constants
from ray._private.runtime_env import packaging
from ray._raylet import Config


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
