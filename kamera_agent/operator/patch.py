"""Conditioning patches: the low-rank part of what a chunk absorbs from the chunks before it.

Why: concatenating separately cached chunks loses only cross-chunk conditioning,
``Δ = KV(B|A) − KV(B|∅)``. Δ is low-rank in features, so per layer and slot we keep the top-m
SVD factors of the ``[n, heads·dim]`` deficit matrix. Keys are differenced in the
position-free frame (rotation mixes features per token and would inflate the rank), so one
patch serves every placement of the chunk behind the same antecedents:

    KV_at(B | A, positions) = rotate(canonical(B) + U_m V_m, positions)

Full rank reproduces ``KV(B|A)`` to float rounding; ``rank=0`` is blind reuse. An *orbit*
patch uses the mean deficit over several orderings of one antecedent set and serves them all.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file

from kamera_agent.errors import ForeignPatchError, LayoutMismatchError
from kamera_agent.operator.layout import (
    ChunkKV,
    KVLayout,
    Slot,
    check_layout,
    check_positions,
    to_position_free,
)
from kamera_agent.operator.rope import rotate

__all__ = [
    "Patch",
    "Rank",
    "apply_patch",
    "deficit",
    "form_orbit_patch",
    "form_patch",
    "load_patch",
    "merge_patches",
    "place_many",
    "save_patch",
    "select_layers",
]

Rank = int | float | Literal["full"]
"""An int keeps that many directions, a float in (0, 1) the fewest reaching that share of
the deficit's energy, ``"full"`` keeps all (exact)."""

LayerChoice = Literal["all", "deep_half"] | Sequence[int]
SvdMethod = Literal["auto", "exact", "randomized"]
_SLOTS: tuple[Slot, Slot] = ("keys", "values")


@dataclass(frozen=True, eq=False)
class Patch:
    """Low-rank factors of one chunk's deficit behind one antecedent context.

    Attributes:
        factors: ``{(layer, slot): (u [n, m], v [m, heads·dim])}``; ``u`` carries the singular
            values. Layers missing from it are not patched (layer-sparse variant).
        num_tokens: tokens of the chunk the patch was formed for.
        chunk_key: content key of that chunk.
        state: digest of the state the patch gives its chunk (`kamera_agent.core.identity`):
            what it encodes, chained over its antecedents' states.
        model_fingerprint: the model that formed it.
        kind: ``"exact"`` (one ordering) or ``"orbit"`` (mean over orderings).
    """

    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    num_tokens: int
    chunk_key: str = ""
    state: str = ""
    model_fingerprint: str = ""
    kind: Literal["exact", "orbit"] = "exact"
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(
            u.numel() * u.element_size() + v.numel() * v.element_size() for u, v in self.factors.values()
        )

    @property
    def ranks(self) -> dict[tuple[int, str], int]:
        return {key: int(u.shape[1]) for key, (u, _) in self.factors.items()}


def select_layers(choice: LayerChoice, num_layers: int) -> list[int]:
    """Resolve a layer choice: all, the deepest half (where the deficit lives), or explicit."""
    if choice == "all":
        return list(range(num_layers))
    if choice == "deep_half":
        return list(range(num_layers // 2, num_layers))
    layers = sorted({int(i) for i in choice})
    if not layers or layers[0] < 0 or layers[-1] >= num_layers:
        raise LayoutMismatchError(f"layers {list(choice)} must be within 0..{num_layers - 1}")
    return layers


def deficit(canonical: ChunkKV, conditioned: ChunkKV, layout: KVLayout) -> dict[Slot, torch.Tensor]:
    """``KV(B|A) − KV(B|∅)`` per slot, ``[L, n, heads·dim]`` float32, in the position-free frame."""
    _check_pair(canonical, conditioned, layout)
    free = to_position_free(conditioned, layout)
    return {slot: _as_matrix(free.slot(slot)) - _as_matrix(canonical.slot(slot)) for slot in _SLOTS}


def form_patch(
    canonical: ChunkKV,
    conditioned: ChunkKV | Sequence[ChunkKV],
    layout: KVLayout,
    rank: Rank,
    *,
    layers: LayerChoice = "all",
    method: SvdMethod = "auto",
    state: str = "",
    dtype: torch.dtype | None = None,
) -> Patch:
    """Top-m factors of the deficit of ``conditioned`` over the position-free ``canonical``; of
    the mean deficit when ``conditioned`` is several KVs (orderings of one antecedent set: an
    orbit patch, ``kind="orbit"``).

    Args:
        canonical: ``KV(B|∅)``, position-free (``positions is None``).
        conditioned: ``KV(B|A)`` as the model computed it, at any positions; or a sequence of
            them, one per ordering of the same antecedents.
        layout: the model's KV layout.
        rank: directions kept per layer and slot (see `Rank`).
        layers: which layers to patch.
        method: ``"exact"`` SVD, ``"randomized"`` (``torch.svd_lowrank``), or ``"auto"``:
            randomized when the rank is a small fixed share of a large matrix.
        state: the state digest recorded on the patch.
        dtype: storage dtype of the factors (default: the canonical's).
    """
    kind: Literal["exact", "orbit"] = "exact"
    if isinstance(conditioned, ChunkKV):
        deltas = deficit(canonical, conditioned, layout)
    else:
        if not conditioned:
            raise ValueError("an orbit patch needs at least one conditioned KV")
        per_order = [deficit(canonical, kv, layout) for kv in conditioned]
        deltas = {slot: torch.stack([d[slot] for d in per_order]).mean(0) for slot in _SLOTS}
        kind = "orbit"
    return _factorize(deltas, canonical, layout, rank, layers, method, state, dtype, kind)


def form_orbit_patch(
    canonical: ChunkKV, conditioned: Sequence[ChunkKV], layout: KVLayout, rank: Rank, **options: Any
) -> Patch:
    """Deprecated: ``form_patch(canonical, [kv, ...], layout, rank)`` forms the orbit patch."""
    warnings.warn(
        "form_orbit_patch is now form_patch with a sequence of conditioned KVs",
        DeprecationWarning,
        stacklevel=2,
    )
    return form_patch(canonical, list(conditioned), layout, rank, **options)


def merge_patches(
    patches: Sequence[Patch],
    rank: Rank,
    *,
    weights: Sequence[float] | None = None,
    state: str = "",
    kind: Literal["exact", "orbit"] = "orbit",
    meta: dict[str, str] | None = None,
) -> Patch:
    """Factors of the *mean* of several patches' deficits, at ``rank``, without forming ``[n, F]``.

    Why: an orbit patch is the mean deficit over the orderings of one antecedent set. Each
    ordering's exact patch is already stored, so the orbit is kept up to date by merging
    factors: stack ``[U_1/k … U_k/k]`` and ``[V_1; …; V_k]``, QR the tall left factor, and take
    the SVD of the small ``R · V`` core (``O(n·(km)²)``, no forward). ``weights`` (default
    equal) make it a weighted mean, e.g. an orbit of ``k`` orderings merged with one more.
    """
    if not patches:
        raise ValueError("merge_patches needs at least one patch")
    first = patches[0]
    for other in patches[1:]:
        if (other.chunk_key, other.num_tokens) != (first.chunk_key, first.num_tokens):
            raise ForeignPatchError("merge_patches got patches of different chunks; merge one chunk's")
    raw = [1.0] * len(patches) if weights is None else [float(w) for w in weights]
    if len(raw) != len(patches) or sum(raw) <= 0:
        raise ValueError("weights must give one positive number per patch")
    share = {id(patch): w / sum(raw) for patch, w in zip(patches, raw, strict=True)}
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for key in sorted({key for patch in patches for key in patch.factors}):
        parts = [(patch.factors[key], share[id(patch)]) for patch in patches if key in patch.factors]
        store_dtype = parts[0][0][0].dtype
        left = torch.cat([u.to(torch.float32) * w for (u, _), w in parts], dim=1)  # [n, Σm]
        right = torch.cat([v.to(torch.float32) for (_, v), _ in parts], dim=0)  # [Σm, F]
        q, r = torch.linalg.qr(left)  # [n, k], [k, Σm]
        core_u, singular, core_vh = torch.linalg.svd(r @ right, full_matrices=False)
        fixed = _fixed_rank(rank, len(singular))
        m = fixed if fixed is not None else _energy_rank(singular, float(rank))
        u = (q @ core_u[:, :m]) * singular[:m]
        factors[key] = (u.to(store_dtype).contiguous(), core_vh[:m].to(store_dtype).contiguous())
    return Patch(
        factors=factors,
        num_tokens=first.num_tokens,
        chunk_key=first.chunk_key,
        state=state,
        model_fingerprint=first.model_fingerprint,
        kind=kind,
        meta=dict(meta or {}),
    )


def apply_patch(
    canonical: ChunkKV, patch: Patch | None, layout: KVLayout, positions: torch.Tensor
) -> ChunkKV:
    """Place the chunk at ``positions`` with its conditioning restored: rotate(canonical + U V).

    ``patch=None`` is blind reuse (relocation only). The add and the rotation run in float32
    and round once to the canonical's dtype.
    """
    return place_many([(canonical, patch, positions)], layout)[0]


def place_many(
    chunks: Sequence[tuple[ChunkKV, Patch | None, torch.Tensor]], layout: KVLayout
) -> list[ChunkKV]:
    """`apply_patch` for several chunks with one rotation over all their tokens.

    Why: after a slide every survivor moves; rotating them together costs one pass over the
    window's rotary band instead of a call per chunk. A patched slot is added in float32 and the
    band rotated in float32, each rounded once to the chunk's own dtype, exactly as `apply_patch`
    does; a slot without factors (the unrotated one of an unpatched chunk) is passed through
    without a copy.
    """
    if not chunks:
        return []
    frees: list[ChunkKV] = []
    for canonical, patch, positions in chunks:
        if canonical.positions is not None:
            raise LayoutMismatchError("apply_patch needs the position-free canonical (positions is None)")
        check_layout(canonical, layout)
        check_positions(positions, canonical.num_tokens)
        frees.append(_patched(canonical, patch))
    slot = layout.rope_slot
    bands = [free.slot(slot).to(torch.float32) for free in frees]
    if len(frees) == 1:
        rotated = [rotate(bands[0], layout.rope, chunks[0][2])]
    else:
        together = rotate(torch.cat(bands, dim=2), layout.rope, torch.cat([w for _, _, w in chunks], dim=-1))
        rotated = list(together.split([free.num_tokens for free in frees], dim=2))
    placed = []
    for (canonical, _, where), free, band in zip(chunks, frees, rotated, strict=True):
        keys = band if slot == "keys" else free.keys
        values = band if slot == "values" else free.values
        placed.append(
            ChunkKV(
                keys.to(canonical.keys.dtype),
                values.to(canonical.values.dtype),
                where,
                canonical.chunk_key,
                canonical.model_fingerprint,
            )
        )
    return placed


def _patched(canonical: ChunkKV, patch: Patch | None) -> ChunkKV:
    """``canonical + U V`` position-free: each slot with factors added in float32 (a copy: the
    stored canonical is never written); a slot without factors is the canonical's own tensor."""
    if patch is None:
        return canonical
    _check_patch(canonical, patch)
    slots: dict[Slot, torch.Tensor] = {}
    for slot in _SLOTS:
        factors = [(layer, u, v) for (layer, name), (u, v) in patch.factors.items() if name == slot]
        if not factors:
            slots[slot] = canonical.slot(slot)
            continue
        x = canonical.slot(slot).to(torch.float32, copy=True)  # [L, H, n, D]
        for layer, u, v in factors:
            # Factors may live elsewhere (a store's disk tier loads them on the CPU).
            delta = u.to(x.device, torch.float32) @ v.to(x.device, torch.float32)  # [n, H·D]
            x[layer] += delta.view(x.shape[2], x.shape[1], x.shape[3]).transpose(0, 1)
        slots[slot] = x
    return ChunkKV(slots["keys"], slots["values"], None, canonical.chunk_key, canonical.model_fingerprint)


def save_patch(patch: Patch, path: str | Path) -> int:
    """Write a patch as safetensors; returns the bytes of its factors."""
    tensors = {}
    for (layer, slot), (u, v) in patch.factors.items():
        tensors[f"{layer}.{slot}.u"] = u.contiguous()
        tensors[f"{layer}.{slot}.v"] = v.contiguous()
    meta = {
        "num_tokens": str(patch.num_tokens),
        "chunk_key": patch.chunk_key,
        "state": patch.state,
        "model_fingerprint": patch.model_fingerprint,
        "kind": patch.kind,
        "meta": json.dumps(patch.meta, sort_keys=True),
    }
    save_file(tensors, str(path), metadata=meta)
    return patch.nbytes


def load_patch(path: str | Path) -> Patch:
    """Read a patch written by `save_patch`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
    tensors = load_file(str(path))
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for name in tensors:
        layer, slot, part = name.split(".")
        if part == "u":
            factors[(int(layer), slot)] = (tensors[name], tensors[f"{layer}.{slot}.v"])
    kind = meta.get("kind", "exact")
    return Patch(
        factors=dict(sorted(factors.items())),
        num_tokens=int(meta["num_tokens"]),
        chunk_key=meta.get("chunk_key", ""),
        state=meta.get("state", ""),
        model_fingerprint=meta.get("model_fingerprint", ""),
        kind="orbit" if kind == "orbit" else "exact",
        meta=json.loads(meta.get("meta", "{}")),
    )


def _factorize(
    deltas: dict[Slot, torch.Tensor],
    canonical: ChunkKV,
    layout: KVLayout,
    rank: Rank,
    layers: LayerChoice,
    method: SvdMethod,
    state: str,
    dtype: torch.dtype | None,
    kind: Literal["exact", "orbit"],
) -> Patch:
    chosen = select_layers(layers, layout.num_layers)
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for slot in _SLOTS:
        store_dtype = dtype or canonical.slot(slot).dtype
        for layer, (u, v) in zip(chosen, _low_rank(deltas[slot][chosen], rank, method), strict=True):
            factors[(layer, slot)] = (u.to(store_dtype), v.to(store_dtype))
    return Patch(factors, canonical.num_tokens, canonical.chunk_key, state, canonical.model_fingerprint, kind)


def _low_rank(
    matrices: torch.Tensor, rank: Rank, method: SvdMethod
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per matrix of ``[L, n, F]``: ``(U·S [n, m], Vᵀ [m, F])`` for the chosen rank."""
    _, n, f = matrices.shape
    full = min(n, f)
    fixed = _fixed_rank(rank, full)
    randomized = method == "randomized" or (
        method == "auto" and fixed is not None and full >= 256 and fixed * 4 <= full
    )
    if randomized and fixed is not None and fixed > 0:
        q = min(full, fixed + 8)
        out = []
        for matrix in matrices:
            u, s, v = torch.svd_lowrank(matrix, q=q, niter=3)
            out.append(((u[:, :fixed] * s[:fixed]).contiguous(), v[:, :fixed].T.contiguous()))
        return out
    u, s, vh = torch.linalg.svd(matrices, full_matrices=False)  # [L, n, k], [L, k], [L, k, F]
    out = []
    for i in range(matrices.shape[0]):
        m = fixed if fixed is not None else _energy_rank(s[i], float(rank))
        out.append(((u[i, :, :m] * s[i, :m]).contiguous(), vh[i, :m].contiguous()))
    return out


def _fixed_rank(rank: Rank, full: int) -> int | None:
    """The rank as a count (capped at full rank), or ``None`` for an energy threshold."""
    if rank == "full":
        return full
    if isinstance(rank, bool) or not isinstance(rank, int | float):
        raise ValueError(f"rank must be an int >= 0, a float energy share in (0, 1), or 'full'; got {rank!r}")
    if isinstance(rank, int):
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        return min(rank, full)
    if not 0.0 < rank < 1.0:
        raise ValueError(f"an energy threshold must lie in (0, 1), got {rank}; pass an int for a fixed rank")
    return None


def _energy_rank(singular: torch.Tensor, share: float) -> int:
    energy = singular.double() ** 2
    total = float(energy.sum())
    if total == 0.0:
        return 0
    cumulative = torch.cumsum(energy, 0) / total
    return min(
        int(torch.searchsorted(cumulative, torch.tensor(share, dtype=torch.float64))) + 1, len(singular)
    )


def _as_matrix(slot: torch.Tensor) -> torch.Tensor:
    """``[L, H, n, D]`` → ``[L, n, H·D]`` float32: one feature row per token, heads side by side."""
    layers, heads, n, dim = slot.shape
    return slot.to(torch.float32).transpose(1, 2).reshape(layers, n, heads * dim)


def _check_pair(canonical: ChunkKV, conditioned: ChunkKV, layout: KVLayout) -> None:
    if canonical.positions is not None:
        raise LayoutMismatchError("the canonical must be position-free; call to_position_free on it first")
    check_layout(canonical, layout)
    check_layout(conditioned, layout)
    _same_chunk(canonical, conditioned, "conditioned KV is of", "they are not the same chunk")


def _check_patch(canonical: ChunkKV, patch: Patch) -> None:
    _same_chunk(
        canonical, patch, "patch was formed for", "use the patch stored under this chunk's content key"
    )
    for (layer, slot), (u, v) in patch.factors.items():
        tensor = canonical.slot(slot)  # type: ignore[arg-type]
        if layer >= tensor.shape[0] or v.shape[1] != tensor.shape[1] * tensor.shape[3]:
            raise LayoutMismatchError(
                f"patch factor for layer {layer} {slot} has {v.shape[1]} features, the chunk "
                f"{tensor.shape[1] * tensor.shape[3]} over {tensor.shape[0]} layers: another model's patch?"
            )
        if u.shape[0] != canonical.num_tokens or u.shape[1] != v.shape[0]:
            raise LayoutMismatchError(f"patch factors for layer {layer} {slot} are inconsistent")


def _same_chunk(canonical: ChunkKV, other: ChunkKV | Patch, what: str, fix: str) -> None:
    """Refuse KV or a patch of another chunk or model than ``canonical`` (`ForeignPatchError`)."""
    if other.num_tokens != canonical.num_tokens:
        raise ForeignPatchError(
            f"the {what} a {other.num_tokens}-token chunk, this chunk has {canonical.num_tokens}: {fix}"
        )
    _same("chunk", canonical.chunk_key, other.chunk_key)
    _same("model", canonical.model_fingerprint, other.model_fingerprint)


def _same(what: str, ours: str, theirs: str) -> None:
    if ours and theirs and ours != theirs:
        raise ForeignPatchError(
            f"{what} mismatch: this chunk is {ours[:16]}…, the patch/KV belongs to {theirs[:16]}…; "
            f"form a patch for this {what} (or look it up under the right key)"
        )
