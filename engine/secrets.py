"""Keep credentials out of everything trellis writes: env.json, logs, Prefect parameters, artifacts.

A value is secret when its name looks like a credential (``AWS_SECRET_ACCESS_KEY``, ``HF_TOKEN``,
``storage_options.secret``...), or when it is the password part of a URL. Log redaction works on
values, not names: every secret value known to the process is replaced wherever it appears in a
log message, whichever library logged it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from importlib import metadata
from typing import Any, Iterable, Mapping

import fsspec

REDACTED = "**********"
_SECRET_NAME = re.compile(
    r"KEY|SECRET|TOKEN|PASSW|CREDENTIAL|AUTH|PRIVATE|SIGNATURE|COOKIE|SESSION|CERT|SALT|DSN", re.IGNORECASE
)
_URL_PASSWORD = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:/@\s]+):(?P<password>[^@/\s]+)@")
# Short values ("1", "true") cannot be told from ordinary text; they are masked in dumps by name only.
_MIN_REDACTED_VALUE = 6


def looks_secret(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def redact_url_passwords(text: str) -> str:
    return _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)


def redact_mapping(values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy with secret-named entries masked (recursively) and URL passwords removed."""
    redacted: dict[str, Any] = {}
    for name, value in values.items():
        if looks_secret(str(name)) and value not in (None, ""):
            redacted[name] = REDACTED
        elif isinstance(value, Mapping):
            redacted[name] = redact_mapping(value)
        elif isinstance(value, str):
            redacted[name] = redact_url_passwords(value)
        else:
            redacted[name] = value
    return redacted


def secret_values(environ: Mapping[str, str] | None = None, *extra: Mapping[str, Any]) -> set[str]:
    """Values worth scrubbing from free text: those of secret-named variables and options."""
    found: set[str] = set()
    for source in (os.environ if environ is None else environ, *extra):
        for name, value in source.items():
            if isinstance(value, str) and looks_secret(str(name)) and len(value) >= _MIN_REDACTED_VALUE:
                found.add(value)
    return found


def redact_text(text: str, values: Iterable[str]) -> str:
    for value in sorted(values, key=len, reverse=True):  # longest first: one secret may contain another
        text = text.replace(value, REDACTED)
    return redact_url_passwords(text)


_lock = threading.Lock()
_known_values: set[str] = set()
_installed = False


def install_log_redaction(*extra: Mapping[str, Any]) -> None:
    """Scrub secret values from every log record this process creates, from now on.

    Works at record creation (``logging.setLogRecordFactory``), so handlers added later by Prefect,
    Ray or the user see clean records too. Calling it again adds the new values.
    """
    global _installed
    with _lock:
        _known_values.update(secret_values(None, *extra))
        if _installed:
            return
        _installed = True
        make_record = logging.getLogRecordFactory()

        def scrubbed_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = make_record(*args, **kwargs)
            if _known_values:
                message = record.getMessage()
                clean = redact_text(message, _known_values)
                if clean != message:
                    record.msg, record.args = clean, ()
            return record

        logging.setLogRecordFactory(scrubbed_record)


def runtime_environment() -> dict[str, Any]:
    """The process environment (secrets masked) and the versions of the libraries a run depends on."""
    versions = {}
    for package in ("torch", "transformers", "vllm", "ray", "prefect", "pyarrow", "fsspec", "s3fs", "pydantic"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return {"environment": redact_mapping(dict(os.environ)), "versions": versions}


def write_runtime_environment(run_uri: str, storage_options: Mapping[str, Any]) -> str:
    """Write ``{run}/logs/env.json``; return its URI."""
    uri = f"{run_uri.rstrip('/')}/logs/env.json"
    fs, path = fsspec.core.url_to_fs(uri, **dict(storage_options))
    fs.makedirs(fs._parent(path), exist_ok=True)
    with fs.open(path, "w") as handle:
        json.dump(runtime_environment(), handle, indent=2, sort_keys=True)
    return uri
