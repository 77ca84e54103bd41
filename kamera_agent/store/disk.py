"""The disk tier: entries in one checksummed safetensors file each, shared by the processes of a machine.

Why: a canonical pushed out of memory should cost a file read, not a vision encode and a
prefill, and should survive the process; and the processes of one machine (an engine's
scheduler and workers, several servers, windows) should read what each of them wrote. Files are
written atomically (temp file in the same directory, fsync, ``os.replace``), so a crash or a
reader in another process sees either no file or the whole one, never half a file under a real
name.

Where the checksum lives: in the file *name*, ``{kind}-{address digest}.{sha256}.safetensors``.
The sha256 covers every byte of the file (header included), so it cannot sit inside the file's
own metadata; a sidecar would be a second file to write atomically and could disagree with
its data after a crash. The name is renamed into place together with the bytes it describes,
so the two can never disagree. The digest is verified on every read; a mismatch (bit rot,
truncation, a foreign write) deletes the file and is reported, never served. A file of another
entry format (`codec.FORMAT`: written by an older kamera-agent, whose keys and states meant
something else) is dropped when the directory is opened, with an ``outdated`` event naming both
formats, and its entry is recomputed.

The index (``index.sqlite``, `kamera_agent.store.disk_index`) keeps each file's address, entry
format and use ticks for every process at once: a lookup in one process finds a file another
wrote a moment ago, and the limit counts every process's files (a put and its evictions are one
transaction). It is reconciled with a directory scan when a process opens the folder (files it
misses are recorded from their headers, records whose file is gone are forgotten). A file that
vanishes under a reader (another process evicted or replaced it) is a miss, not damage.

By default the tier holds what memory evicts (a spill tier); ``shared`` makes every put a file
at once (``written_on_put``), which is what processes sharing entries through the folder need.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kamera_agent.errors import StoreDirectoryError
from kamera_agent.store import codec
from kamera_agent.store.codec import (
    CorruptEntry,
    OutdatedEntry,
    content_digest,
    deserialize,
    header_length,
    header_of,
    read_address,
)
from kamera_agent.store.disk_index import DiskIndex, Record
from kamera_agent.store.keys import EntryKey
from kamera_agent.store.limits import EvictionPolicy
from kamera_agent.store.stats import EventKind, EventLog, StoreEvent
from kamera_agent.store.tier import Entry, Lookup, Meta, Payload, Status, Tier, Write

__all__ = ["DiskTier"]

_LOG = logging.getLogger(__name__)
_NAME = re.compile(r"^(canonical|full|vision|patch|audit)-([0-9a-f]{32})\.([0-9a-f]{64})\.safetensors$")
_TEMP_PREFIX = ".kamera-"
STALE_TEMP = 3600.0
"""Seconds after which a temp file is a crash's leftover (younger ones may be another process's
write in flight)."""


class DiskTier(Tier):
    """Files under ``directory`` within ``limit`` bytes, evicted by ``policy``, shared by every
    process that opens ``directory``.

    Called under the `ChunkStore`'s lock (``locked``) in a process; processes share the folder
    through its index's transactions.

    Args:
        directory: where the files live (created if missing).
        limit: the most file bytes held (by every process's files together).
        policy: which file leaves first when over its limit.
        log: where spills, evictions and corrupt files are reported.
        in_memory: whether the memory tier still holds an entry (a file evicted then is no loss).
        shared: every put is written here at once (``written_on_put``), not only memory's spills.
    """

    name = "disk"

    def __init__(
        self,
        directory: Path,
        limit: int,
        policy: EvictionPolicy,
        log: EventLog,
        in_memory: Callable[[EntryKey], bool],
        *,
        shared: bool = False,
    ) -> None:
        self.directory = directory
        self.limit: int = limit
        self.location = str(directory)
        self.written_on_put = shared  # type: ignore[misc]  # an instance chooses this flag
        self._policy = policy
        self._log = log
        self._in_memory = in_memory
        self._index: DiskIndex | None = None
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._index = DiskIndex(directory)
            self._open()
        except (OSError, sqlite3.Error) as exc:
            self.close()
            why = getattr(exc, "strerror", None) or exc
            raise StoreDirectoryError(
                f"disk_dir {directory} cannot be used: {why}; pass a directory this process can "
                "create, read and write"
            ) from exc

    @property
    def closed(self) -> bool:
        """Whether `close` released the directory (nothing is written to it any more)."""
        return self._index is None

    def close(self) -> None:
        """Release the index (idempotent); the files stay for the next process."""
        index, self._index = self._index, None
        if index is not None:
            index.close()

    @property
    def index(self) -> DiskIndex:
        if self._index is None:
            raise StoreDirectoryError(f"the disk tier in {self.directory} is closed")
        return self._index

    @property
    def nbytes(self) -> int:
        return self.index.totals()[1]

    def __len__(self) -> int:
        return self.index.totals()[0]

    def __contains__(self, key: EntryKey) -> bool:
        return self.index.get(key) is not None

    def keys(self) -> list[EntryKey]:
        return list(self.index.records())

    def touch(self, key: EntryKey) -> None:
        self.index.used(key, hit=False)

    def put(self, entry: Entry) -> Write:
        """Write the entry's file; older files are evicted first to make room (the new file is
        never its own victim). Not ``ok`` (and nothing written) when it cannot be stored."""
        blob = entry.serialize()
        if len(blob) > self.limit:
            return Write(False, f"its file of {len(blob)} bytes exceeds the disk limit of {self.limit} bytes")
        key = entry.key
        name = f"{key.kind}-{key.digest}.{hashlib.sha256(blob).hexdigest()}.safetensors"
        try:
            _atomic_write(self.directory, name, blob)
        except OSError as exc:
            return Write(False, f"writing {name} failed: {exc}")
        record = Record(key, name, len(blob), entry.fingerprint, format=header_of(blob).get("format", ""))
        old, evicted = self.index.file(record, self.limit, self._policy)
        if old is not None and old.name != name:
            self._delete(old.name)
        for victim in evicted:
            self._evicted(victim)
        return Write.done()

    def get(self, key: EntryKey) -> Lookup[Payload]:
        """The file's bytes once their sha256 matches its name; deleted (and reported) otherwise."""
        record = self.index.get(key)
        if record is None:
            return Lookup.miss()
        try:
            blob = (self.directory / record.name).read_bytes()
        except FileNotFoundError:  # another process evicted or replaced it a moment ago
            self.index.forget(key, record.name)
            return Lookup.miss("its file went away")
        except OSError as exc:
            return self._rejected(key, CorruptEntry(f"unreadable: {exc}"))
        if hashlib.sha256(blob).hexdigest() != record.sha256:
            return self._rejected(
                key, CorruptEntry(f"sha256 mismatch ({len(blob)} of {record.nbytes} bytes read)")
            )
        self.index.used(key, hit=True)
        return Lookup.hit(blob)

    def contains(self, key: EntryKey) -> Status:
        return Status.HIT if key in self else Status.MISS

    def peek(self, key: EntryKey) -> Lookup[Meta]:
        """The file's header metadata, read without counting a hit (planning peeks at it);
        unavailable when it cannot be read (a later `get` verifies and reports the file), and
        dropped (``outdated``) when it is of another entry format."""
        record = self.index.get(key)
        if record is None:
            return Lookup.miss()
        try:
            prefix = _header_bytes(self.directory / record.name)
            read_address(prefix)  # refuses another entry format by name
            return Lookup.hit(header_of(prefix))
        except OutdatedEntry as exc:
            self.reject(key, exc)
            return Lookup.rejected(str(exc))
        except FileNotFoundError:
            self.index.forget(key, record.name)
            return Lookup.miss("its file went away")
        except (OSError, CorruptEntry) as exc:
            return Lookup.unavailable(f"header unreadable: {exc}")

    def drop(self, key: EntryKey) -> None:
        """Delete the file of ``key`` if any (a re-put made it stale: not a loss, no event)."""
        self.remove(key)

    def reject(self, key: EntryKey, why: CorruptEntry) -> None:
        """Delete a file that failed verification or is of another entry format, and report it
        (a ``corrupt`` or ``outdated`` event); it is never served."""
        record = self.index.forget(key)
        if record is None:
            return
        self._delete(record.name)
        kind: EventKind = "outdated" if isinstance(why, OutdatedEntry) else "corrupt"
        _LOG.warning("store: dropped %s file %s for %s: %s", kind, record.name, key, why)
        self._log.record(StoreEvent(kind, key, record.nbytes, not self._in_memory(key), str(why)))

    def _rejected(self, key: EntryKey, why: CorruptEntry) -> Lookup[Payload]:
        self.reject(key, why)
        return Lookup.rejected(str(why))

    def remove_if_changed(self, key: EntryKey, digest: str) -> None:
        """Delete ``key``'s file unless it holds the entry whose `content_digest` is ``digest`` (a
        re-put of the same entry): a file with other bytes is stale."""
        if key not in self:
            return
        blob = self.get(key).found  # verified; a damaged file is dropped and reported by the get
        try:
            address, value, fingerprint = deserialize(blob) if isinstance(blob, bytes) else (None, None, "")
        except CorruptEntry:
            address = None
        if address != key or content_digest(key, value, fingerprint) != digest:  # type: ignore[arg-type]
            self.remove(key)

    def remove(self, key: EntryKey) -> None:
        """Delete the file of ``key`` if any (a re-put made it stale: not a loss, no event)."""
        record = self.index.forget(key)
        if record is not None:
            self._delete(record.name)

    def _evicted(self, record: Record) -> None:
        self._delete(record.name)
        lost = not self._in_memory(record.key)
        self._log.record(StoreEvent("disk_evict", record.key, record.nbytes, lost, "over the disk limit"))

    def _delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.directory / name).unlink()

    def _open(self) -> None:
        """Reconcile the index with the folder: leftover temp files of a crash deleted, every
        entry file recorded (from its header where the index missed it), records of another
        entry format checked against their files, the limit held."""
        now = time.time()
        names = []
        for path in self.directory.iterdir():
            if path.name.startswith(_TEMP_PREFIX) and path.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    if now - path.stat().st_mtime > STALE_TEMP:
                        path.unlink()
            elif _NAME.match(path.name):
                names.append(path.name)
        for record in self.index.reconcile(names, self._from_header):
            with contextlib.suppress(CorruptEntry):
                self._check_format(record)
        for victim in self.index.evict_to(self.limit, self._policy):
            self._evicted(victim)

    def _check_format(self, record: Record) -> None:
        """A record that names another entry format (or none): its file's own header decides."""
        try:
            read_address(_header_bytes(self.directory / record.name))
        except OutdatedEntry as exc:
            self.reject(record.key, exc)
            raise
        except (OSError, CorruptEntry):
            return  # the first get verifies it, and reports it
        with self.index.writing() as db:
            db.execute(
                "UPDATE files SET format=? WHERE kind=? AND key=? AND variant=?", (codec.FORMAT, *record.key)
            )

    def _from_header(self, name: str) -> Record | None:
        """Record a file the index misses from its header; an unreadable one (``corrupt``) or one
        of another entry format (``outdated``) is deleted and reported under the address its name
        gives (kind and digest: the content key itself is not read)."""
        path = self.directory / name
        match = _NAME.match(name)
        assert match is not None
        try:
            key, fingerprint = read_address(_header_bytes(path))
            if key.kind != match.group(1) or key.digest != match.group(2):
                raise CorruptEntry(f"header says {key}, the name another address")
            size = path.stat().st_size
        except FileNotFoundError:
            return None  # another process removed it meanwhile
        except (OSError, ValueError, CorruptEntry) as exc:
            size = path.stat().st_size if path.exists() else 0
            path.unlink(missing_ok=True)
            detail = f"{name}: {exc}"
            kind: EventKind = "outdated" if isinstance(exc, OutdatedEntry) else "corrupt"
            _LOG.warning("store: dropped %s file %s", "unreadable" if kind == "corrupt" else kind, detail)
            unknown = EntryKey(match.group(1), match.group(2))  # type: ignore[arg-type]
            self._log.record(StoreEvent(kind, unknown, size, True, detail))
            return None
        return Record(key, name, size, fingerprint, format=codec.FORMAT)


def _header_bytes(path: Path) -> bytes:
    """The first bytes of an entry file, through its safetensors header."""
    with path.open("rb") as handle:
        prefix = handle.read(8)
        return prefix + handle.read(header_length(prefix) - len(prefix))


def _atomic_write(directory: Path, name: str, blob: bytes, *, durable: bool = True) -> None:
    """Write ``blob`` to ``directory / name`` so that readers see all of it or none of it."""
    fd, temp = tempfile.mkstemp(dir=directory, prefix=_TEMP_PREFIX, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(blob)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(temp, directory / name)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
