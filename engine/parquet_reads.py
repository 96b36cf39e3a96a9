"""Parquet files read through fsspec so that Arrow never holds a Python object.

Arrow frees what it read from on its own threads, sometimes after the reading call returned. Freeing a
Python object (a file object handed to it, or the ``bytes`` of one) takes the GIL there; while the
interpreter is exiting that ends the thread mid-unwind and aborts the process with "terminate called
without an active exception" (apache/arrow#34314). A ``trellis ledger check`` that had printed a clean
ledger exited 134 that way in CI; gdb showed ``PyBuffer::~PyBuffer`` on a parquet page reader's thread.
Here the bytes are read on the caller's thread and copied into a buffer Arrow owns.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq


def read_parquet(fs: fsspec.AbstractFileSystem, path: str, columns: Sequence[str] | None = None) -> pa.Table:
    """The table at ``path`` on ``fs`` (``columns`` only, when given; those it lacks are left out)."""
    file = pq.ParquetFile(_in_memory(fs, path))
    wanted = None if columns is None else [c for c in columns if c in file.schema_arrow.names]
    return file.read(columns=wanted)


def iter_parquet_rows(fs: fsspec.AbstractFileSystem, path: str, batch_size: int = 4096) -> Iterator[dict]:
    """The rows of the file at ``path`` as dicts, a batch decoded at a time (a dataset's prompts)."""
    for batch in pq.ParquetFile(_in_memory(fs, path)).iter_batches(batch_size=batch_size):
        yield from batch.to_pylist()


def _in_memory(fs: fsspec.AbstractFileSystem, path: str) -> pa.BufferReader:
    owned = pa.BufferOutputStream()  # memory of Arrow's pool: freeing it needs no GIL
    with fs.open(path, "rb") as handle:
        owned.write(handle.read())
    return pa.BufferReader(owned.getvalue())
