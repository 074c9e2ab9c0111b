"""SQLite plumbing for the embedded store: the schema, opening the file, and
turning SQLite errors into the store's typed errors."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from app.store.base import StoreError, StoreFull, StoreUnavailable

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta (name, value) VALUES ('revision', 1);
CREATE TABLE IF NOT EXISTS kv (
    key BLOB PRIMARY KEY,
    value BLOB NOT NULL,
    create_revision INTEGER NOT NULL,
    mod_revision INTEGER NOT NULL,
    lease INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS kv_by_lease ON kv (lease) WHERE lease != 0;
"""


def prefix_end(prefix: bytes) -> bytes | None:
    """The first key after every key starting with `prefix` (None: no bound)."""
    buf = bytearray(prefix)
    while buf:
        if buf[-1] < 0xFF:
            buf[-1] += 1
            return bytes(buf)
        buf.pop()
    return None


@contextlib.contextmanager
def translated(operation: str) -> Iterator[None]:
    try:
        yield
    except sqlite3.OperationalError as exc:
        if exc.sqlite_errorcode == sqlite3.SQLITE_FULL:
            # The disk (or a size limit) is full: said as such, like etcd's
            # NOSPACE, not as a store that cannot be reached.
            raise StoreFull(f"embedded store {operation}: out of space: {exc}") from exc
        # Locked by another process, disk full, I/O error: a write cannot be
        # made now, which callers treat like an unreachable etcd.
        raise StoreUnavailable(f"embedded store {operation}: {exc}") from exc
    except sqlite3.Error as exc:
        raise StoreError(f"embedded store {operation}: {exc}") from exc


def connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    with translated("open"):
        # Autocommit mode: EmbeddedStore._writing opens transactions explicitly.
        db = sqlite3.connect(path, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")
            # Held for the life of the connection: a second process on the
            # same file would break "the only lease holder" and gets
            # "database is locked" at once instead.
            db.execute("PRAGMA locking_mode = EXCLUSIVE")
            db.execute("PRAGMA busy_timeout = 0")
            db.executescript(SCHEMA)
        except BaseException:
            db.close()
            raise
    return db
