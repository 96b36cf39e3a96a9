"""Prefect artifact keys (one key per run and kind, so the UI shows each artifact's history) and the
links artifacts give to what lives in storage.

``artifact_links`` turns ``s3://`` URIs into something a browser opens: ``console`` links to the AWS
console's object (or folder) page, ``presigned`` signs a file for ``artifact_link_expiry_s`` (folders,
which cannot be signed, get the console link). Local paths and other schemes stay as they are.
"""

from __future__ import annotations

import re
from urllib.parse import quote

import fsspec

from trellis.engine.config import TrellisConfig


def artifact_key(config: TrellisConfig, what: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", f"{config.experiment_name}-{what}".lower()).strip("-")


def console_link(uri: str) -> str:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if key.rsplit("/", 1)[-1].count(".") and not key.endswith("/"):
        return f"https://s3.console.aws.amazon.com/s3/object/{bucket}?prefix={quote(key)}"
    return f"https://s3.console.aws.amazon.com/s3/buckets/{bucket}?prefix={quote(key.rstrip('/') + '/')}"


def storage_link(config: TrellisConfig, uri: str) -> str:
    if not uri.startswith("s3://") or config.artifact_links == "uri":
        return uri
    if config.artifact_links == "presigned":
        fs, path = fsspec.core.url_to_fs(uri, **config.storage_options)
        if fs.isfile(path):
            return fs.sign(path, expiration=config.artifact_link_expiry_s)
    return console_link(uri)
