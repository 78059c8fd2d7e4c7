"""Reading and writing Parquet tables, checked against their versioned schemas.

A written file carries its schema tag ("rollouts/v1") in the Parquet key-value metadata; a reader refuses a
file whose tag is not the version it knows (or an older one it upgrades: schemas.tables.upgrade), naming the
file, instead of misreading old columns.
The bytes are serialised in memory, hashed, and written atomically, so the hash in the manifest is the hash
of exactly the bytes on storage.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.tables import TableSchema, conform, upgrade
from storage.fs import atomic_write_bytes

SCHEMA_METADATA_KEY = b"rlpipe.schema"


@dataclass(frozen=True)
class WrittenTable:
    path: str
    rows: int
    bytes: int
    sha256: str


def serialize_table(table: pa.Table, spec: TableSchema, source: str) -> bytes:
    table = conform(table, spec, source)
    table = table.replace_schema_metadata({SCHEMA_METADATA_KEY: spec.tag.encode()})
    sink = pa.BufferOutputStream()
    # Deterministic bytes for the same rows: no timestamps in the file, fixed compression and row groups.
    pq.write_table(table, sink, compression="zstd", row_group_size=64 * 1024, write_statistics=True)
    return sink.getvalue().to_pybytes()


def write_table(fs: fsspec.AbstractFileSystem, path: str, table: pa.Table, spec: TableSchema) -> WrittenTable:
    data = serialize_table(table, spec, path)
    atomic_write_bytes(fs, path, data)
    return WrittenTable(path=path, rows=table.num_rows, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


class TableVersionError(ValueError):
    pass


def read_table(fs: fsspec.AbstractFileSystem, path: str, spec: TableSchema) -> pa.Table:
    with fs.open(path, "rb") as handle:
        table = pq.read_table(handle)
    tag = (table.schema.metadata or {}).get(SCHEMA_METADATA_KEY, b"").decode() or "none"
    if not spec.reads(tag):
        raise TableVersionError(f"{path}: schema version {tag}, this rlpipe reads {spec.tag}")
    return conform(upgrade(table, spec) if tag != spec.tag else table, spec, path)
