"""Parquet tables of many reduced bundles: one row per entity, partitioned by day."""

from __future__ import annotations

import posixpath
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ._rows import COLUMNS, TABLES, Packed
from ._storage import url_filesystem

# A file per (table, day) holds at most this many rows; the driver flushes then.
ROWS_PER_FILE = 50_000
# Buffered rows across all tables before everything is flushed, to bound the driver's memory.
MAX_BUFFERED_ROWS = 200_000

_ARROW: dict[str, pa.DataType] = {
    "string": pa.string(),
    "int64": pa.int64(),
    "double": pa.float64(),
    "bool": pa.bool_(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "strings": pa.list_(pa.string()),
    "map": pa.map_(pa.string(), pa.string()),
    "producers": pa.list_(pa.struct([pa.field("kind", pa.string()), pa.field("id", pa.string())])),
}

SCHEMAS: dict[str, pa.Schema] = {
    table: pa.schema([pa.field(name, _ARROW[kind]) for name, kind in columns])
    for table, columns in COLUMNS.items()
}


# -- writing ----------------------------------------------------------------------------------


class TableSink:
    """Buffers rows per (table, day) and writes them as Parquet files under a staging
    directory; commit() swaps the staged tables in for the old ones, abort() drops them.

    Files are named by their order (part-00000, ...), so the same rows added in the same
    order give byte-identical files, whichever engine reduced the bundles.
    """

    def __init__(self, target: str, storage_options: dict[str, str] | None = None) -> None:
        self.target = target
        self.fs, self.base, _ = url_filesystem(target, tuple((storage_options or {}).items()))
        self.base = self.base.rstrip("/")
        self.staging = posixpath.join(self.base, f".staging-{uuid.uuid4().hex}")
        self._buffers: dict[tuple[str, str], list[tuple[Any, ...]]] = {}
        self._parts: dict[tuple[str, str], int] = {}
        self._buffered = 0
        self.rows_written: dict[str, int] = dict.fromkeys(TABLES, 0)
        self._days: set[str] = set()
        # Whether swap() has removed or moved anything yet, and the tables it replaced whole:
        # once it has begun, the staged files are the only copy of the tables not yet moved in.
        self._swap_begun = False
        self._swapped: list[str] = []

    def add(self, day: str, rows: Packed) -> None:
        self._days.add(day)
        for table, table_rows in rows.items():
            if not table_rows:
                continue
            buffer = self._buffers.setdefault((table, day), [])
            buffer.extend(table_rows)
            self._buffered += len(table_rows)
            if len(buffer) >= ROWS_PER_FILE:
                self._flush(table, day)
        if self._buffered >= MAX_BUFFERED_ROWS:
            for table, buffered_day in sorted(self._buffers):
                self._flush(table, buffered_day)

    def _flush(self, table: str, day: str) -> None:
        rows = self._buffers.pop((table, day), [])
        self._buffered -= len(rows)
        self._write(table, day, rows)

    def _write(self, table: str, day: str, rows: list[tuple[Any, ...]]) -> None:
        part = self._parts.get((table, day), 0)
        self._parts[(table, day)] = part + 1
        directory = posixpath.join(self.staging, table, f"day={day}")
        self.fs.makedirs(directory, exist_ok=True)
        schema = SCHEMAS[table]
        columns = list(zip(*rows, strict=True)) if rows else [() for _ in schema.names]
        arrow = pa.Table.from_arrays(
            [
                pa.array(column, type=field.type)
                for column, field in zip(columns, schema, strict=True)
            ],
            schema=schema,
        )
        with self.fs.open(posixpath.join(directory, f"part-{part:05d}.parquet"), "wb") as file:
            pq.write_table(arrow, file, compression="zstd")
        self.rows_written[table] += len(rows)

    def commit(self) -> dict[str, int]:
        """Write what is buffered, then replace the tables under target by the staged ones."""
        self.stage()
        return self.swap()

    def stage(self) -> None:
        """Write what is buffered into the staging directory."""
        for table, day in sorted(self._buffers):
            self._flush(table, day)
        if self._days:
            # An empty table still gets a file, so that readers find its schema.
            first_day = min(self._days)
            for table in TABLES:
                if not self.rows_written[table]:
                    self._write(table, first_day, [])

    def swap(self) -> dict[str, int]:
        """Replace the tables under target by the staged ones: each table's files removed,
        then the staged ones moved in. Stopped part-way, some tables would be the new ones,
        some gone: run it with stops held (bundle/_confine.py's stops_held). Failed part-way
        (the store refused a move), the staged files not yet moved are kept (abort() leaves
        them) and stopped_swap() says where."""
        for table in TABLES:
            final = posixpath.join(self.base, table)
            if self.fs.exists(final):
                self._swap_begun = True
                self.fs.rm(final, recursive=True)
            staged = posixpath.join(self.staging, table)
            # File by file: object stores have no directories to rename.
            for name in sorted(self.fs.find(staged)):
                target = posixpath.join(final, posixpath.relpath(name, staged))
                self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
                self._swap_begun = True
                self.fs.mv(name, target)
            self._swapped.append(table)
        self._remove_staging()
        return dict(self.rows_written)

    def abort(self) -> None:
        """Drop what was staged, unless a swap has begun: then some tables are new and some
        old or gone, and the staged files are all there is of the new ones not yet moved in
        (was: removed too, those tables lost)."""
        self._buffers.clear()
        if not self._swap_begun:
            self._remove_staging()

    def stopped_swap(self) -> str:
        """Where a swap that failed part-way left the tables, for the warning that says the
        tables were not written; "" when none began."""
        if not self._swap_begun:
            return ""
        where = f"{self.target.rstrip('/')}/{posixpath.basename(self.staging)}"
        left = [table for table in TABLES if table not in self._swapped]
        if not left:
            return f"every table was replaced, but {where} could not be removed"
        replaced = ", ".join(self._swapped) or "no table"
        return (
            f"the swap stopped part-way: {replaced} replaced, {left[0]} part-way (its old "
            f"files removed), {', '.join(left[1:]) or 'no other'} not yet; the new files not "
            f"yet moved in are kept in {where}"
        )

    def _remove_staging(self) -> None:
        if self.fs.exists(self.staging):
            self.fs.rm(self.staging, recursive=True)
