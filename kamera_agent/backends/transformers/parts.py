"""The pieces of a Hugging Face model the transformers backend drives directly.

Why not call the top-level ``forward``: to reuse a vision tower's output across requests
(and across transformers versions, whose top-level signatures differ) the backend merges
cached image embeddings itself and calls the language model with explicit positions, then the
LM head. For Qwen3-VL it also passes the deepstack features, which the model re-injects into
the image tokens' hidden states in its first layers: they belong to the chunk itself, so a
canonical computed with them is still antecedent-free and position-free.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from kamera_agent.critical_path import to_device
from kamera_agent.errors import UnsupportedModelError

__all__ = ["ModelParts", "model_parts"]


@dataclass(frozen=True)
class ModelParts:
    """Handles on a loaded model.

    Attributes:
        model: the full model.
        language_model: the decoder stack (returns hidden states and the cache).
        lm_head: hidden states → logits.
        cache_kwarg: the language model's keyword for the cache (``cache`` or ``past_key_values``).
        takes_deepstack: the language model accepts Qwen3-VL deepstack features.
        has_vision: the model has a vision tower exposed through ``get_image_features``.
    """

    model: Any
    language_model: Any
    lm_head: Any
    cache_kwarg: str
    takes_deepstack: bool
    has_vision: bool

    @property
    def device(self) -> torch.device:
        return self._first_parameter.device

    @property
    def dtype(self) -> torch.dtype:
        return self._embedding.weight.dtype  # type: ignore[no-any-return]

    @functools.cached_property
    def _first_parameter(self) -> torch.Tensor:
        """The model's first parameter, found once: ``parameters()`` walks every module, and it
        is asked several times an op. The object stays when the model is moved (``Module.to`` moves its
        data), so its ``device`` is always current."""
        return next(self.model.parameters())  # type: ignore[no-any-return]

    @functools.cached_property
    def _embedding(self) -> Any:
        return self.language_model.get_input_embeddings()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` ids → ``[n, hidden]`` input embeddings."""
        return self.language_model.get_input_embeddings()(to_device(input_ids, self.device))  # type: ignore[no-any-return]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` states → float32 logits, soft-capped where the model caps them
        (``final_logit_softcapping``, as Gemma's top-level forward does after its head)."""
        logits = self.lm_head(hidden).float()
        text = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else None
        cap = getattr(text or self.model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits  # type: ignore[no-any-return]

    def image_features(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """Run the vision tower: ``{"embeds": [n_img, hidden], "deepstack.i": [n_img, hidden] ...}``.

        Qwen-VL towers take patches and their grid; LLaVA-style towers take a fixed-size image and
        the config's feature layer and selection strategy.
        """
        inner, config = self.model.model, self.model.config
        tower = getattr(inner, "visual", None) or inner.vision_tower
        pixels = pixel_values.to(self.device, tower.dtype)
        with torch.no_grad():
            if image_grid_thw is not None:
                out = inner.get_image_features(pixels, image_grid_thw.to(self.device))
            else:
                out = inner.get_image_features(
                    pixel_values=pixels,
                    vision_feature_layer=config.vision_feature_layer,
                    vision_feature_select_strategy=config.vision_feature_select_strategy,
                )
        pooled = out.pooler_output if hasattr(out, "pooler_output") else out
        features = {"embeds": _cat(pooled)}
        for i, feature in enumerate(getattr(out, "deepstack_features", None) or []):
            features[f"deepstack.{i}"] = _cat(feature)
        return features

    def tokens_per_image(self) -> int | None:
        """Image tokens of a fixed-size tower (LLaVA-style); ``None`` where the grid decides."""
        vision = getattr(self.model.config, "vision_config", None)
        strategy = getattr(self.model.config, "vision_feature_select_strategy", None)
        if vision is None or strategy is None:
            return None
        patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
        return patches + (1 if strategy == "full" else 0)


def _cat(parts: Any) -> torch.Tensor:
    if isinstance(parts, list | tuple):
        return torch.cat([p for p in parts], dim=0)
    tensor: torch.Tensor = parts
    return tensor


def model_parts(model: Any) -> ModelParts:
    """Find the decoder, LM head and vision entry points of a transformers model.

    Raises:
        UnsupportedModelError: the model has no decoder or LM head we can drive.
    """
    inner = getattr(model, "model", None)
    language_model = getattr(inner, "language_model", None) or inner
    lm_head = getattr(model, "lm_head", None) or (
        model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    )
    if language_model is None or lm_head is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a causal LM with a decoder and an LM head; load it with "
            "AutoModelForCausalLM or AutoModelForImageTextToText"
        )
    params = inspect.signature(language_model.forward).parameters
    return ModelParts(
        model=model,
        language_model=language_model,
        lm_head=lm_head,
        cache_kwarg="cache" if "cache" in params else "past_key_values",
        takes_deepstack="deepstack_visual_embeds" in params,
        has_vision=hasattr(inner, "get_image_features")
        and (hasattr(inner, "visual") or hasattr(inner, "vision_tower")),
    )
