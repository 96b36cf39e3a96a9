"""Parquet files are read through engine.parquet_reads only: when Arrow held a Python object (a file
object, or the bytes read from one), an Arrow thread freeing it while the interpreter exited aborted a
`trellis ledger check` in CI after it had printed a clean ledger (apache/arrow#34314)."""

import ast
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from trellis.engine.parquet_reads import iter_parquet_rows, read_parquet

ROOT = Path(__file__).resolve().parents[1]
READERS = {"read_table", "ParquetFile", "read_schema", "read_metadata", "read_pandas"}


def test_a_file_reads_back_whole_or_in_the_columns_it_has():
    fs = fsspec.filesystem("memory")
    with fs.open("/parts/part-0.parquet", "wb") as handle:
        pq.write_table(pa.table({"a": [1, 2, 3], "b": ["x", "y", "z"]}), handle)
    assert read_parquet(fs, "/parts/part-0.parquet").to_pylist()[0] == {"a": 1, "b": "x"}
    # "c" is a column a newer writer added: an older part reads back without it
    assert read_parquet(fs, "/parts/part-0.parquet", columns=["b", "c"]).column_names == ["b"]
    assert [row["a"] for row in iter_parquet_rows(fs, "/parts/part-0.parquet", batch_size=2)] == [1, 2, 3]


def test_no_module_hands_arrow_a_file_of_its_own():
    """Every pyarrow.parquet read in trellis's packages goes through engine.parquet_reads."""
    found = []
    for layer in ("engine", "tasks", "flows", "deployments"):
        for path in sorted((ROOT / layer).rglob("*.py")):
            if path == ROOT / "engine" / "parquet_reads.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in READERS and getattr(node.value, "id", "") == "pq":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} pq.{node.attr}")
    assert found == []
