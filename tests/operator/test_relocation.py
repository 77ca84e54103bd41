"""Relocated canonicals equal the model's own KV at the target positions, for every family.

Ground truth is the model's forward over the same tokens at the target offset. Within a
chunk, attention depends only on relative positions, so those keys are exactly a rotation of
the keys at offset 0; what remains is float rounding, bounded below.
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import pytest
import torch

from kamera_agent.backends.transformers import kv_layout
from kamera_agent.operator import KVLayout, relocate, rerotate, to_position_free
from kamera_agent.operator.layout import ChunkKV, to_position_free_many
from kamera_agent.operator.rope import RotarySpec
from tests.kv_helpers import chunk_kv, rel_err
from tests.tiny_models import ALL_TEXT_FACTORIES, ALL_VL_FACTORIES, as_bf16, vl_image_inputs

N = 20
TEXT = sorted(ALL_TEXT_FACTORIES)
VL = sorted(ALL_VL_FACTORIES)


@cache
def _model(name: str) -> tuple[Any, KVLayout]:
    factory = {**ALL_TEXT_FACTORIES, **ALL_VL_FACTORIES}[name]
    model = factory()
    return model, kv_layout(model)


def _ids() -> torch.Tensor:
    return torch.randint(0, 500, (1, N), generator=torch.Generator().manual_seed(1))


def _other(slot: str) -> str:
    return "keys" if slot == "values" else "values"


@pytest.mark.parametrize("name", TEXT)
@pytest.mark.parametrize("offset", [0, 1, 7, 4096])
def test_relocated_canonical_equals_models_kv_at_offset(name: str, offset: int) -> None:
    model, layout = _model(name)
    canonical = to_position_free(chunk_kv(model, layout, torch.arange(N), input_ids=_ids()), layout)
    target = chunk_kv(model, layout, torch.arange(N) + offset, input_ids=_ids())
    placed = relocate(canonical, layout, target.positions)
    rope, plain = layout.rope_slot, _other(layout.rope_slot)
    assert rel_err(placed.slot(rope), target.slot(rope)) <= 2e-5
    # The position-free part (values, or MLA's latent) only differs by float32 rounding
    # of the forward itself: layer 0 is bit-for-bit the same at every offset.
    assert rel_err(placed.slot(plain), target.slot(plain)) <= 2e-5  # type: ignore[arg-type]
    assert torch.equal(placed.slot(plain)[0], target.slot(plain)[0])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", TEXT)
@pytest.mark.parametrize(("src", "dst"), [(4096, 4095), (4096, 0), (100, 3)])
def test_relocate_moves_keys_backwards(name: str, src: int, dst: int) -> None:
    model, layout = _model(name)
    at_src = chunk_kv(model, layout, torch.arange(N) + src, input_ids=_ids())
    at_dst = chunk_kv(model, layout, torch.arange(N) + dst, input_ids=_ids())
    moved = rerotate(at_src.slot(layout.rope_slot), layout.rope, at_src.positions, at_dst.positions)
    assert rel_err(moved, at_dst.slot(layout.rope_slot)) <= 2e-5


def _exact_rotate(x: torch.Tensor, spec: RotarySpec, positions: torch.Tensor) -> torch.Tensor:
    """Float64 rotation with float64 angles: the reference free of the model's float32 angles."""
    f = spec.num_freqs
    angles = positions.double()[:, None] * spec.inv_freq.double()[..., None, :]  # [n, F] or [L, n, F]
    if spec.per_layer:  # keys [L, H, n, D]: each layer by its own frequencies
        angles = angles[:, None]
    phase = torch.polar(torch.ones_like(angles), angles)
    x = x.double()
    band = x[..., : 2 * f]
    if spec.pairing == "half":
        z = torch.complex(band[..., :f], band[..., f:]) * phase
        out = torch.cat((z.real, z.imag), -1)
    else:
        z = torch.complex(band[..., 0::2], band[..., 1::2]) * phase
        out = torch.stack((z.real, z.imag), -1).flatten(-2)
    return torch.cat((out, x[..., 2 * f :]), -1)


@pytest.mark.parametrize("name", TEXT)
@pytest.mark.parametrize("offset", [30000, 40000])
def test_large_offsets_are_no_worse_than_the_models_own_float32_angles(name: str, offset: int) -> None:
    model, layout = _model(name)
    slot, base = layout.rope_slot, torch.arange(N)
    canonical = to_position_free(chunk_kv(model, layout, base, input_ids=_ids()), layout)
    # Float64 recomputation: the float64 model near 0 (where angles are exact enough),
    # moved to the offset with float64 angles.
    near_zero = chunk_kv(copy.deepcopy(model).double(), layout, base, input_ids=_ids())
    truth = _exact_rotate(_exact_rotate(near_zero.slot(slot), layout.rope, -base), layout.rope, base + offset)
    theirs = chunk_kv(model, layout, base + offset, input_ids=_ids()).slot(slot)
    ours = relocate(canonical, layout, base + offset).slot(slot)
    model_error = rel_err(theirs, truth)
    assert model_error > 1e-6  # the float32 angle error is real at this offset
    assert rel_err(ours, truth) <= 2 * model_error
    assert rel_err(ours, theirs) <= 2 * model_error


@pytest.mark.parametrize("name", ["llama", "qwen2", "glm", "deepseek_v2", "deepseek_v3", "yarn", "gemma3"])
def test_bf16_relocation_stays_within_the_models_own_bf16_floor(name: str) -> None:
    model, _ = _model(name)
    low = as_bf16(model)
    layout = kv_layout(low)
    slot, base = layout.rope_slot, torch.arange(N)
    canonical = to_position_free(chunk_kv(low, layout, base, input_ids=_ids()), layout)
    assert canonical.keys.dtype == torch.bfloat16
    target = base + 4096
    theirs = chunk_kv(low, layout, target, input_ids=_ids()).slot(slot)
    exact = chunk_kv(model, layout, target, input_ids=_ids()).slot(slot)
    ours = relocate(canonical, layout, target).slot(slot)
    floor = rel_err(theirs, exact)  # the model's own bf16 rounding at the target
    assert ours.dtype == torch.bfloat16
    assert rel_err(ours, exact) <= 1.5 * floor
    assert rel_err(ours, theirs) <= 2 * floor


def test_wrong_pairing_is_detected_by_the_models_own_keys() -> None:
    """DeepSeek-V2 caches k_pe interleaved, V3 half-split: swapping them is far off."""
    for name, wrong in (("deepseek_v2", "half"), ("deepseek_v3", "interleaved")):
        model, layout = _model(name)
        spec = RotarySpec(layout.rope.inv_freq, wrong)  # type: ignore[arg-type]
        at0 = chunk_kv(model, layout, torch.arange(N), input_ids=_ids())
        at9 = chunk_kv(model, layout, torch.arange(N) + 900, input_ids=_ids())
        moved = rerotate(at0.values, spec, at0.positions, at9.positions)
        assert rel_err(moved, at9.values) > 0.5


def _vl_positions(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own M-RoPE ids ``[3, n]`` for ``inputs`` (text after the image resumes past it)."""
    position_ids, _ = model.model.get_rope_index(
        inputs["input_ids"],
        image_grid_thw=inputs["image_grid_thw"],
        video_grid_thw=None,
        attention_mask=None,
        mm_token_type_ids=inputs["mm_token_type_ids"],
    )
    return position_ids[:, 0]


@pytest.mark.parametrize("name", VL)
@pytest.mark.parametrize("shift", [(0, 0, 0), (5, 9, 2), (4096, 4100, 4090), (-3, 1, 40)])
def test_mrope_image_tokens_relocate_under_per_axis_shifts(name: str, shift: tuple[int, int, int]) -> None:
    """An image chunk (vision tokens + text) moved by different t, h, w shifts."""
    model, layout = _model(name)
    inputs = vl_image_inputs(model, grid_thw=(1, 4, 6), text_ids=(7, 8, 9))
    base = _vl_positions(model, inputs)  # [3, n]
    assert not torch.equal(base[1], base[2])  # image tokens: h and w rows differ
    canonical = to_position_free(chunk_kv(model, layout, base, **inputs), layout)
    target_pos = base + torch.tensor(shift)[:, None]
    target = chunk_kv(model, layout, target_pos, **inputs)
    placed = relocate(canonical, layout, target_pos)
    assert rel_err(placed.keys, target.keys) <= 2e-5
    assert rel_err(placed.values, target.values) <= 2e-5


def _pieces(kv: ChunkKV, sizes: list[int], shifts: list[int]) -> list[ChunkKV]:
    """``kv`` cut into consecutive chunks, each moved on by its own shift (as one forward's run
    of chunks with placed chunks between them)."""
    assert kv.positions is not None
    out, at = [], 0
    for size, shift in zip(sizes, shifts, strict=True):
        rows = slice(at, at + size)
        moved = kv.positions[..., rows] + shift
        out.append(ChunkKV(kv.keys[:, :, rows], kv.values[:, :, rows], moved, f"c{at}", "fp"))
        at += size
    return out


@pytest.mark.parametrize("name", [*TEXT, *VL])
def test_one_rotation_over_a_run_equals_each_chunk_unrotated_alone(name: str) -> None:
    """`to_position_free_many` (one forward's chunks un-rotated together) gives each chunk exactly
    what `to_position_free` gives it alone (every rotation is per token), in tensors of its own;
    a chunk already position-free passes through, and chunks that cannot share a rotation are
    each un-rotated alone."""
    model, layout = _model(name)
    if name in VL:
        inputs = vl_image_inputs(model, grid_thw=(1, 4, 6), text_ids=(7, 8, 9))
        kv = chunk_kv(model, layout, _vl_positions(model, inputs), **inputs)
    else:
        kv = chunk_kv(model, layout, torch.arange(N) + 3, input_ids=_ids())
    n = kv.num_tokens
    run = _pieces(kv, [5, n - 12, 7], [0, 40, 4096])
    free = to_position_free(run[1], layout)
    together = to_position_free_many([run[0], free, run[1], run[2]], layout)
    alone = [to_position_free(c, layout) for c in (run[0], free, run[1], run[2])]
    assert together[1] is free
    for got, want in zip(together, alone, strict=True):
        assert got.positions is None and (got.chunk_key, got.model_fingerprint) == (want.chunk_key, "fp")
        for slot in ("keys", "values"):
            assert got.slot(slot).is_contiguous() or slot != layout.rope_slot  # type: ignore[arg-type]
            assert torch.equal(got.slot(slot), want.slot(slot))  # type: ignore[arg-type]  # bit for bit
    band = together[0].slot(layout.rope_slot)
    assert band.untyped_storage().nbytes() == band.numel() * band.element_size()  # its own bytes
    other = ChunkKV(run[2].keys.double(), run[2].values.double(), run[2].positions, "c", "fp")
    mixed = to_position_free_many([run[0], other], layout)  # two dtypes: each alone
    assert mixed[1].keys.dtype == torch.float64 and rel_err(mixed[0].keys, alone[0].keys) == 0


def test_the_old_name_at_positions_is_relocate_with_a_warning() -> None:
    from kamera_agent.operator import at_positions

    model, layout = _model(TEXT[0])
    kv = to_position_free(chunk_kv(model, layout, torch.arange(N), input_ids=_ids()), layout)
    with pytest.warns(DeprecationWarning, match="relocate"):
        old = at_positions(kv, layout, torch.arange(5, 5 + N))
    torch.testing.assert_close(old.keys, relocate(kv, layout, torch.arange(5, 5 + N)).keys)
