"""Orbit folding: one ordering's formed KV merged into the mean over its antecedent set's orderings.

Why: an orbit patch serves every ordering of the same antecedent set (a reorder that keeps a
chunk's left-hand set), so each formation also folds what it computed into that mean. Filed by
the set's address (`orbit_key`), its state names the members in the order they were merged, so
an orbit that changed under an operation is never mistaken for the one planned.

Rank-m orbits are a merged patch on the canonical; a full-rank orbit is the mean deficit, so
canonical + orbit is the mean of the members' KVs: it is stored as that KV (no canonical needed),
with its membership in a factor-free entry at the set's address (what planning peeks at). A
one-member orbit's mean is its member's KV, already stored under the member: it is not stored
again (`ChunkState.stored_as`). Why: every formation starts an orbit, so a second copy would
double what each re-formed chunk stages, commits and counts against the memory budget.
"""

from __future__ import annotations

import json
from dataclasses import replace

import torch

from kamera_agent.core.identity import ChunkState, Context, orbit_digest, orbit_key
from kamera_agent.core.staging import StagedStore
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.operator.patch import Patch, merge_patches

__all__ = ["fold_full_orbit", "fold_orbit"]


def fold_orbit(store: StagedStore, root: Context, member: ChunkState, patch: Patch) -> None:
    """Fold this ordering's rank-m ``patch`` into the orbit of ``member``'s antecedent set."""
    chunk_key = member.chunk_key
    address = orbit_key(chunk_key, member.rank, root, member.context)
    orbit = store.get_patch(chunk_key, address)
    members = _members(orbit.meta if orbit is not None else None)
    if member.digest in members:
        return
    if orbit is None:
        merged = merge_patches([patch], member.rank)
    else:
        merged = merge_patches([orbit, patch], member.rank, weights=[len(members), 1])
    members.append(member.digest)
    digest = orbit_digest(chunk_key, member.rank, root, address, members)
    meta = _members_meta(members)
    fingerprint = merged.model_fingerprint
    store.put_patch(
        Patch(merged.factors, merged.num_tokens, chunk_key, digest, fingerprint, "orbit", meta), address
    )


def fold_full_orbit(store: StagedStore, root: Context, member: ChunkState, kv: ChunkKV) -> None:
    """Fold this ordering's full KV into the mean KV over ``member``'s antecedent set's orderings."""
    chunk_key = member.chunk_key
    address = orbit_key(chunk_key, member.rank, root, member.context)
    info = store.patch_info(chunk_key, address)
    members = _members(info[1] if info is not None else None)
    if member.digest in members:
        return
    filed = (members[0] if len(members) == 1 else info[0]) if info is not None else ""
    previous = store.get_full(chunk_key, filed) if filed else None
    if previous is None:  # a first member (or the old mean left the store): its KV is the mean
        members = [member.digest]
        digest = orbit_digest(chunk_key, member.rank, root, address, members)
    else:
        mean = running_mean(previous, len(members), kv)
        members.append(member.digest)
        digest = orbit_digest(chunk_key, member.rank, root, address, members)
        store.put_full(mean, digest)
    meta = _members_meta(members)
    record = Patch({}, kv.num_tokens, chunk_key, digest, kv.model_fingerprint, "orbit", meta)
    store.put_patch(record, address)


def running_mean(mean: ChunkKV, count: int, kv: ChunkKV) -> ChunkKV:
    """The mean of ``count`` KVs (``mean``) and ``kv``: the orbit's tensor work, in fp32 (one
    pass: ``mean + (kv - mean) / (count + 1)``)."""
    weight = 1.0 / (count + 1)
    keys = torch.lerp(mean.keys.float(), kv.keys.float(), weight)
    values = torch.lerp(mean.values.float(), kv.values.float(), weight)
    return replace(kv, keys=keys.to(kv.keys.dtype), values=values.to(kv.values.dtype))


_HEX = frozenset("0123456789abcdef")


def _members_meta(members: list[str]) -> dict[str, str]:
    """An orbit entry's meta: its members' digests as a JSON list, the text ``json.dumps`` writes.

    Spelled out where every member is a hex digest (nothing to escape), because ``json.dumps``
    cost as much as the rest of a first member's fold, which every formation runs. Members read
    back from a store entry may hold anything (another process wrote it): those are encoded by
    ``json.dumps``, so no string can add or split a member."""
    if all(_HEX.issuperset(member) for member in members):
        return {"members": '["' + '", "'.join(members) + '"]' if members else "[]"}
    return {"members": json.dumps(members)}


def _members(meta: dict[str, str] | None) -> list[str]:
    return list(json.loads(meta.get("members", "[]"))) if meta is not None else []
