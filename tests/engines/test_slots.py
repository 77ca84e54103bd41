"""The `KVSlots` protocol over `kamera_agent.testing.DictSlots`: an engine's pool of token slots.

A chunk's position-free KV written at the positions an engine gives its tokens, into any slots,
reads back as the same position-free KV: relocation on the way in and its inverse on the way
out belong to the protocol, once for every engine (GQA and MLA bands, 1-D RoPE and M-RoPE), so
an adapter implements only where a token's keys and values sit in its memory.
"""

from __future__ import annotations

import pytest
import torch

from kamera_agent.engines.slots import request_positions
from kamera_agent.operator.layout import ChunkKV, KVLayout
from kamera_agent.operator.rope import RotarySpec
from kamera_agent.testing import DictSlots


def _rope(dim: int, axes: torch.Tensor | None = None) -> RotarySpec:
    return RotarySpec(
        inv_freq=1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), pairing="half", axes=axes
    )


LAYOUTS = {
    "gqa": KVLayout("gqa", 3, (2, 16), (2, 16), "keys", _rope(16)),
    "mla": KVLayout("mla", 3, (1, 32), (1, 8), "values", _rope(8)),  # the band in k_pe (values slot)
    "mrope": KVLayout("gqa", 3, (2, 16), (2, 16), "keys", _rope(16, torch.tensor([0, 0, 0, 1, 1, 2, 2, 2]))),
}


def _chunk(layout: KVLayout, n: int) -> ChunkKV:
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(layout.num_layers, *layout.keys_shape[:1], n, layout.keys_shape[1], generator=g)
    values = torch.randn(layout.num_layers, *layout.values_shape[:1], n, layout.values_shape[1], generator=g)
    return ChunkKV(keys, values)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_chunk_written_at_its_positions_reads_back_position_free(name: str) -> None:
    layout = LAYOUTS[name]
    pool, kv = DictSlots(layout), _chunk(layout, 6)
    slots, positions = torch.tensor([40, 3, 17, 9, 28, 11]), request_positions(layout, 100, 106)
    pool.write(kv, positions, slots)
    band = kv.slot(layout.rope_slot)
    stored = torch.stack(
        [pool.slots[s][0 if layout.rope_slot == "keys" else 1] for s in slots.tolist()], dim=2
    )
    assert not torch.allclose(stored, band, atol=1e-3)  # rotated on the way in: else this could not fail
    back = pool.read(slots, positions, chunk_key="c")
    assert back.positions is None and back.chunk_key == "c"
    torch.testing.assert_close(back.keys, kv.keys, atol=1e-5, rtol=1e-5)  # float32 rotations: ~1e-6
    torch.testing.assert_close(back.values, kv.values, atol=1e-5, rtol=1e-5)
    elsewhere = pool.read(slots, request_positions(layout, 7, 13))  # read as if placed elsewhere
    assert not torch.allclose(elsewhere.slot(layout.rope_slot), band, atol=1e-3)


def test_a_slot_never_written_is_a_key_error() -> None:
    pool = DictSlots(LAYOUTS["gqa"])
    pool.write(_chunk(LAYOUTS["gqa"], 2), torch.arange(2), torch.tensor([0, 1]))
    with pytest.raises(KeyError):
        pool.read_placed(torch.tensor([1, 2]))
