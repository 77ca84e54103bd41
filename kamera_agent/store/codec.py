"""Serialization of store entries to safetensors bytes, one small codec per entry kind.

Why: the disk tier moves opaque, checksummed byte strings; only this module knows how a
`ChunkKV`, a vision embedding or a `Patch` becomes named tensors plus string metadata and
back. Every file carries its own address (kind, key, variant) and the model fingerprint in
the safetensors metadata, so a directory can be re-indexed from its files alone, and the
entry format (`FORMAT`): an entry of another format is refused by name (`OutdatedEntry`),
never deserialized under rules it was not written by.

    kind        tensors                                    metadata beyond the address
    canonical   keys [L, Hk, n, Dk], values [L, Hv, n, Dv],  -
    full        positions [n] | [3, n] when placed
    vision      the tower's outputs under their own names  -
    patch       "{layer}.{slot}.u" [n, m], ".v" [m, F]     num_tokens, patch_kind, state, meta (JSON)
    audit       error [1] (float64)                        state, left, tokens
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, cast

import torch
from safetensors.torch import load, save

from kamera_agent.operator.layout import ChunkKV
from kamera_agent.operator.patch import Patch
from kamera_agent.store.audits import DriftAudit
from kamera_agent.store.keys import EntryKey, EntryKind
from kamera_agent.store.signing import MAC_FIELD, Signer

__all__ = [
    "FORMAT",
    "CorruptEntry",
    "OutdatedEntry",
    "StoredValue",
    "content_digest",
    "deserialize",
    "entry_nbytes",
    "fingerprint_of",
    "header_info",
    "header_length",
    "outdated",
    "read_address",
    "serialize",
    "stamp",
]

StoredValue = ChunkKV | Patch | DriftAudit | dict[str, torch.Tensor]
Tensors = dict[str, torch.Tensor]
Meta = dict[str, str]
FORMAT = "kamera-store/4"
"""The entry format this version writes and reads; an entry of any other is never deserialized.
4: audits (`DriftAudit`, an entry kind of their own) and text chunk keys hashing the token ids'
bytes (every earlier text key means something else now);
3: text chunk keys and state roots made anew (every earlier key means something else now);
2: patches filed by the state they give (chained identity)."""
_MAX_HEADER = 64 << 20  # a header larger than this is damage, not metadata


class CorruptEntry(Exception):
    """Bytes that do not deserialize to the entry they claim to be (internal: never leaves the store)."""


class OutdatedEntry(CorruptEntry):
    """An entry written by another kamera-agent entry format: intact, but its keys and states
    were made by other rules, so it is dropped and recomputed, never deserialized."""


def outdated(found: str) -> OutdatedEntry:
    """The refusal of an entry of format ``found``, naming it and the one this version reads."""
    version = found.rsplit("/", 1)[-1]
    age = "a newer" if version.isdigit() and int(version) > int(FORMAT.rsplit("/", 1)[-1]) else "an older"
    return OutdatedEntry(
        f"written by {age} kamera-agent entry format ({found}); this version reads {FORMAT} "
        "and recomputes the entry"
    )


@dataclass(frozen=True)
class _Codec:
    tensors: Callable[[Any], Tensors]
    meta: Callable[[Any], Meta]
    build: Callable[[Tensors, Meta], Any]
    fingerprint: Callable[[Any], str]
    stamp: Callable[[Any, str], Any]


def _chunk_tensors(kv: ChunkKV) -> Tensors:
    tensors = {"keys": kv.keys, "values": kv.values}
    if kv.positions is not None:
        tensors["positions"] = kv.positions
    return tensors


def _chunk_build(tensors: Tensors, meta: Meta) -> ChunkKV:
    return ChunkKV(
        tensors["keys"], tensors["values"], tensors.get("positions"), meta["key"], meta["model_fingerprint"]
    )


def _patch_tensors(patch: Patch) -> Tensors:
    tensors = {}
    for (layer, slot), (u, v) in patch.factors.items():
        tensors[f"{layer}.{slot}.u"] = u  # [n, m]
        tensors[f"{layer}.{slot}.v"] = v  # [m, F]
    return tensors


def _patch_meta(patch: Patch) -> Meta:
    return {
        "num_tokens": str(patch.num_tokens),
        "patch_kind": patch.kind,
        "state": patch.state,
        "meta": json.dumps(patch.meta),
    }


def _patch_build(tensors: Tensors, meta: Meta) -> Patch:
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for name in tensors:
        stem, part = name.rsplit(".", 1)
        if part == "u":
            layer, slot = stem.split(".", 1)
            factors[(int(layer), slot)] = (tensors[name], tensors[f"{stem}.v"])
    return Patch(
        factors=dict(sorted(factors.items())),
        num_tokens=int(meta["num_tokens"]),
        chunk_key=meta["key"],
        state=meta["state"],
        model_fingerprint=meta["model_fingerprint"],
        kind="orbit" if meta["patch_kind"] == "orbit" else "exact",
        meta=dict(json.loads(meta["meta"])),
    )


def _stamped(value: Any, fingerprint: str) -> Any:
    """A frozen `ChunkKV`, `Patch` or `DriftAudit` carrying ``fingerprint``: itself when it does already."""
    return value if value.model_fingerprint == fingerprint else replace(value, model_fingerprint=fingerprint)


def _audit_build(tensors: Tensors, meta: Meta) -> DriftAudit:
    error = tensors["error"]
    if error.shape != (1,) or not 0 <= float(error[0]) < math.inf:
        raise ValueError(f"an audit's error is one finite number >= 0, got {error.tolist()}")
    tokens, fingerprint = int(meta["tokens"]), meta["model_fingerprint"]
    return DriftAudit(meta["key"], meta["state"], meta["left"], float(error[0]), tokens, fingerprint)


_CHUNK_KV = _Codec(
    tensors=_chunk_tensors,
    meta=lambda kv: {},
    build=_chunk_build,
    fingerprint=lambda kv: kv.model_fingerprint,
    stamp=lambda kv, fp: _stamped(kv, fp),
)
"""A canonical and a full state's KV are both a position-free `ChunkKV`."""

_CODECS: Mapping[EntryKind, _Codec] = MappingProxyType(
    {
        "canonical": _CHUNK_KV,
        "full": _CHUNK_KV,
        "vision": _Codec(
            tensors=lambda outputs: dict(outputs),
            meta=lambda outputs: {},
            build=lambda tensors, meta: tensors,
            fingerprint=lambda outputs: "",  # a bare dict records no model; the file metadata does
            stamp=lambda outputs, fp: dict(outputs),  # a copy: the caller's dict may change later
        ),
        "patch": _Codec(
            tensors=_patch_tensors,
            meta=_patch_meta,
            build=_patch_build,
            fingerprint=lambda patch: patch.model_fingerprint,
            stamp=lambda patch, fp: _stamped(patch, fp),
        ),
        "audit": _Codec(
            tensors=lambda audit: {"error": torch.tensor([audit.error], dtype=torch.float64)},
            meta=lambda audit: {"state": audit.state, "left": audit.left, "tokens": str(audit.tokens)},
            build=_audit_build,
            fingerprint=lambda audit: audit.model_fingerprint,
            stamp=lambda audit, fp: _stamped(audit, fp),
        ),
    }
)


def entry_nbytes(kind: EntryKind, value: StoredValue) -> int:
    """Bytes the entry holds: the sum of its tensors' ``nbytes`` (positions included)."""
    return sum([tensor.nbytes for tensor in _CODECS[kind].tensors(value).values()])


def fingerprint_of(kind: EntryKind, value: StoredValue) -> str:
    """The model fingerprint the entry carries (``""``: unknown)."""
    return _CODECS[kind].fingerprint(value)


def header_info(kind: EntryKind, value: StoredValue) -> Meta:
    """The metadata a serialized entry's header carries beyond its address (a patch's ``state``,
    ``meta``, ``num_tokens``, ``patch_kind``): what a planner peeks at, made from a live value."""
    return {**_CODECS[kind].meta(value), "format": FORMAT}


def stamp(kind: EntryKind, value: StoredValue, fingerprint: str) -> StoredValue:
    """The entry as the store holds it: carrying ``fingerprint``, detached from caller containers
    (a `ChunkKV` or `Patch` that carries it already is stored as it is: both are frozen)."""
    return cast(StoredValue, _CODECS[kind].stamp(value, fingerprint))


def serialize(key: EntryKey, value: StoredValue, fingerprint: str, signer: Signer | None = None) -> bytes:
    """Safetensors bytes of the entry, its address and fingerprint in the metadata (and, with a
    ``signer``, the MAC of its `content_digest`: `kamera_agent.store.signing`)."""
    codec = _CODECS[key.kind]
    meta = {
        **codec.meta(value),
        "format": FORMAT,
        "kind": key.kind,
        "key": key.key,
        "variant": key.variant,
        "model_fingerprint": fingerprint,
    }
    if signer is not None:
        meta[MAC_FIELD] = signer.sign(content_digest(key, value, fingerprint))
    return save(_for_disk(codec.tensors(value)), metadata=meta)


def content_digest(key: EntryKey, value: StoredValue, fingerprint: str) -> str:
    """A digest of what the entry holds (address, metadata, every tensor's dtype, shape and
    bytes), the same for equal entries: safetensors' own bytes are not (its header's order is
    not fixed), so two encodings of one entry must be compared by this."""
    codec = _CODECS[key.kind]
    digest = hashlib.sha256(
        json.dumps([key.kind, key.key, key.variant, fingerprint, codec.meta(value)], sort_keys=True).encode()
    )
    for name, tensor in sorted(_for_disk(codec.tensors(value)).items()):
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def deserialize(blob: bytes) -> tuple[EntryKey, StoredValue, str]:
    """``(address, entry, fingerprint)`` from bytes written by `serialize`.

    Raises:
        OutdatedEntry: an entry of another ``kamera-store/N`` format (never deserialized).
        CorruptEntry: the bytes are not a store entry (checked after the checksum, so this
            means a foreign format, not bit rot).
    """
    key, meta = _address(header_of(blob))
    try:
        tensors = load(blob)
        value = _CODECS[key.kind].build(tensors, meta)
    except (KeyError, ValueError, RuntimeError, TypeError, json.JSONDecodeError) as exc:
        raise CorruptEntry(f"{key} does not deserialize: {exc}") from exc
    return key, cast(StoredValue, value), meta["model_fingerprint"]


def read_address(prefix: bytes) -> tuple[EntryKey, str]:
    """``(address, fingerprint)`` from the leading bytes of a file: re-indexing needs no tensors."""
    key, meta = _address(header_of(prefix))
    return key, meta["model_fingerprint"]


def header_of(blob: bytes) -> Meta:
    """The ``__metadata__`` of a safetensors header (``u64`` length, then JSON)."""
    if len(blob) < 8:
        raise CorruptEntry("shorter than a safetensors header")
    size = int.from_bytes(blob[:8], "little")
    if size > _MAX_HEADER or 8 + size > len(blob):
        raise CorruptEntry(f"header of {size} bytes does not fit the file")
    try:
        header = json.loads(blob[8 : 8 + size])
        meta = header["__metadata__"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptEntry(f"unreadable header: {exc}") from exc
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptEntry("header metadata is not a string map")
    return cast(Meta, meta)


def header_length(prefix: bytes) -> int:
    """Bytes to read from the start of a file to hold its whole header (capped: damage is not read)."""
    return 8 + min(int.from_bytes(prefix[:8], "little"), _MAX_HEADER + 1) if len(prefix) >= 8 else 8


def _address(meta: Meta) -> tuple[EntryKey, Meta]:
    kind, found = meta.get("kind", ""), meta.get("format", "")
    if found.startswith("kamera-store/") and found != FORMAT:
        raise outdated(found)
    if found != FORMAT or kind not in _CODECS or "model_fingerprint" not in meta:
        raise CorruptEntry(f"not a {FORMAT} entry (format {found!r}, kind {kind!r})")
    return EntryKey(cast(EntryKind, kind), meta.get("key", ""), meta.get("variant", "")), meta


def _for_disk(tensors: Tensors) -> Tensors:
    """CPU, contiguous, one storage per tensor (safetensors refuses tensors that share memory)."""
    out: Tensors = {}
    storages: set[int] = set()
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages and t.numel() > 0:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out
