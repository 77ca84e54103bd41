"""Pure rotary functions: composition, inverses, layouts, M-RoPE axes, and bad input."""

from __future__ import annotations

import pytest
import torch

from kamera_agent.backends.transformers.families import FAMILIES
from kamera_agent.backends.transformers.reading import _mrope_axes
from kamera_agent.errors import LayoutMismatchError, PositionShapeError
from kamera_agent.operator.rope import RotarySpec, rerotate, rotary_angles, rotate, unrotate

INV_FREQ = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))  # [8]
SPECS = {
    "half": RotarySpec(INV_FREQ, "half"),
    "interleaved": RotarySpec(INV_FREQ, "interleaved"),
    "mrope-blocked": RotarySpec(INV_FREQ, "half", axes=torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])),
}


def _reference_rotate(x: torch.Tensor, spec: RotarySpec, angles: torch.Tensor) -> torch.Tensor:
    """Rotation written as complex multiplication in float64, pair by pair."""
    f = spec.num_freqs
    x = x.double()
    band = x[..., : 2 * f]
    if spec.pairing == "half":
        z = torch.complex(band[..., :f], band[..., f:]) * torch.polar(torch.ones_like(angles), angles)
        out = torch.cat((z.real, z.imag), -1)
    else:
        z = torch.complex(band[..., 0::2], band[..., 1::2]) * torch.polar(torch.ones_like(angles), angles)
        out = torch.stack((z.real, z.imag), -1).flatten(-2)
    return torch.cat((out, x[..., 2 * f :]), -1)


@pytest.mark.parametrize("name", SPECS)
def test_rotate_matches_complex_reference_and_keeps_pass_through_features(name: str) -> None:
    spec = SPECS[name]
    keys = torch.randn(2, 3, 5, 20)  # 4 pass-through features beyond the 16-wide band
    pos = torch.tensor([0, 3, 17, 250, 4095])
    got = rotate(keys, spec, pos)
    want = _reference_rotate(keys, spec, rotary_angles(spec, pos))
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
    assert torch.equal(got[..., 16:], keys[..., 16:])


@pytest.mark.parametrize("name", SPECS)
def test_unrotate_inverts_rotate(name: str) -> None:
    spec = SPECS[name]
    keys = torch.randn(4, 7, 16)
    pos = torch.randint(-50, 40000, (7,))
    torch.testing.assert_close(unrotate(rotate(keys, spec, pos), spec, pos), keys, rtol=0, atol=3e-6)


@pytest.mark.parametrize("name", SPECS)
def test_rerotate_composes_for_arbitrary_per_token_positions(name: str) -> None:
    spec = SPECS[name]
    keys = torch.randn(2, 9, 16)
    p0 = torch.randint(0, 5000, (9,))
    p1 = torch.randint(-100, 40000, (9,))  # per token, not a uniform shift; negative deltas too
    direct = rotate(keys, spec, p1)
    moved = rerotate(rotate(keys, spec, p0), spec, p0, p1)
    torch.testing.assert_close(moved, direct, rtol=0, atol=3e-6)


def test_mrope_positions_select_rows_per_frequency() -> None:
    spec = SPECS["mrope-blocked"]
    pos = torch.stack([torch.arange(5), torch.arange(5) * 10, torch.arange(5) * 100])  # t, h, w
    angles = rotary_angles(spec, pos)
    rows = pos[spec.axes].double().T  # [n, F]
    torch.testing.assert_close(angles, rows * INV_FREQ.double(), rtol=1e-6, atol=0)
    # Text tokens: one row given means t = h = w.
    flat = torch.arange(5)
    torch.testing.assert_close(rotary_angles(spec, flat), rotary_angles(spec, flat.expand(3, 5)))


def test_angles_equal_the_models_float32_angles() -> None:
    pos = torch.tensor([0, 1, 4096, 30000, 123457])
    model_angles = pos[:, None].float() * INV_FREQ  # what transformers computes
    assert torch.equal(rotary_angles(SPECS["half"], pos), model_angles.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_storage_round_trips_within_one_rounding(dtype: torch.dtype) -> None:
    spec = SPECS["half"]
    keys = torch.randn(3, 11, 16)
    pos = torch.arange(11) + 1000
    low = rotate(keys, spec, pos).to(dtype)
    back = unrotate(low, spec, pos)
    assert back.dtype == dtype
    eps = torch.finfo(dtype).eps
    # Two roundings (store, then after rotation): each at most eps/2 relative per element.
    err = (back.float() - keys).norm() / keys.norm()
    assert err < 2 * eps


def test_mrope_axes_tables_match_the_models_recomposition() -> None:
    blocked = _mrope_axes(FAMILIES["qwen2_vl"], [2, 3, 3], 8)
    interleaved = _mrope_axes(FAMILIES["qwen3_vl"], [2, 3, 3], 8)
    assert blocked is not None and interleaved is not None
    assert blocked.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert interleaved.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    real = _mrope_axes(FAMILIES["qwen3_vl"], [24, 20, 20], 64)
    assert real is not None and real.bincount().tolist() == [24, 20, 20]


def test_bad_positions_raise_named_errors() -> None:
    spec = SPECS["half"]
    keys = torch.randn(2, 5, 16)
    with pytest.raises(PositionShapeError, match="one position per token"):
        rotate(keys, spec, torch.arange(4))
    with pytest.raises(PositionShapeError, match="1-D RoPE"):
        rotate(keys, spec, torch.zeros(3, 5, dtype=torch.long))
    with pytest.raises(PositionShapeError, match="integers"):
        rotate(keys, spec, torch.arange(5).float())
    with pytest.raises(PositionShapeError, match=r"\[n\]"):
        rotate(keys, spec, torch.zeros(2, 2, 5, dtype=torch.long))
    with pytest.raises(LayoutMismatchError, match="head_dim"):
        rotate(torch.randn(2, 5, 8), spec, torch.arange(5))


def test_a_spec_with_frequencies_per_layer_rotates_each_layer_by_its_own() -> None:
    """Gemma 3's local layers rotate by base 10,000 and its global ones by 1,000,000: a per-layer
    spec equals rotating each layer alone with its own 1-D spec, and round-trips."""
    local = INV_FREQ
    far = 1.0 / (1e6 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    spec = RotarySpec(torch.stack([local, far, local]), "half")  # [L=3, F]
    assert spec.per_layer and spec.num_freqs == 8
    keys = torch.randn(3, 2, 5, 16)  # [L, H, n, D]
    pos = torch.tensor([0, 3, 17, 250, 4095])
    got = rotate(keys, spec, pos)
    for layer, freqs in enumerate((local, far, local)):
        alone = rotate(keys[layer], RotarySpec(freqs, "half"), pos)
        torch.testing.assert_close(got[layer], alone, rtol=0, atol=0)
    torch.testing.assert_close(unrotate(got, spec, pos), keys, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[0], got[1])  # the bases differ: the test can fail


def test_a_per_layer_spec_refuses_keys_without_the_layer_axis() -> None:
    spec = RotarySpec(torch.stack([INV_FREQ, INV_FREQ * 0.5]), "half")
    with pytest.raises(LayoutMismatchError, match="layer axis first"):
        rotate(torch.randn(3, 5, 16), spec, torch.arange(5))  # 3 "layers" against 2
    with pytest.raises(LayoutMismatchError, match="per layer"):
        RotarySpec(torch.stack([INV_FREQ, INV_FREQ]), "half", axes=torch.zeros(8, dtype=torch.long))
