"""How a store entry sits in Valkey/Redis: key names, a framed head value, bounded parts.

Why this shape:
- **One hash slot per chunk.** Every key of a chunk carries the hash tag
  ``{<model fingerprint>:<chunk key>}``, so a cluster keeps a chunk's canonical, full KVs and
  patches (and an entry's parts) on one slot: multi-key reads of them are one round trip, and
  another model's entries can never share a name with this one's.

      kam:{<fingerprint>:<chunk key>}:canonical
      kam:{<fingerprint>:<chunk key>}:full:<state>
      kam:{<fingerprint>:<chunk key>}:patch:<state or orbit set key>
      kam:{<fingerprint>:<pixel key>}:vision
      <name>:part:<sha256[:16]>:<i>        the parts of a large entry

- **A reader never assembles a half-written entry.** The head value (magic, a JSON header,
  then the payload itself when it fits one value) is written *after* its parts, and the parts
  are named by the payload's digest, so they are immutable: a head always points at a
  complete set, or a set the server has since evicted, which the reader sees as missing.
- **Checked on every read.** The header holds the payload's sha256 and length; a payload that
  does not hash to it (bit flips, truncation, a part from another write) is never deserialized.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from kamera_agent.store import codec
from kamera_agent.store.codec import CorruptEntry, header_of
from kamera_agent.store.keys import EntryKey, EntryKind

__all__ = ["Head", "assemble", "check_head", "entry_name", "frame", "part_names", "read_head"]

MAGIC = b"KAMR"
FORMAT = "kamera-remote/1"
HEAD_PEEK = 64 << 10
"""Bytes a peek reads from the start of a head value: enough for any header we write."""
_PLAIN = re.compile(r"^[0-9A-Za-z_.-]{1,128}$")
_INFO_FIELDS = ("state", "meta", "num_tokens", "patch_kind")


@dataclass(frozen=True)
class Head:
    """The header of a stored entry.

    Attributes:
        address: the entry's `EntryKey`.
        fingerprint: the model fingerprint it was written by.
        sha256: the payload's digest (hex).
        nbytes: the payload's length.
        parts: how many part values hold the payload (0: it follows the header inline).
        info: the codec metadata a planner peeks at (a patch's state and meta), the payload's
            entry format and the tokens it holds (each absent from heads an older kamera-agent
            wrote).
    """

    address: EntryKey
    fingerprint: str
    sha256: str
    nbytes: int
    parts: int
    info: dict[str, str] = field(default_factory=dict)


def entry_name(prefix: str, fingerprint: str, key: EntryKey) -> str:
    """The head key of ``key``'s entry (see the module docstring)."""
    name = f"{prefix}:{{{fingerprint}:{key.key}}}:{key.kind}"
    if not key.variant:
        return name
    variant = key.variant if _PLAIN.match(key.variant) else hashlib.sha256(key.variant.encode()).hexdigest()
    return f"{name}:{variant}"


def part_names(name: str, head: Head) -> list[str]:
    """The keys holding ``head``'s parts, in order (they share the head's hash tag)."""
    return [f"{name}:part:{head.sha256[:16]}:{i}" for i in range(head.parts)]


def frame(
    key: EntryKey, fingerprint: str, payload: bytes, part_bytes: int, tokens: int | None = None
) -> tuple[Head, bytes, list[bytes]]:
    """``(header, head value, parts)`` for a serialized entry: the payload rides inline when it
    fits ``part_bytes``, else it is cut into parts of at most that size. ``tokens``: how many
    the entry holds, in its head (a reader's deadline: what recomputing them costs)."""
    digest = hashlib.sha256(payload).hexdigest()
    parts = (
        []
        if len(payload) <= part_bytes
        else [payload[i : i + part_bytes] for i in range(0, len(payload), part_bytes)]
    )
    info = _info(payload) | ({} if tokens is None else {"tokens": str(tokens)})
    header = {
        "format": FORMAT,
        "address": [key.kind, key.key, key.variant],
        "fingerprint": fingerprint,
        "sha256": digest,
        "nbytes": len(payload),
        "parts": len(parts),
        "info": info,
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    value = MAGIC + len(text).to_bytes(4, "little") + text
    head = Head(key, fingerprint, digest, len(payload), len(parts), info)
    return head, (value if parts else value + payload), parts


def read_head(value: bytes) -> tuple[Head, bytes]:
    """``(header, inline payload or b"")`` of a head value (or of its first `HEAD_PEEK` bytes).

    Raises:
        CorruptEntry: not a head this format writes.
    """
    if len(value) < 8 or value[:4] != MAGIC:
        raise CorruptEntry("not a kamera remote entry (bad magic)")
    size = int.from_bytes(value[4:8], "little")
    if 8 + size > len(value):
        raise CorruptEntry(f"header of {size} bytes does not fit the value")
    try:
        header: dict[str, Any] = json.loads(value[8 : 8 + size])
        kind, key, variant = header["address"]
        head = Head(
            EntryKey(kind, str(key), str(variant)),
            str(header["fingerprint"]),
            str(header["sha256"]),
            int(header["nbytes"]),
            int(header["parts"]),
            {str(k): str(v) for k, v in dict(header.get("info", {})).items()},
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptEntry(f"unreadable header: {exc}") from exc
    if header.get("format") != FORMAT or kind not in ("canonical", "full", "vision", "patch", "audit"):
        raise CorruptEntry(f"not a {FORMAT} entry")
    return head, value[8 + size :]


def check_head(head: Head, key: EntryKey, fingerprint: str, *, peek: bool = False) -> None:
    """Refuse a head of another entry format, model or address before reading any part. A
    head an older kamera-agent wrote names no format: a get reads on (the payload names its
    format when it is deserialized), a peek, which reads no payload, refuses it here.

    Raises:
        CorruptEntry: (`OutdatedEntry` for another format) the head is not ``key``'s of this model.
    """
    written = head.info.get("format")
    if written is None and peek:
        written = f"one before {codec.FORMAT}: its head names none"
    if written is not None and written != codec.FORMAT:
        raise codec.outdated(written)
    if head.fingerprint != fingerprint:
        theirs, ours = head.fingerprint[:16], fingerprint[:16]
        raise CorruptEntry(f"written by model {theirs}…, this store serves {ours}…")
    if head.address != key:
        raise CorruptEntry(f"holds {head.address}, not {key}")


def assemble(head: Head, inline: bytes, parts: list[bytes | None]) -> bytes:
    """The payload, checked against its header.

    Raises:
        CorruptEntry: a part missing (evicted or expired), or the bytes do not hash to the header.
    """
    if head.parts:
        if any(part is None for part in parts) or len(parts) != head.parts:
            raise CorruptEntry(f"{sum(p is None for p in parts)} of {head.parts} parts are gone")
        payload = b"".join(part for part in parts if part is not None)
    else:
        payload = inline
    if len(payload) != head.nbytes:
        raise CorruptEntry(f"{len(payload)} bytes where the header says {head.nbytes} (truncated)")
    if hashlib.sha256(payload).hexdigest() != head.sha256:
        raise CorruptEntry("payload does not match its sha256")
    return payload


def _info(payload: bytes) -> dict[str, str]:
    """The codec metadata worth a peek, from the payload's header: its entry format (a reader
    refuses another before fetching any part) and a patch's state and meta."""
    meta = header_of(payload)
    kind: EntryKind | str = meta.get("kind", "")
    info = {name: meta[name] for name in _INFO_FIELDS if kind == "patch" and name in meta}
    return {**info, "format": meta.get("format", "")}
