"""Rotary position embedding as pure functions: rotate, unrotate and relocate stored keys.

Why this module exists: a chunk's keys at two positions differ only by a RoPE rotation, and
rotations compose exactly (``R(q) R(-p) = R(q - p)``), so moving a cached chunk is arithmetic,
not a forward pass. Every layout our models use reduces to one description, `RotarySpec`:

- ``inv_freq`` ``[F]``: the model's own inverse frequencies (scaling already folded in), or
  ``[L, F]``, one row per decoder layer, where layers rotate by different bases (Gemma 3's
  local layers by 10,000, its global ones by 1,000,000): each layer is then relocated with its
  own frequencies, and the keys rotated must carry the layer axis first (``[L, ..., n, D]``);
- ``pairing``: which two features a frequency rotates, ``"half"`` (``x[i]`` with ``x[i + F]``,
  Llama/Qwen/DeepSeek-V3) or ``"interleaved"`` (``x[2i]`` with ``x[2i + 1]``, DeepSeek-V2, GLM);
- ``axes`` ``[F]``: for M-RoPE, the position row (0 = t, 1 = h, 2 = w) each frequency reads;
- ``rotary_dim`` = ``2F`` leading features of the head (partial rotary leaves the rest alone).

Angles are formed exactly as the model forms them (``float32(position) * float32(inv_freq)``
rounded to float32), so relocated keys match the model's own keys to rounding; differences
of angles and the cos/sin are taken in float64, where float32 would lose the phase at large
positions. Keys are rotated in float32 whatever their storage dtype.

The cos/sin tables are built on the keys' device: positions come from the host (a few bytes per
token, copied without a wait, `kamera_agent.critical_path.to_device`) and the spec's frequencies
are copied to each device once. A table built on the host and copied from pageable memory
would make the host wait for the engine's queue on every rotation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from kamera_agent.critical_path import to_device
from kamera_agent.errors import LayoutMismatchError, PositionShapeError

__all__ = [
    "Pairing",
    "RotarySpec",
    "rerotate",
    "rotary_angles",
    "rotate",
    "unrotate",
]

Pairing = Literal["half", "interleaved"]


@dataclass(frozen=True, eq=False)
class RotarySpec:
    """Everything needed to rotate a key band exactly as the model does.

    Attributes:
        inv_freq: ``[F]`` float32, the model's inverse frequencies, scaling included; ``[L, F]``
            where each of the ``L`` decoder layers has its own.
        pairing: ``"half"`` or ``"interleaved"``, how the rotary features form pairs.
        axes: ``[F]`` int64 position row per frequency for M-RoPE, or ``None`` for 1-D RoPE.
        rope_type: the model's rope type (``default``, ``linear``, ``llama3``, ``yarn`` ...).
        attention_scaling: constant the model multiplies cos/sin by (YaRN). Stored keys already
            carry it, and a pure rotation keeps it, so relocation never applies it again.
    """

    inv_freq: torch.Tensor
    pairing: Pairing
    axes: torch.Tensor | None = None
    rope_type: str = "default"
    attention_scaling: float = 1.0
    _on: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = field(
        default_factory=dict, init=False, repr=False
    )
    """``inv_freq`` (float32) and ``axes`` per device they were asked on (`tables_on`)."""

    def __post_init__(self) -> None:
        if self.inv_freq.ndim not in (1, 2):
            raise LayoutMismatchError(
                f"inv_freq must be [F] or, per layer, [L, F]; got shape {tuple(self.inv_freq.shape)}"
            )
        if self.pairing not in ("half", "interleaved"):
            raise LayoutMismatchError(f"pairing must be 'half' or 'interleaved', got {self.pairing!r}")
        if self.axes is not None and self.axes.shape != self.inv_freq.shape[-1:]:
            raise LayoutMismatchError(
                f"M-RoPE axes {tuple(self.axes.shape)} must match inv_freq {tuple(self.inv_freq.shape)}"
            )
        if self.axes is not None and self.per_layer:
            raise LayoutMismatchError("M-RoPE with a rotary base per layer is not supported")

    @property
    def num_freqs(self) -> int:
        return int(self.inv_freq.shape[-1])

    @property
    def per_layer(self) -> bool:
        """Whether each decoder layer rotates by frequencies of its own (``inv_freq`` ``[L, F]``)."""
        return self.inv_freq.ndim == 2

    @property
    def rotary_dim(self) -> int:
        """Number of leading head features the rotation touches."""
        return 2 * self.num_freqs

    @property
    def is_mrope(self) -> bool:
        return self.axes is not None

    def tables_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``inv_freq`` as float32 and ``axes`` on ``device``, copied there once per device."""
        tables = self._on.get(device)
        if tables is None:
            inv_freq = to_device(self.inv_freq.to(torch.float32), device)
            axes = None if self.axes is None else to_device(self.axes, device)
            tables = self._on[device] = (inv_freq, axes)
        return tables


def rotary_angles(spec: RotarySpec, positions: torch.Tensor) -> torch.Tensor:
    """Per-token, per-frequency angles, formed as the model forms them.

    Args:
        spec: the rotary description.
        positions: ``[n]`` integer positions, or ``[3, n]`` (t, h, w) rows for M-RoPE. A 1-D
            vector given to an M-RoPE spec means t = h = w (text tokens), as the model does.

    Returns:
        ``[n, F]`` float64 angles, each equal to the model's float32 angle; ``[L, n, F]`` for a
        spec with frequencies per layer.
    """
    pos = _check_positions(spec, positions)  # [n] or [3, n]
    inv_freq, axes = spec.tables_on(pos.device)  # [F] or [L, F] float32; [F]
    if spec.per_layer:
        angles32 = pos.to(torch.float32)[None, :, None] * inv_freq[:, None, :]  # [L, n, F]
    elif pos.ndim == 1:
        angles32 = pos.to(torch.float32)[:, None] * inv_freq  # [n, F]
    else:
        assert axes is not None
        rows = pos.to(torch.float32)[axes]  # [F, n]: each frequency's row
        angles32 = rows.T * inv_freq  # [n, F]
    return angles32.to(torch.float64)


def rotate(keys: torch.Tensor, spec: RotarySpec, positions: torch.Tensor) -> torch.Tensor:
    """Give position-free keys their rotary phase at ``positions``.

    Args:
        keys: ``[..., n, D]`` with ``D >= spec.rotary_dim``; features past the band pass through.
            A spec with frequencies per layer needs the layer axis first: ``[L, ..., n, D]``.
        spec: the rotary description.
        positions: ``[n]`` or ``[3, n]``.

    Returns:
        Rotated keys, same shape and dtype as ``keys``.
    """
    return _apply_angles(keys, spec, rotary_angles(spec, _beside(keys, positions)))


def unrotate(keys: torch.Tensor, spec: RotarySpec, positions: torch.Tensor) -> torch.Tensor:
    """Remove the rotary phase keys received at ``positions``: this is how a chunk is stored."""
    return _apply_angles(keys, spec, -rotary_angles(spec, _beside(keys, positions)))


def rerotate(
    keys: torch.Tensor, spec: RotarySpec, from_positions: torch.Tensor, to_positions: torch.Tensor
) -> torch.Tensor:
    """Move keys rotated at ``from_positions`` to ``to_positions`` in one rotation (the key-level
    step; a chunk's KV is moved by `kamera_agent.operator.relocate`).

    The angle difference is taken in float64 between the two model-rounded angles, so the
    result equals ``rotate(unrotate(keys, from), to)`` without the intermediate rounding.
    Per-token positions are arbitrary (not only a uniform shift); negative shifts are fine.
    """
    to_angles = rotary_angles(spec, _beside(keys, to_positions))
    return _apply_angles(keys, spec, to_angles - rotary_angles(spec, _beside(keys, from_positions)))


def _beside(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``positions`` on the keys' device, where their cos/sin tables are then built."""
    if not isinstance(positions, torch.Tensor):
        positions = torch.as_tensor(positions)
    return to_device(positions, keys.device)


def _check_positions(spec: RotarySpec, positions: torch.Tensor) -> torch.Tensor:
    if not isinstance(positions, torch.Tensor):
        positions = torch.as_tensor(positions)
    if positions.is_floating_point() or positions.is_complex():
        raise PositionShapeError(
            f"positions must be integers, got dtype {positions.dtype}; pass a LongTensor of token positions"
        )
    if positions.ndim == 1:
        return positions
    if positions.ndim == 2 and positions.shape[0] == 3:
        if not spec.is_mrope:
            raise PositionShapeError(
                f"got M-RoPE positions of shape {tuple(positions.shape)} for a 1-D RoPE model; "
                "pass one row [n] of positions"
            )
        return positions
    raise PositionShapeError(
        f"positions must be [n] or, for M-RoPE, [3, n] (t, h, w); got shape {tuple(positions.shape)}"
    )


def _apply_angles(keys: torch.Tensor, spec: RotarySpec, angles: torch.Tensor) -> torch.Tensor:
    """Rotate the rotary band of ``keys`` by ``angles`` ``[n, F]`` or, per layer, ``[L, n, F]``
    (float64)."""
    n, f = angles.shape[-2:]
    if keys.ndim < 2 or keys.shape[-2] != n:
        raise PositionShapeError(
            f"keys {tuple(keys.shape)} need one position per token along dim -2; got {n} positions"
        )
    if angles.ndim == 3:  # [L, n, F] against keys [L, ..., n, D]
        if keys.ndim < 3 or keys.shape[0] != angles.shape[0]:
            raise LayoutMismatchError(
                f"keys {tuple(keys.shape)} need the layer axis first with {angles.shape[0]} layers: this "
                "model rotates each layer by its own frequencies"
            )
        angles = angles.reshape(angles.shape[0], *([1] * (keys.ndim - 3)), n, f)
    if keys.shape[-1] < 2 * f:
        raise LayoutMismatchError(
            f"keys have {keys.shape[-1]} features but the rotary band needs {2 * f}; "
            "were these keys made by a model with a different head_dim?"
        )
    cos = torch.cos(angles).to(device=keys.device, dtype=torch.float32)  # [n, F] or [L, 1.., n, F]
    sin = torch.sin(angles).to(device=keys.device, dtype=torch.float32)  # on the keys' device: a cast
    x = keys.to(torch.float32)
    band = x[..., : 2 * f]
    # each pair (a, b) becomes (a cos - b sin, b cos + a sin): one product over the whole band,
    # one multiply-add with its pair-swapped copy. Why not a product per half and term: on a CPU
    # those four strided half-width passes ran 2-2.5x slower (100 and 1,000 tokens of the demo).
    if spec.pairing == "half":
        swapped = torch.cat((band[..., f:], band[..., :f]), dim=-1)
        cos_band, sin_band = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    else:  # interleaved: pairs at (2k, 2k + 1)
        swapped = band.unflatten(-1, (f, 2)).flip(-1).flatten(-2)
        cos_band = cos.repeat_interleave(2, dim=-1)
        sin_band = torch.stack((-sin, sin), dim=-1).flatten(-2)
    out = band * cos_band
    out.addcmul_(swapped, sin_band)
    if x.shape[-1] > 2 * f:  # features past the band pass through
        out = torch.cat((out, x[..., 2 * f :]), dim=-1)
    return out.to(keys.dtype)
