"""A vLLM request's M-RoPE positions, computed by vLLM's own model code on the scheduler side.

Why here: on an M-RoPE model (Qwen2-VL, Qwen2.5-VL) a request's positions are not its token
indices once it holds an image: an image of ``h x w`` merged patches takes ``h * w`` slots but
advances the position by ``max(h, w)``, so every token after it sits at a position below its
index. A load must rotate a chunk's keys to the positions vLLM gives those tokens and a capture
must un-rotate them from there, or image KV (and all text after an image) would be placed wrong.

vLLM computes them in its model runner (``get_mrope_input_positions`` of the model class, from
the prompt and its ``mm_features``); the scheduler side has no model instance, so the model's
method runs on a bare instance of its class holding only its config, the one attribute the
computation reads. The scheduler side sends each load's and capture's rows to the worker side
with the load or capture itself.

Worked example (the demo model's ChatML, an image of 2 x 3 merged patches after 4 text tokens):

=========  ==============  ==========  ================  ================
tokens     what            t           h                 w
=========  ==============  ==========  ================  ================
0..3       text            0..3        0..3              0..3
4          vision_start    4           4                 4
5..10      image_pad × 6   5, 5, …     5, 5, 5, 6, 6, 6  5, 6, 7, 5, 6, 7
11         vision_end      8           8                 8
12..       text            9..         9..               9..
=========  ==============  ==========  ================  ================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kamera_agent.errors import PositionShapeError, UnsupportedModelError

__all__ = ["MRopePositions"]

PositionsOf = Callable[[list[int], list[Any]], Any]
"""vLLM's computation: ``(prompt token ids, mm_features) -> (positions [3, n], delta)``."""


class MRopePositions:
    """A request's positions ``[3, n]`` as vLLM's model runner computes them.

    Args:
        compute: vLLM's computation (`of_model`); a test may hand its own.
    """

    def __init__(self, compute: PositionsOf) -> None:
        self._compute = compute

    @classmethod
    def of_model(cls, model_config: Any) -> MRopePositions:
        """The positions vLLM computes for ``model_config``'s model class.

        Raises:
            UnsupportedModelError: vLLM's class for the model computes no M-RoPE positions.
        """
        from vllm.model_executor.model_loader.utils import get_model_cls
        from vllm.model_executor.models.interfaces import supports_mrope

        model_cls = get_model_cls(model_config)
        if not supports_mrope(model_cls):
            raise UnsupportedModelError(
                f"vLLM's {model_cls.__name__} computes no M-RoPE positions, but the model's config asks "
                "for M-RoPE; run it without kamera's connector or with a vLLM whose class supports M-RoPE"
            )
        reader = object.__new__(model_cls)  # no weights, no layers: the config is all it reads
        object.__setattr__(reader, "config", model_config.hf_config)
        object.__setattr__(reader, "model_config", model_config)
        return cls(reader.get_mrope_input_positions)

    def of(self, tokens: Sequence[int], features: Sequence[Any]) -> torch.Tensor:
        """The positions ``[3, len(tokens)]`` (int64) of a prompt and its multimodal features.

        Raises:
            PositionShapeError: vLLM's computation returned another shape (a model whose
                positions kamera cannot place).
        """
        positions, _ = self._compute(list(tokens), [f for f in features if f.modality != "prompt_embeds"])
        out = torch.as_tensor(positions, dtype=torch.long)
        if out.shape != (3, len(tokens)):
            raise PositionShapeError(
                f"vLLM computed M-RoPE positions of shape {tuple(out.shape)} for a {len(tokens)}-token "
                "prompt, not [3, tokens]; this model's positions cannot be placed by kamera's connector"
            )
        return out
