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
from contextlib import contextmanager
from importlib import metadata
from typing import Any, Iterable, Iterator, Mapping

import fsspec
from pydantic import BaseModel

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


def redact_settings(settings: BaseModel, *, exclude: set[str] | None = None) -> dict[str, Any]:
    """A pydantic model as JSON, for writing out: its own fields are kept whatever their names (a
    ``prompt_key`` or ``max_new_tokens`` is a setting, not a secret), while the free-form mappings in it
    (a runtime_env) are masked by name as ``redact_mapping`` does, and URL passwords everywhere."""
    return _redacted(settings, settings.model_dump(mode="json", exclude=exclude))


def _redacted(value: Any, dumped: Any) -> Any:
    if isinstance(value, BaseModel) and isinstance(dumped, Mapping):
        return {name: _redacted(getattr(value, name, None), item) for name, item in dumped.items()}
    if isinstance(value, (list, tuple)) and isinstance(dumped, list):
        return [_redacted(v, d) for v, d in zip(value, dumped)]
    if isinstance(dumped, Mapping):
        return redact_mapping(dumped)
    if isinstance(dumped, str):
        return redact_url_passwords(dumped)
    return dumped


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


_TRACEBACK_FORMATTER = logging.Formatter()


def install_log_redaction(*extra: Mapping[str, Any]) -> None:
    """Scrub secret values from every log record this process creates, from now on: the message and
    the exception traceback (``logger.exception``), whose text is otherwise formatted later, by each
    handler, from the live exception.

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
            message = record.getMessage()
            clean = redact(message)
            if clean != message:
                record.msg, record.args = clean, ()
            if record.exc_info and record.exc_info[0] is not None:
                # Formatters reuse exc_text when it is set: the traceback is formatted once, here, clean.
                record.exc_text = redact(_TRACEBACK_FORMATTER.formatException(record.exc_info))
            if record.stack_info:
                record.stack_info = redact(record.stack_info)
            return record

        logging.setLogRecordFactory(scrubbed_record)


@contextmanager
def scoped_log_redaction() -> Iterator[None]:
    """Log redaction as it was before the block, once it ends: the record factory and the values
    known. For tests, which must not leave a process-wide change behind for the tests after them."""
    global _installed
    with _lock:
        factory, values, installed = logging.getLogRecordFactory(), set(_known_values), _installed
    try:
        yield
    finally:
        with _lock:
            logging.setLogRecordFactory(factory)
            _known_values.clear()
            _known_values.update(values)
            _installed = installed


def redact(text: str) -> str:
    """``text`` without any secret value this process knows of (see ``install_log_redaction``)."""
    return redact_text(text, _known_values) if _known_values else redact_url_passwords(text)


def remember_secrets(values: Iterable[str]) -> None:
    """Values to scrub from logs and error messages from now on, beside those found by name."""
    with _lock:
        _known_values.update(value for value in values if len(value) >= _MIN_REDACTED_VALUE)


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


# Object-storage settings a launching shell holds: they follow each run to its workers.
FORWARDED_ENVIRONMENT = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
)


class Credentials:
    """Credentials (and the settings that go with them) from the launching shell, for a run's
    workers on a cluster that may have been started before they were set. They travel as an
    argument of a worker call, never in a Ray runtime_env (which Ray shows in its records and
    dashboard), and their repr names the variables only."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self._values = dict(values)

    def __repr__(self) -> str:
        return f"Credentials({', '.join(sorted(self._values))})"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._values))

    @classmethod
    def from_environment(cls, extra_names: Iterable[str] = (), environ: Mapping[str, str] | None = None) -> Credentials:
        """The forwarded variables set here, ``extra_names`` too; an ``AWS_PROFILE`` is resolved to
        its keys here, since the workers' machines may not hold the profile's files."""
        environ = os.environ if environ is None else environ
        values = {name: environ[name] for name in (*FORWARDED_ENVIRONMENT, *extra_names) if environ.get(name)}
        if environ.get("AWS_PROFILE") and "AWS_ACCESS_KEY_ID" not in values:
            values.update(_profile_keys(environ["AWS_PROFILE"]))
        return cls(values)

    def apply(self, replacing: Credentials | None = None) -> None:
        """Set them in this process's environment (in place of ``replacing``, which an earlier run
        set) and scrub their values from its logs."""
        for name in replacing.names if replacing is not None else ():
            if name not in self._values:
                os.environ.pop(name, None)
        os.environ.update(self._values)
        remember_secrets(value for name, value in self._values.items() if looks_secret(name))
        _forget_cached_filesystems()


def _profile_keys(profile: str) -> dict[str, str]:
    try:
        from botocore.session import Session  # comes with s3fs
    except ImportError:
        return {}
    found = Session(profile=profile).get_credentials()
    if found is None:
        return {}
    frozen = found.get_frozen_credentials()
    keys = {"AWS_ACCESS_KEY_ID": frozen.access_key, "AWS_SECRET_ACCESS_KEY": frozen.secret_key}
    if frozen.token:
        keys["AWS_SESSION_TOKEN"] = frozen.token
    return keys


def _forget_cached_filesystems() -> None:
    """fsspec keeps one filesystem per set of options, with the credentials it first resolved: a
    worker that failed without credentials would keep failing with them."""
    from fsspec.spec import AbstractFileSystem

    pending = [AbstractFileSystem]
    while pending:
        cls = pending.pop()
        cls.clear_instance_cache()
        pending.extend(cls.__subclasses__())
