"""Tiny random-initialised models of the real ``transformers`` classes, for CPU tests.

No weights can be downloaded in the test environment, so every model is built from a
hand-written config with random init. The models are deliberately tiny (hidden 64,
2 layers, head_dim 16, vocab 512) so that construction and a 64-token forward run
in milliseconds on one CPU thread, while still exercising the real attention, RoPE
(default, llama3, yarn, linear, dynamic, partial, interleaved, M-RoPE) and MLA code
paths. ``max_position_embeddings`` is 131072 so positions up to ~70000 are in range.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GlmConfig,
    GlmForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PhiConfig,
    PhiForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

VOCAB_SIZE = 512
MAX_POSITIONS = 131072
# Special token ids for the VL models; they must lie inside the tiny vocab.
IMAGE_TOKEN_ID = 500
VIDEO_TOKEN_ID = 501
VISION_START_TOKEN_ID = 502
VISION_END_TOKEN_ID = 503

Model = PreTrainedModel

_TEXT: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": MAX_POSITIONS,
    "attn_implementation": "eager",
}
_MLA: dict[str, Any] = {
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "first_k_dense_replace": 2,  # == num_hidden_layers: every layer is a dense MLP
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}
_VL_IDS: dict[str, Any] = {
    "image_token_id": IMAGE_TOKEN_ID,
    "video_token_id": VIDEO_TOKEN_ID,
    "vision_start_token_id": VISION_START_TOKEN_ID,
    "vision_end_token_id": VISION_END_TOKEN_ID,
    "attn_implementation": "eager",  # propagated to text_config and vision_config
}
_VISION: dict[str, Any] = {"depth": 2, "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2}

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e4}
LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
DYNAMIC_ROPE = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}


def _rope(**extra: Any) -> dict[str, Any]:
    """A fresh default-RoPE parameter dict (configs mutate it during standardisation)."""
    return {"rope_type": "default", "rope_theta": 10000.0, **extra}


def _build(model_cls: type[PreTrainedModel], config: PreTrainedConfig, seed: int) -> Model:
    """Seed, construct, and return ``model_cls(config)`` in float32 eval mode."""
    torch.manual_seed(seed)
    model = model_cls(config)
    return model.to(torch.float32).eval()


def tiny_llama(rope_parameters: dict[str, Any] | None = None, seed: int = 0, **overrides: Any) -> Model:
    """LlamaForCausalLM with GQA (4 query / 2 kv heads, head_dim 16) and the given RoPE parameters."""
    rope = dict(rope_parameters or _rope())
    config = LlamaConfig(**{**_TEXT, "rope_parameters": rope, **overrides})
    return _build(LlamaForCausalLM, config, seed)


def tiny_llama_llama3(seed: int = 0, **overrides: Any) -> Model:
    """Llama with Llama-3.1 style frequency scaling."""
    return tiny_llama(LLAMA3_ROPE, seed=seed, **overrides)


def tiny_llama_yarn(seed: int = 0, **overrides: Any) -> Model:
    """Llama with YaRN scaling (attention_scaling != 1)."""
    return tiny_llama(YARN_ROPE, seed=seed, **overrides)


def tiny_llama_linear(seed: int = 0, **overrides: Any) -> Model:
    """Llama with linear position interpolation."""
    return tiny_llama(LINEAR_ROPE, seed=seed, **overrides)


def tiny_llama_dynamic(seed: int = 0, **overrides: Any) -> Model:
    """Llama with dynamic NTK scaling (only rescales past ``max_position_embeddings``)."""
    return tiny_llama(DYNAMIC_ROPE, seed=seed, **overrides)


def tiny_mha_llama(seed: int = 0, **overrides: Any) -> Model:
    """Llama with plain multi-head attention (4 query / 4 kv heads)."""
    return tiny_llama(seed=seed, **{"num_key_value_heads": 4, **overrides})


def tiny_qwen2(seed: int = 0, **overrides: Any) -> Model:
    """Qwen2ForCausalLM with GQA (4/2) and q/k/v biases."""
    config = Qwen2Config(**{**_TEXT, "rope_parameters": _rope(rope_theta=1e6), **overrides})
    return _build(Qwen2ForCausalLM, config, seed)


GEMMA3_WINDOW = 6
"""The tiny Gemma 3's sliding window: a few tokens, so test windows reach past it."""


def tiny_gemma3(seed: int = 0, **overrides: Any) -> Model:
    """Gemma3ForCausalLM: sliding-window layers (window `GEMMA3_WINDOW`) rotating by 10,000
    beside full-attention layers rotating by 1,000,000, alternating, as Gemma 3 does 5:1."""
    layers = int(overrides.pop("num_hidden_layers", 2))
    kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    rope = {"sliding_attention": _rope(), "full_attention": _rope(rope_theta=1e6)}
    text = {**_TEXT, "attn_implementation": "sdpa"}
    config = Gemma3TextConfig(
        **{
            **text,
            "num_hidden_layers": layers,
            "head_dim": 16,
            "layer_types": kinds,
            "sliding_window": GEMMA3_WINDOW,
            "rope_parameters": rope,
            "query_pre_attn_scalar": 16,
            **overrides,
        }
    )
    return _build(Gemma3ForCausalLM, config, seed)


def tiny_phi(seed: int = 0, **overrides: Any) -> Model:
    """PhiForCausalLM, MHA head_dim 16, partial rotary 0.5 (first 8 dims, half-split layout)."""
    rope = _rope(partial_rotary_factor=0.5)
    config = PhiConfig(**{**_TEXT, "num_key_value_heads": 4, "rope_parameters": rope, **overrides})
    return _build(PhiForCausalLM, config, seed)


def tiny_glm(seed: int = 0, **overrides: Any) -> Model:
    """GlmForCausalLM, GQA 4/2, head_dim 16, partial rotary 0.5 with interleaved pairs."""
    rope = _rope(partial_rotary_factor=0.5)
    ids = {"pad_token_id": 0, "eos_token_id": 2}  # GLM defaults lie outside the tiny vocab
    config = GlmConfig(**{**_TEXT, **ids, "head_dim": 16, "rope_parameters": rope, **overrides})
    return _build(GlmForCausalLM, config, seed)


def tiny_deepseek_v2(seed: int = 0, **overrides: Any) -> Model:
    """DeepseekV2ForCausalLM with MLA (kv_lora_rank 32, rope/nope/v head dims 16) and dense MLPs only."""
    config = DeepseekV2Config(**{**_TEXT, **_MLA, "rope_parameters": _rope(), **overrides})
    return _build(DeepseekV2ForCausalLM, config, seed)


def tiny_deepseek_v3(rope_interleave: bool = True, seed: int = 0, **overrides: Any) -> Model:
    """DeepseekV3ForCausalLM with MLA and dense MLPs only; ``rope_interleave`` picks the RoPE pair layout."""
    mla = {**_MLA, "rope_interleave": rope_interleave, "n_group": 1, "topk_group": 1}
    config = DeepseekV3Config(**{**_TEXT, **mla, "rope_parameters": _rope(), **overrides})
    return _build(DeepseekV3ForCausalLM, config, seed)


def _vl_text(mrope_section: list[int], **extra: Any) -> dict[str, Any]:
    """Text sub-config shared by the Qwen VL factories (M-RoPE with the given sections)."""
    text = {k: v for k, v in _TEXT.items() if k != "attn_implementation"}
    rope = _rope(mrope_section=mrope_section, **extra)
    return {**text, "rope_parameters": rope, "bos_token_id": 1, "eos_token_id": 2}


def tiny_qwen2_vl(seed: int = 0, layers: int = 2) -> Model:
    """Qwen2VLForConditionalGeneration: head_dim 16, mrope_section [2, 3, 3], 1-layer ViT (patch 14)."""
    # Qwen2-VL's vision `hidden_size` is the merger output (= text hidden); `embed_dim` is the ViT width.
    vision = {**_VISION, "depth": 1, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2}
    text = {**_vl_text([2, 3, 3]), "num_hidden_layers": layers}
    config = Qwen2VLConfig(text_config=text, vision_config=vision, **_VL_IDS)
    return _build(Qwen2VLForConditionalGeneration, config, seed)


def tiny_qwen2_5_vl(seed: int = 0, layers: int = 2) -> Model:
    """Qwen2_5_VLForConditionalGeneration: head_dim 16, mrope_section [2, 3, 3], 2-layer windowed ViT."""
    vision = {**_VISION, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64}
    vision |= {"window_size": 56, "fullatt_block_indexes": [1]}  # layer 0 windowed, layer 1 full
    text = {**_vl_text([2, 3, 3]), "num_hidden_layers": layers}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_VL_IDS)
    return _build(Qwen2_5_VLForConditionalGeneration, config, seed)


def tiny_qwen3_vl(seed: int = 0, layers: int = 2) -> Model:
    """Qwen3VLForConditionalGeneration: head_dim 16, interleaved M-RoPE [4, 2, 2], ViT with deepstack.

    The sections are [T, H, W] with H and W at pair indices 1::3 and 2::3 (here 1,4 and 2,5), T the rest.
    """
    vision = {**_VISION, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64}
    vision |= {"num_position_embeddings": 64, "deepstack_visual_indexes": [0]}  # 8x8 learned grid
    text = {**_vl_text([4, 2, 2], mrope_interleaved=True), "head_dim": 16, "num_hidden_layers": layers}
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **_VL_IDS)
    return _build(Qwen3VLForConditionalGeneration, config, seed)


def vl_image_inputs(
    model: Model,
    grid_thw: tuple[int, int, int] = (1, 4, 4),
    text_ids: tuple[int, ...] = (1, 2, 3),
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Forward kwargs for one image of ``grid_thw`` patches framed by vision start/end, then ``text_ids``.

    ``pixel_values`` has one row of ``in_channels * temporal_patch_size * patch_size**2`` per patch;
    the image occupies ``t*h*w / spatial_merge_size**2`` image tokens. ``mm_token_type_ids`` (1 = image)
    is required by transformers 5.x whenever ``image_grid_thw`` is passed.
    """
    vc, (t, h, w) = model.config.vision_config, grid_thw
    per_patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    n_image = t * h * w // vc.spatial_merge_size**2
    ids = [VISION_START_TOKEN_ID, *[IMAGE_TOKEN_ID] * n_image, VISION_END_TOKEN_ID, *text_ids]
    input_ids = torch.tensor([ids])
    gen = torch.Generator().manual_seed(seed)
    return {
        "input_ids": input_ids,
        "pixel_values": torch.randn(t * h * w, per_patch, generator=gen),
        "image_grid_thw": torch.tensor([grid_thw]),
        "mm_token_type_ids": (input_ids == IMAGE_TOKEN_ID).int(),
    }


ALL_TEXT_FACTORIES: dict[str, Callable[[], Model]] = {
    "llama": tiny_llama,
    "mha_llama": tiny_mha_llama,
    "qwen2": tiny_qwen2,
    "gemma3": tiny_gemma3,
    "phi": tiny_phi,
    "glm": tiny_glm,
    "deepseek_v2": tiny_deepseek_v2,
    "deepseek_v3": tiny_deepseek_v3,
    "deepseek_v3_nointerleave": lambda: tiny_deepseek_v3(rope_interleave=False),
    "llama3": tiny_llama_llama3,
    "yarn": tiny_llama_yarn,
    "linear": tiny_llama_linear,
}
ALL_VL_FACTORIES: dict[str, Callable[[], Model]] = {
    "qwen2_vl": tiny_qwen2_vl,
    "qwen2_5_vl": tiny_qwen2_5_vl,
    "qwen3_vl": tiny_qwen3_vl,
}


def as_bf16(model: Model) -> Model:
    """A bf16 copy laid out as ``from_pretrained(dtype=torch.bfloat16)`` leaves it.

    ``Module.to(bfloat16)`` would also round the rotary ``inv_freq`` buffers, which loading a
    checkpoint in bf16 keeps in float32; copy them back so tests see the real bf16 model.
    """
    import copy

    low = copy.deepcopy(model).to(torch.bfloat16)
    for (_, src), (_, dst) in zip(model.named_modules(), low.named_modules(), strict=True):
        for name in ("inv_freq", "original_inv_freq"):
            buffer = getattr(src, name, None)
            if isinstance(buffer, torch.Tensor):
                setattr(dst, name, buffer.clone())
    return low


LLAVA_IMAGE_TOKEN_ID = 500


def tiny_llava(seed: int = 0) -> Model:
    """LlavaForConditionalGeneration: a tiny CLIP tower (28x28 images, patch 14: 4 image tokens
    after dropping CLS) projected into a tiny Llama (MHA-style LLaVA stack, 1-D RoPE)."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    text = LlamaConfig(**{**_TEXT, "num_key_value_heads": 4, "rope_parameters": _rope()})
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=LLAVA_IMAGE_TOKEN_ID,
        vision_feature_layer=-1,
        attn_implementation="eager",
    )
    return _build(LlavaForConditionalGeneration, config, seed)
