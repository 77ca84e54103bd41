"""kamera-tiny-vl: the project's own tiny Qwen2-VL, shipped in the repository.

Why ship a model: the demo, the examples and the fidelity benchmark must run offline on any
laptop, and show binding breaking under blind reuse and the patch repairing it. The model is
a real ``Qwen2VLForConditionalGeneration`` (M-RoPE, vision tower, merger) at a tiny size,
trained on `kamera_agent.demo.task`; it is a demonstration model, not a general VLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kamera_agent.models.tiny_tokenizer import QWEN2_VL_CHAT_TEMPLATE, build_byte_tokenizer

__all__ = ["DEMO_MODEL_DIR", "demo_config", "demo_image_processor", "demo_tokenizer", "load_demo_model"]

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "kamera-tiny-vl"
"""Where the trained weights, tokenizer and image processor live (inside the package)."""

_TOOLS = (  # newlines as Jinja strings: chat templates render with trim_blocks
    "{% if tools %}{{ '\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
    "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n</tools>\n\nFor each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call> XML "
    'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\' }}'
    "{% endif %}"
)
_CALLS = (
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    "{% if not loop.first or message['content'] %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' }}{{ call['name'] }}{{ '\", \"arguments\": ' }}"
    "{{ call['arguments'] | tojson }}{{ '}\n</tool_call>' }}{% endfor %}{% endif %}"
)
# The Qwen2-VL template with a shorter default system prompt (fewer anchor tokens per window) and
# Qwen2.5's Hermes-style tools: the definitions in the system block, an assistant's calls as
# <tool_call> JSON, tool results as messages of role "tool". Without tools it renders exactly
# what the Qwen2-VL template renders.
DEMO_CHAT_TEMPLATE = (
    QWEN2_VL_CHAT_TEMPLATE.replace("You are a helpful assistant.", "Answer briefly." + _TOOLS)
    .replace(
        "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}",
        "{% if message['content'] is string %}{{ message['content'] }}{% elif message['content'] %}",
    )
    .replace(
        "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}",
        "{% endfor %}{% endif %}{% if message['role'] == 'system' %}"
        + _TOOLS
        + "{% endif %}"
        + _CALLS
        + "<|im_end|>\n{% endfor %}",
    )
)


def demo_config() -> Any:
    """The architecture: 6 decoder layers (hidden 128, 4 heads of 32 with 4 KV heads, M-RoPE), a
    2-layer vision tower on 14-pixel patches with a 2 x 2 merge, and the 512-id byte vocabulary.

    Four KV heads (128 numbers per token and slot) rather than GQA's two: a rank-m patch stores
    ``m·(n + F)`` numbers against the chunk's ``n·F``, so a rank-16 patch of a ~100-token page is
    under 30 % of its KV only when ``F`` is 128."""
    from transformers import Qwen2VLConfig

    text = {
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
        "bos_token_id": 256,
        "eos_token_id": 258,
        "pad_token_id": 256,
        "tie_word_embeddings": False,
    }
    vision = {
        "depth": 2,
        "embed_dim": 64,
        "hidden_size": 128,
        "mlp_ratio": 2,
        "num_heads": 4,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=500,
        video_token_id=501,
        vision_start_token_id=502,
        vision_end_token_id=503,
        tie_word_embeddings=False,
    )


def demo_tokenizer() -> Any:
    """The byte-level tokenizer with Qwen's specials and the demo chat template."""
    return build_byte_tokenizer(chat_template=DEMO_CHAT_TEMPLATE)


def demo_image_processor() -> Any:
    """Qwen-VL preprocessing for the task's frames at their own size (56 x 56 legend frames:
    4 tokens after the 2 x 2 merge; 224 x 336 pages: 96 tokens)."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": 56 * 56, "longest_edge": 224 * 336},
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )


def load_demo_model(path: str | Path | None = None) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, image_processor)`` of kamera-tiny-vl, loaded offline with ``from_pretrained``.

    Raises:
        FileNotFoundError: the weights are missing (train them with ``training/train_demo_model.py``).
    """
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration

    where = Path(path) if path is not None else DEMO_MODEL_DIR
    if not (where / "config.json").is_file():
        raise FileNotFoundError(
            f"no kamera-tiny-vl weights in {where}; train them with `python training/train_demo_model.py`"
        )
    model = Qwen2VLForConditionalGeneration.from_pretrained(where, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(where), AutoImageProcessor.from_pretrained(where)
