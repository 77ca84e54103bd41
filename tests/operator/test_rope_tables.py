"""Where the rotary tables are built: on the keys' device, the spec's frequencies copied there once."""

from __future__ import annotations

import pytest
import torch

from kamera_agent.critical_path import to_device
from kamera_agent.operator.rope import RotarySpec, rerotate, rotate, unrotate

INV_FREQ = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))  # [8]
MROPE = RotarySpec(INV_FREQ, "half", axes=torch.tensor([0, 0, 1, 1, 1, 2, 2, 2]))


def test_the_frequencies_are_copied_to_a_device_once() -> None:
    cpu = torch.device("cpu")
    inv_freq, axes = MROPE.tables_on(cpu)
    assert inv_freq.dtype == torch.float32 and axes is not None
    again = MROPE.tables_on(cpu)
    assert again[0] is inv_freq and again[1] is axes


def test_positions_given_as_a_list_are_rotated_as_a_tensor_would_be() -> None:
    keys = torch.randn(2, 3, 4, 16)
    positions = [0, 5, 9, 4000]
    want = rotate(keys, MROPE, torch.tensor(positions))
    assert torch.equal(rotate(keys, MROPE, positions), want)  # type: ignore[arg-type]
    assert torch.equal(unrotate(want, MROPE, positions), unrotate(want, MROPE, torch.tensor(positions)))  # type: ignore[arg-type]


def test_a_tensor_already_on_the_device_is_not_copied() -> None:
    tensor = torch.arange(4)
    assert to_device(tensor, torch.device("cpu")) is tensor


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_relocation_on_a_gpu_makes_the_host_wait_for_nothing() -> None:
    """Keys on the GPU, positions on the host (as chunks give them): the cos/sin tables are built
    on the GPU and the positions copied from pinned memory, so no step synchronizes."""
    keys = torch.randn(2, 3, 64, 16, device="cuda")
    positions, moved = torch.arange(64), torch.arange(1000, 1064)
    want = rerotate(keys.cpu(), MROPE, positions, moved)
    rerotate(keys, MROPE, positions, moved)  # the frequencies copied once, the pinned pool warm
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = rerotate(keys, MROPE, positions, moved)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)  # float64 cos/sin per device
