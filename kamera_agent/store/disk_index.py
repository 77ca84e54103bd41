"""The disk tier's index: one SQLite file every process of a ``disk_dir`` reads and writes.

Why SQLite (the standard library's, no dependency): several processes of one machine share a
``disk_dir`` (an engine's scheduler and workers, several servers, windows). Each must see the
files the others wrote, and the limit must count all of them, or two writers would each evict
by their own share and delete each other's files. SQLite gives every process one consistent
view and serializes writers with its own file lock: a put, its evictions and its record are
one transaction (``BEGIN IMMEDIATE``), a lookup is one indexed read. WAL mode lets readers go
on while one process writes; commits are not fsynced (``synchronous=NORMAL``): the files are
the truth, and a record lost in a crash is found again by the scan when the folder is opened.

Ticks (``inserted``, ``last_used``) come from one counter in the database, so "least recently
used" means the same across processes. The index holds no tensor bytes; the files do.

    files(kind, key, variant) -> name, nbytes, fingerprint, inserted, last_used, hits, format
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kamera_agent.store.keys import EntryKey
from kamera_agent.store.limits import EvictionPolicy, pick_victim

__all__ = ["DiskIndex", "Record"]

NAME = "index.sqlite"
_BUSY = 30.0  # seconds a process waits for another's write transaction (they last milliseconds)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    kind TEXT NOT NULL, key TEXT NOT NULL, variant TEXT NOT NULL,
    name TEXT NOT NULL, nbytes INTEGER NOT NULL, fingerprint TEXT NOT NULL,
    inserted INTEGER NOT NULL, last_used INTEGER NOT NULL, hits INTEGER NOT NULL DEFAULT 0,
    format TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (kind, key, variant)
);
CREATE TABLE IF NOT EXISTS clock (id INTEGER PRIMARY KEY CHECK (id = 0), tick INTEGER NOT NULL);
INSERT OR IGNORE INTO clock VALUES (0, 0);
"""
_COLUMNS = "kind, key, variant, name, nbytes, fingerprint, inserted, last_used, hits, format"


@dataclass
class Record:
    """One file of the tier (its fields double as the `EntryInfo` a policy scores)."""

    key: EntryKey
    name: str
    nbytes: int  # the file's size
    fingerprint: str
    inserted: int = 0
    last_used: int = 0
    hits: int = 0
    format: str = ""  # the entry format of the file (`codec.FORMAT` when it was written)

    @property
    def sha256(self) -> str:
        return self.name.split(".")[1]

    def row(self) -> tuple[str | int, ...]:
        k = self.key
        return (k.kind, k.key, k.variant, self.name, self.nbytes, self.fingerprint, self.inserted,
                self.last_used, self.hits, self.format)  # fmt: skip


def _record(row: tuple[str | int, ...]) -> Record:
    kind, key, variant, name, nbytes, fingerprint, inserted, last_used, hits, fmt = row
    address = EntryKey(str(kind), str(key), str(variant))  # type: ignore[arg-type]
    return Record(address, str(name), int(nbytes), str(fingerprint), int(inserted), int(last_used),
                  int(hits), str(fmt))  # fmt: skip


class DiskIndex:
    """The records of one ``disk_dir``, shared with every process that opens it.

    Thread-safe within a process (one connection behind a lock); across processes, SQLite's.

    Raises:
        sqlite3.Error: the index cannot be opened (the disk tier names the folder and the fix).
    """

    def __init__(self, directory: Path) -> None:
        self.path = directory / NAME
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.path, timeout=_BUSY, isolation_level=None, check_same_thread=False)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            with self.writing() as db:
                for statement in filter(str.strip, _SCHEMA.split(";")):
                    db.execute(statement)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def writing(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: other processes' writers wait until it ends."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # -- reads ---------------------------------------------------------------------------------
    def get(self, key: EntryKey) -> Record | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM files WHERE kind=? AND key=? AND variant=?", key
            ).fetchone()
        return None if row is None else _record(row)

    def records(self) -> dict[EntryKey, Record]:
        """Every record, by address."""
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM files").fetchall()
        return {r.key: r for r in map(_record, rows)}

    def totals(self) -> tuple[int, int]:
        """``(files, bytes)`` of the folder."""
        with self._lock:
            count, size = self._db.execute("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM files").fetchone()
        return int(count), int(size)

    # -- writes --------------------------------------------------------------------------------
    def used(self, key: EntryKey, *, hit: bool) -> None:
        """``key`` was read (``hit``: a get, counted) or kept again: it is the most recent now."""
        with self.writing() as db:
            tick = _tick(db)
            db.execute(
                "UPDATE files SET last_used=?, hits=hits+? WHERE kind=? AND key=? AND variant=?",
                (tick, int(hit), *key),
            )

    def file(self, record: Record, limit: int, policy: EvictionPolicy) -> tuple[Record | None, list[Record]]:
        """Record ``record`` (replacing its address's), evicting by ``policy`` until the folder
        fits ``limit``: ``(the record it replaced, the records evicted)``, whose files the
        caller deletes once this transaction is over."""
        with self.writing() as db:
            old = _take(db, record.key)
            rows = {r.key: r for r in map(_record, db.execute(f"SELECT {_COLUMNS} FROM files").fetchall())}
            size = sum(r.nbytes for r in rows.values())
            evicted = []
            while size + record.nbytes > limit and (victim := pick_victim(rows, policy)) is not None:
                evicted.append(rows.pop(victim))
                size -= evicted[-1].nbytes
                _take(db, victim)
            record.inserted = record.last_used = _tick(db)
            db.execute(f"INSERT INTO files ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)", record.row())
        return old, evicted

    def forget(self, key: EntryKey, name: str | None = None) -> Record | None:
        """Remove ``key``'s record (only where it still names file ``name``, when given: another
        process may have filed a newer one); the record removed, or ``None``."""
        with self.writing() as db:
            old = _take(db, key)
            if old is not None and name is not None and old.name != name:
                db.execute(f"INSERT INTO files ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)", old.row())
                return None
        return old

    def evict_to(self, limit: int, policy: EvictionPolicy) -> list[Record]:
        """Evict until the folder fits ``limit``; the records evicted."""
        with self.writing() as db:
            rows = {r.key: r for r in map(_record, db.execute(f"SELECT {_COLUMNS} FROM files").fetchall())}
            size, evicted = sum(r.nbytes for r in rows.values()), []
            while size > limit and (victim := pick_victim(rows, policy)) is not None:
                evicted.append(rows.pop(victim))
                size -= evicted[-1].nbytes
                _take(db, victim)
        return evicted

    def reconcile(self, names: Iterable[str], found: Callable[[str], Record | None]) -> list[Record]:
        """Make the records agree with the folder's entry files ``names``: a record whose file is
        gone is forgotten, a file without a record is recorded from ``found(name)`` (its header;
        ``None``: not an entry, the caller deleted it), newest last. Returns the records of
        another entry format, for the caller to check against their files."""
        present = set(names)
        with self.writing() as db:
            rows = [_record(r) for r in db.execute(f"SELECT {_COLUMNS} FROM files").fetchall()]
            for gone in (r for r in rows if r.name not in present):
                _take(db, gone.key)
            known = {r.name for r in rows}
            for name in sorted(present - known):
                record = found(name)
                if record is not None:
                    record.inserted = record.last_used = _tick(db)
                    db.execute(f"INSERT OR REPLACE INTO files ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)",
                               record.row())  # fmt: skip
        return [r for r in rows if r.name in present and r.format != _current_format()]


def _current_format() -> str:
    from kamera_agent.store import codec  # read at call time: a test may set an older one

    return codec.FORMAT


def _tick(db: sqlite3.Connection) -> int:
    (tick,) = db.execute("UPDATE clock SET tick=tick+1 WHERE id=0 RETURNING tick").fetchone()
    return int(tick)


def _take(db: sqlite3.Connection, key: EntryKey) -> Record | None:
    """Delete ``key``'s record inside a write transaction; the record deleted."""
    row = db.execute(f"SELECT {_COLUMNS} FROM files WHERE kind=? AND key=? AND variant=?", key).fetchone()
    if row is not None:
        db.execute("DELETE FROM files WHERE kind=? AND key=? AND variant=?", key)
    return None if row is None else _record(row)
