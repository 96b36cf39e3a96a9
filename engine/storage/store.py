"""A place in storage: a URI and the fsspec options that reach it (an endpoint, credentials), as one
value. Options travel with the location instead of beside it through every call, and a store can be
printed, logged or shown in a traceback without its credentials (``engine.secrets``)."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import IO, Any, Mapping

import fsspec
from fsspec.implementations.local import LocalFileSystem

from trellis.engine.secrets import redact_mapping


@dataclass(frozen=True, eq=False)
class Store:
    uri: str
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", dict(self.options or {}))  # None: no options; a copy the caller cannot change

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r}, options={redact_mapping(self.options)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Store) and (self.uri, self.options) == (other.uri, other.options)

    def join(self, *parts: str) -> Store:
        """The store at ``uri/part/...``, with the same options."""
        return Store("/".join([self.uri.rstrip("/"), *(part.strip("/") for part in parts)]), self.options)

    def fs(self) -> tuple[fsspec.AbstractFileSystem, str]:
        """The filesystem and the path on it, as ``fsspec.core.url_to_fs`` gives them."""
        return fsspec.core.url_to_fs(self.uri, **self.options)

    def open(self, mode: str = "rb", **kwargs: Any) -> IO:
        """The file at ``uri`` (``fsspec.open``), to use as a context manager."""
        return fsspec.open(self.uri, mode, **self.options, **kwargs)

    def exists(self) -> bool:
        fs, path = self.fs()
        return fs.exists(path)

    def replace_text(self, text: str) -> None:
        self.replace_bytes(text.encode())

    def replace_bytes(self, data: bytes) -> None:
        """Write ``data`` as the whole file, which a reader (or a crash half-way) sees as before or after, never
        in part: on a local disk through a hidden file beside it renamed over it (a writer killed half-way
        leaves that ``.NAME.*.tmp`` file behind, never the target cut short), on an object store in one PUT
        (a multipart upload for a large file, which becomes visible only once complete)."""
        fs, path = self.fs()
        folder, name = path.rsplit("/", 1)
        fs.makedirs(folder, exist_ok=True)
        if not isinstance(fs, LocalFileSystem):
            fs.pipe_file(path, data)
            return
        temporary = f"{folder}/.{name}.{uuid.uuid4().hex}.tmp"
        try:
            with open(temporary, "wb") as handle:
                handle.write(data)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
