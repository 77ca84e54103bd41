"""Tiny GGUF files written from the tiny random models, in llama.cpp's layout, for fast tests of
the GGUF path (the real models' files take tens of seconds to dequantize)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_llama_gguf(model: Any, path: Path) -> Path:
    """Write a ``LlamaForCausalLM`` as an F32 GGUF file with no tokenizer metadata (q and k rows
    permuted as llama.cpp stores them; transformers' reader permutes them back)."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    for name, tensor in model.state_dict().items():
        data = tensor.detach().numpy().astype(np.float32)
        if name in _TOP:
            writer.add_tensor(_TOP[name], data)
            continue
        layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
        if rest == "self_attn.q_proj.weight":
            data = _permute(data, config.num_attention_heads)
        elif rest == "self_attn.k_proj.weight":
            data = _permute(data, config.num_key_value_heads)
        writer.add_tensor(f"blk.{layer}.{_LAYER[rest]}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout of q/k rows (pairs interleaved per head)."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )
