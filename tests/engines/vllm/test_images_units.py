"""The connector's image pieces alone: image identities by vLLM's hash, and M-RoPE positions refused
in a shape kamera cannot place (vLLM's own computation is checked against its model runner on
every request of `test_images.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kamera_agent.chunks.chunk import image_identity
from kamera_agent.engines.vllm.images import ImageIdentities, images_only
from kamera_agent.engines.vllm.mrope import MRopePositions
from kamera_agent.errors import KameraError, PositionShapeError

pytestmark = pytest.mark.vllm


@dataclass
class _Elem:
    data: torch.Tensor


@dataclass
class _Range:
    offset: int
    length: int


@dataclass
class _Feature:
    """vLLM's ``MultiModalFeatureSpec`` as far as the connector reads it."""

    data: dict[str, _Elem] | None
    identifier: str
    mm_position: _Range
    modality: str = "image"


def _image(identifier: str, offset: int, pixels: torch.Tensor | None) -> _Feature:
    data = (
        None
        if pixels is None
        else {"pixel_values": _Elem(pixels), "image_grid_thw": _Elem(torch.tensor([1, 2, 2]))}
    )
    return _Feature(data, identifier, _Range(offset, 1))


def test_an_image_is_named_by_its_patches_and_remembered_by_vllms_hash() -> None:
    pixels = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    identities = ImageIdentities(size=1)
    (span,) = identities.spans([_image("h1", 5, pixels)])
    assert (span.start, span.end, span.identity) == (5, 6, image_identity(pixels, [1, 2, 2]))
    assert identities.identity(_image("h1", 9, None)) == span.identity  # cached by vLLM: remembered
    assert image_identity(pixels.to(torch.uint8), [1, 2, 2]) == span.identity  # raw bytes: hashed alike
    assert identities.identity(_image("h2", 9, pixels + 1)) != span.identity
    assert identities.identity(_image("h1", 9, None)) == "vllm:h1"  # forgotten (size 1), nothing at hand


def test_requests_with_other_modalities_or_without_image_data_are_not_served() -> None:
    pixels = torch.zeros(4, 3)
    assert images_only([_image("a", 0, pixels)], with_data=True)
    assert not images_only([_image("a", 0, None)], with_data=True)  # no grid: no M-RoPE positions
    assert images_only([_image("a", 0, None)], with_data=False)
    video = _Feature(None, "v", _Range(0, 4), modality="video")
    assert not images_only([video], with_data=False)  # its placeholders would key alike as text


def test_positions_of_another_shape_are_refused_by_name() -> None:
    def flat(tokens: list[int], features: list[Any]) -> tuple[torch.Tensor, int]:
        return torch.arange(len(tokens)), 0

    with pytest.raises(PositionShapeError, match=r"not \[3, tokens\]") as raised:
        MRopePositions(flat).of([1, 2, 3], [])
    assert isinstance(raised.value, KameraError)

    def rows(tokens: list[int], features: list[Any]) -> tuple[torch.Tensor, int]:
        return torch.arange(len(tokens)).expand(3, -1), 0

    assert MRopePositions(rows).of([1, 2, 3], []).tolist() == [[0, 1, 2]] * 3
