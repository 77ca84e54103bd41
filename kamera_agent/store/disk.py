"""The disk tier: entries spilled from memory, one checksummed safetensors file each.

Why: a canonical pushed out of memory should cost a file read, not a vision encode and a
prefill, and should survive the process. Files are written atomically (temp file in the same
directory, fsync, ``os.replace``), so a crash leaves either the old state or the new file,
never half a file under a real name.

Where the checksum lives: in the file *name*, ``{kind}-{address digest}.{sha256}.safetensors``.
The sha256 covers every byte of the file (header included), so it cannot sit inside the file's
own metadata; a sidecar would be a second file to write atomically and could disagree with
its data after a crash. The name is renamed into place together with the bytes it describes,
so the two can never disagree, and a re-index needs no hashing. The digest is verified on
every read; a mismatch (bit rot, truncation, a foreign write) deletes the file and is
reported, never served. A file of another entry format (`codec.FORMAT`: written by an older
kamera-agent, whose keys and states meant something else) is dropped when the directory is
opened, with an ``outdated`` event naming both formats, and its entry is recomputed.

``index.json`` keeps each file's address, entry format and use ticks so a reopened store keeps
its LRU order without reading headers (a record of another format is not trusted: its header is
read again). It is advisory: written atomically but not fsynced, and reconciled
with a directory scan on open (files it misses are re-indexed from their headers, entries
whose file is gone are forgotten, a missing or unreadable index is rebuilt). One process
writes a directory at a time, enforced by an exclusive lock on ``.kamera.lock`` (a second
process gets `StoreDirectoryError`; processes share entries through ``store_url`` instead).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import re
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kamera_agent.errors import StoreDirectoryError
from kamera_agent.store import codec
from kamera_agent.store.budget import EvictionPolicy, pick_victim
from kamera_agent.store.codec import (
    CorruptEntry,
    OutdatedEntry,
    content_digest,
    deserialize,
    header_length,
    header_of,
    read_address,
)
from kamera_agent.store.keys import EntryKey
from kamera_agent.store.stats import EventKind, EventLog, StoreEvent
from kamera_agent.store.tier import Entry, Lookup, Meta, Payload, Status, Tier, Write

__all__ = ["DiskTier"]

_LOG = logging.getLogger(__name__)
_INDEX = "index.json"
_LOCK = ".kamera.lock"
_INDEX_FORMAT = "kamera-store-index/1"
_NAME = re.compile(r"^(canonical|full|vision|patch|audit)-([0-9a-f]{32})\.([0-9a-f]{64})\.safetensors$")
_TEMP_PREFIX = ".kamera-"


@dataclass
class _File:
    """One file of the tier (fields double as the `EntryInfo` a policy scores)."""

    key: EntryKey
    name: str
    nbytes: int  # file size
    fingerprint: str
    inserted: int
    last_used: int
    hits: int = 0
    format: str = ""  # the entry format of the file (`codec.FORMAT` when it was written)

    @property
    def sha256(self) -> str:
        return self.name.split(".")[1]


class DiskTier(Tier):
    """Files under ``directory`` within ``budget`` bytes, evicted by ``policy``.

    Not thread-safe on its own (``locked``): the `ChunkStore` calls it under its lock. Its
    files are filled by memory's spills, not by every put (``written_on_put`` is off).

    Args:
        directory: where the files live (created if missing).
        budget: the most file bytes kept.
        policy: which file leaves first when over budget.
        log: where spills, evictions and corrupt files are reported.
        in_memory: whether the memory tier still holds an entry (a file evicted then is no loss).
    """

    name = "disk"

    def __init__(
        self,
        directory: Path,
        budget: int,
        policy: EvictionPolicy,
        log: EventLog,
        in_memory: Callable[[EntryKey], bool],
    ) -> None:
        self.directory = directory
        self.budget: int = budget
        self.location = str(directory)
        self._policy = policy
        self._log = log
        self._in_memory = in_memory
        self._files: dict[EntryKey, _File] = {}
        self._bytes = 0
        self._clock = itertools.count()
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _lock(directory)
            self._release = weakref.finalize(self, os.close, self._lock_fd)
            self._open()
        except StoreDirectoryError:
            raise
        except OSError as exc:
            if hasattr(self, "_release"):
                self._release()
            raise StoreDirectoryError(
                f"disk_dir {directory} cannot be used: {exc.strerror or exc}; pass a directory this "
                "process can create, read and write"
            ) from exc

    @property
    def closed(self) -> bool:
        """Whether `close` released the directory (nothing is written to it any more)."""
        return not self._release.alive

    def close(self) -> None:
        """Save the index and let another process open the directory (idempotent)."""
        if self._release.alive:
            self.save_index()
            self._release()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, key: EntryKey) -> bool:
        return key in self._files

    def keys(self) -> list[EntryKey]:
        return list(self._files)

    def touch(self, key: EntryKey) -> None:
        self._files[key].last_used = next(self._clock)

    def put(self, entry: Entry) -> Write:
        """Write the entry's file; older files are evicted first to make room (the new file is
        never its own victim). Not ``ok`` (and nothing written) when it cannot be stored."""
        blob = entry.serialize()
        if len(blob) > self.budget:
            return Write(
                False, f"its file of {len(blob)} bytes exceeds the disk budget of {self.budget} bytes"
            )
        key = entry.key
        self.remove(key)
        while self._bytes + len(blob) > self.budget:
            self._evict_one()
        name = f"{key.kind}-{key.digest}.{hashlib.sha256(blob).hexdigest()}.safetensors"
        try:
            _atomic_write(self.directory, name, blob)
        except OSError as exc:
            return Write(False, f"writing {name} failed: {exc}")
        tick = next(self._clock)
        written = header_of(blob).get("format", "")
        self._add(_File(key, name, len(blob), entry.fingerprint, tick, tick, format=written))
        self.save_index()
        return Write.done()

    def get(self, key: EntryKey) -> Lookup[Payload]:
        """The file's bytes once their sha256 matches its name; deleted (and reported) otherwise."""
        record = self._files.get(key)
        if record is None:
            return Lookup.miss()
        try:
            blob = (self.directory / record.name).read_bytes()
        except OSError as exc:
            return self._rejected(key, CorruptEntry(f"unreadable: {exc}"))
        if hashlib.sha256(blob).hexdigest() != record.sha256:
            return self._rejected(
                key, CorruptEntry(f"sha256 mismatch ({len(blob)} of {record.nbytes} bytes read)")
            )
        record.hits += 1
        self.touch(key)
        return Lookup.hit(blob)

    def contains(self, key: EntryKey) -> Status:
        return Status.HIT if key in self._files else Status.MISS

    def peek(self, key: EntryKey) -> Lookup[Meta]:
        """The file's header metadata, read without counting a hit (planning peeks at it);
        unavailable when it cannot be read (a later `get` verifies and reports the file), and
        dropped (``outdated``) when it is of another entry format."""
        if key not in self._files:
            return Lookup.miss()
        try:
            with (self.directory / self._files[key].name).open("rb") as handle:
                prefix = handle.read(8)
                prefix += handle.read(header_length(prefix) - len(prefix))
            read_address(prefix)  # refuses another entry format by name
            return Lookup.hit(header_of(prefix))
        except OutdatedEntry as exc:
            self.reject(key, exc)
            return Lookup.rejected(str(exc))
        except (OSError, CorruptEntry) as exc:
            return Lookup.unavailable(f"header unreadable: {exc}")

    def drop(self, key: EntryKey) -> None:
        """Delete the file of ``key`` if any (a re-put made it stale: not a loss, no event)."""
        self.remove(key)

    def reject(self, key: EntryKey, why: CorruptEntry) -> None:
        """Delete a file that failed verification or is of another entry format, and report it
        (a ``corrupt`` or ``outdated`` event); it is never served."""
        record = self._forget(key)
        kind: EventKind = "outdated" if isinstance(why, OutdatedEntry) else "corrupt"
        _LOG.warning("store: dropped %s file %s for %s: %s", kind, record.name, key, why)
        self._log.record(StoreEvent(kind, key, record.nbytes, not self._in_memory(key), str(why)))
        self.save_index()

    def _rejected(self, key: EntryKey, why: CorruptEntry) -> Lookup[Payload]:
        self.reject(key, why)
        return Lookup.rejected(str(why))

    def keep_if_same(self, key: EntryKey, digest: str) -> None:
        """Keep ``key``'s file when it holds the entry whose `content_digest` is ``digest`` (a
        re-put of the same entry), else delete it (it is stale)."""
        if key not in self._files:
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
        if key in self._files:
            self._forget(key)

    def save_index(self) -> None:
        """Record addresses and use ticks (advisory: a scan on open repairs a stale index)."""
        files = [{**asdict(record), "key": record.key._asdict()} for record in self._files.values()]
        blob = json.dumps({"format": _INDEX_FORMAT, "files": files}).encode()
        with contextlib.suppress(OSError):  # the files stay the truth; the next open rescans
            _atomic_write(self.directory, _INDEX, blob, durable=False)

    def _evict_one(self) -> None:
        victim = pick_victim(self._files, self._policy)
        if victim is None:
            return
        record = self._forget(victim)
        lost = not self._in_memory(victim)
        self._log.record(StoreEvent("disk_evict", victim, record.nbytes, lost, "over the disk budget"))

    def _add(self, record: _File) -> None:
        self._files[record.key] = record
        self._bytes += record.nbytes

    def _forget(self, key: EntryKey) -> _File:
        record = self._files.pop(key)
        self._bytes -= record.nbytes
        with contextlib.suppress(FileNotFoundError):
            (self.directory / record.name).unlink()
        return record

    def _open(self) -> None:
        """Rebuild the index from the directory: the index file only supplies ticks and addresses."""
        for leftover in self.directory.glob(f"{_TEMP_PREFIX}*.tmp"):  # a crash mid-write
            leftover.unlink(missing_ok=True)
        indexed = _read_index(self.directory / _INDEX)
        found: list[_File] = []
        written_at: dict[str, int] = {}
        for path in sorted(self.directory.iterdir()):
            match = _NAME.match(path.name)
            record = None if match is None else indexed.get(path.name) or self._from_header(path, match)
            if record is not None:
                stat = path.stat()
                record.nbytes, written_at[record.name] = stat.st_size, stat.st_mtime_ns
                found.append(record)
        unindexed = sorted(  # written after the last index save: newest of all, in write order
            (r for r in found if r.name not in indexed), key=lambda r: written_at[r.name]
        )
        start = 1 + max((r.last_used for r in found if r.name in indexed), default=-1)
        for offset, record in enumerate(unindexed):
            record.inserted = record.last_used = start + offset
        for record in sorted(found, key=lambda r: r.last_used):
            if record.key in self._files:  # two files for one address: keep the newer one
                self._forget(record.key)
            self._add(record)
        self._clock = itertools.count(1 + max((r.last_used for r in found), default=-1))
        while self._bytes > self.budget:
            self._evict_one()
        self.save_index()

    def _from_header(self, path: Path, match: re.Match[str]) -> _File | None:
        """Re-index a file from its header; an unreadable one (``corrupt``) or one of another
        entry format (``outdated``) is deleted and reported under the address its name gives
        (kind and digest: the content key itself is not read)."""
        try:
            with path.open("rb") as handle:
                prefix = handle.read(8)
                prefix += handle.read(header_length(prefix) - len(prefix))
            key, fingerprint = read_address(prefix)
            if key.kind != match.group(1) or key.digest != match.group(2):
                raise CorruptEntry(f"header says {key}, the name another address")
        except (OSError, ValueError, CorruptEntry) as exc:
            size = path.stat().st_size if path.exists() else 0
            path.unlink(missing_ok=True)
            detail = f"{path.name}: {exc}"
            kind: EventKind = "outdated" if isinstance(exc, OutdatedEntry) else "corrupt"
            _LOG.warning("store: dropped %s file %s", "unreadable" if kind == "corrupt" else kind, detail)
            unknown = EntryKey(match.group(1), match.group(2))  # type: ignore[arg-type]
            self._log.record(StoreEvent(kind, unknown, size, True, detail))
            return None
        return _File(key, path.name, 0, fingerprint, 0, 0, format=codec.FORMAT)


def _lock(directory: Path) -> int:
    """An exclusive lock on ``directory``'s lock file, held while the tier is open: two
    processes writing one directory would each evict by a budget that counts only its own
    files, and delete each other's writes in flight."""
    fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise StoreDirectoryError(
            f"disk_dir {directory} is in use by {holder}: one process writes a disk_dir at a time. Give "
            "each process its own disk_dir, or share entries between processes with store_url "
            "(a Valkey/Redis server)"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"process {os.getpid()}".encode())
    return fd


def _read_index(path: Path) -> dict[str, _File]:
    """Records by file name from ``index.json``; empty when missing or unreadable (then rescan).
    Records of another entry format are left out: their files' headers are read (and refused)."""
    try:
        data = json.loads(path.read_text())
        if data.get("format") != _INDEX_FORMAT:
            return {}
        records = [_File(**(item | {"key": EntryKey(**item["key"])})) for item in data["files"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    return {r.name: r for r in records if _names_itself(r) and r.format == codec.FORMAT}


def _names_itself(record: _File) -> bool:
    """The record's file name holds its own address (else the index is stale or edited)."""
    match = _NAME.match(record.name)
    return match is not None and (match.group(1), match.group(2)) == (record.key.kind, record.key.digest)


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
