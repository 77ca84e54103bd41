"""Reading a transformers model's KV layout, rotary spec and cache: the HF-specific readers.

Why here and not in the operator: the operator is pure torch and takes a `KVLayout` from any
backend. How a Hugging Face model lays out its cache (MHA/GQA keys and values, MLA's latent and
k_pe band), where its rotary module sits and which frequencies M-RoPE gives each position row
are facts about transformers classes, read from the loaded model itself; so is copying a chunk
out of a ``DynamicCache``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, pairwise
from typing import Any

import torch

from kamera_agent.backends.transformers.families import Family, family_of
from kamera_agent.errors import LayoutMismatchError, LengthDependentRopeError, UnsupportedModelError
from kamera_agent.operator.layout import ChunkKV, KVLayout, check_layout, check_positions
from kamera_agent.operator.rope import RotarySpec

__all__ = ["kv_layout", "kv_layout_of_config", "read_chunk", "read_chunks", "rotary_spec"]

_LENGTH_DEPENDENT = ("dynamic", "longrope")


def rotary_spec(model: Any, family: Family | None = None) -> RotarySpec:
    """Read the rotary description from a loaded model's own language-model rotary module.

    A module holding frequencies per layer type (Gemma 3's ``sliding_attention_inv_freq`` and
    ``full_attention_inv_freq``) gives a spec with one row of frequencies per decoder layer, in
    the order of the config's ``layer_types``.

    Raises:
        LengthDependentRopeError: dynamic NTK or longrope, whose frequencies change with length.
        UnsupportedModelError: the family is unknown or no rotary module is found.
    """
    family = family or family_of(model.config)
    module = _language_rotary_module(model)
    kinds = _layer_kinds(model, module)
    rope_types = _rope_types(module, kinds)
    for rope_type in rope_types:
        if any(tag in rope_type for tag in _LENGTH_DEPENDENT):
            raise LengthDependentRopeError(
                f"rope_type {rope_type!r} recomputes its frequencies from the sequence length, so a stored "
                "key has no fixed phase to relocate exactly. Use a static scaling (default, linear, llama3, "
                "yarn) for reuse, or serve this model by re-prefill."
            )
    if kinds is None:
        inv_freq = _buffer(module, "inv_freq")  # [F]
        scaling = float(getattr(module, "attention_scaling", 1.0))
    else:
        inv_freq = torch.stack([_buffer(module, f"{kind}_inv_freq") for kind in kinds])  # [L, F]
        scalings = {float(getattr(module, f"{kind}_attention_scaling", 1.0)) for kind in set(kinds)}
        if len(scalings) != 1:
            raise UnsupportedModelError(
                f"{type(model).__name__} scales cos/sin differently per layer type ({sorted(scalings)}); "
                "kamera relocates keys of one scaling"
            )
        (scaling,) = scalings
        if bool((inv_freq == inv_freq[0]).all()):
            inv_freq = inv_freq[0]  # one base after all: the shared form
    axes = _mrope_axes(family, getattr(module, "mrope_section", None), int(inv_freq.shape[-1]), module)
    return RotarySpec(
        inv_freq=inv_freq,
        pairing=family.pairing,
        axes=axes,
        rope_type="+".join(sorted(set(rope_types))),
        attention_scaling=scaling,
    )


def _layer_kinds(model: Any, module: torch.nn.Module) -> list[str] | None:
    """Each decoder layer's type where the rotary module keeps frequencies per type, else ``None``."""
    if hasattr(module, "inv_freq"):
        return None
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kinds = [str(kind) for kind in getattr(text, "layer_types", None) or []]
    missing = sorted({kind for kind in kinds if not hasattr(module, f"{kind}_inv_freq")})
    if not kinds or missing:
        raise UnsupportedModelError(
            f"{type(model).__name__}'s rotary module has no frequencies for layer types {missing or '?'}"
        )
    return kinds


def _rope_types(module: torch.nn.Module, kinds: list[str] | None) -> list[str]:
    named = getattr(module, "rope_type", "default")
    if isinstance(named, dict):
        return [str(named.get(kind, "default")) for kind in sorted(set(kinds or named))]
    return [str(named)]


def _buffer(module: torch.nn.Module, name: str) -> torch.Tensor:
    buffer: torch.Tensor = getattr(module, name)  # a buffer, not a method
    return buffer.detach().to("cpu", torch.float32).clone()


def kv_layout(model: Any) -> KVLayout:
    """Read a loaded transformers model's KV layout (MHA, GQA or MLA) and rotary spec."""
    family = family_of(model.config)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    rope = rotary_spec(model, family)
    layers = int(text.num_hidden_layers)
    if family.attention == "mla":
        if rope.rotary_dim != int(text.qk_rope_head_dim):
            raise LayoutMismatchError(
                f"rotary module has {rope.rotary_dim} rotary features but qk_rope_head_dim is "
                f"{text.qk_rope_head_dim}; the config and the loaded rotary module disagree"
            )
        return KVLayout(
            kind="mla",
            num_layers=layers,
            keys_shape=(1, int(text.kv_lora_rank)),
            values_shape=(1, int(text.qk_rope_head_dim)),
            rope_slot="values",
            rope=rope,
            name=family.name,
        )
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    if rope.rotary_dim > head_dim:
        raise LayoutMismatchError(f"rotary band {rope.rotary_dim} exceeds head_dim {head_dim}")
    return KVLayout(
        kind="mha" if kv_heads == heads else "gqa",
        num_layers=layers,
        keys_shape=(kv_heads, head_dim),
        values_shape=(kv_heads, head_dim),
        rope_slot="keys",
        rope=rope,
        name=family.name,
    )


def kv_layout_of_config(config: Any) -> KVLayout:
    """The KV layout of the model ``config`` describes, without its weights: the model is built
    on the meta device and only its rotary module is rebuilt on the CPU (its frequencies are
    computed from the config). For engines that hold the weights themselves (SGLang, vLLM)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModel.from_config(config)
    name, module = _language_rotary_named(model)
    model.set_submodule(name, type(module)(config=module.config))
    return kv_layout(model)


def read_chunk(
    cache: Any,
    layout: KVLayout,
    start: int,
    stop: int,
    positions: torch.Tensor,
    *,
    batch_index: int = 0,
    chunk_key: str = "",
    model_fingerprint: str = "",
) -> ChunkKV:
    """Copy cache slots ``[start, stop)`` of every layer into a `ChunkKV` placed at ``positions``.

    ``cache`` is a transformers ``Cache`` whose ``layers[i].keys/values`` are ``[B, H, S, D]``.
    """
    n = stop - start
    check_positions(positions, n)
    layers = cache.layers
    if len(layers) != layout.num_layers:
        raise LayoutMismatchError(f"cache has {len(layers)} layers, the layout {layout.num_layers}")
    keys = torch.stack([layer.keys[batch_index, :, start:stop] for layer in layers])  # a new tensor:
    values = torch.stack([layer.values[batch_index, :, start:stop] for layer in layers])  # no clone
    kv = ChunkKV(keys, values, positions.clone(), chunk_key, model_fingerprint)
    check_layout(kv, layout)
    return kv


def read_chunks(
    cache: Any,
    layout: KVLayout,
    start: int,
    positions: Sequence[torch.Tensor],
    chunk_keys: Sequence[str],
    *,
    model_fingerprint: str = "",
    whole_run: bool | None = None,
) -> list[ChunkKV]:
    """`read_chunk` of consecutive chunks from slot ``start``, one per ``positions`` (its token
    count), each in tensors of its own.

    Why two ways: reading one chunk slices every layer's keys and values, some sixty indexing
    calls per chunk at 28 layers, then copies once. On a GPU those calls are most of the read,
    so there (``whole_run``, the default for a cache off the CPU) every layer is sliced once for
    the run and each chunk is one copy out of it; on a CPU the copy is the cost, and a second
    one would double it, so each chunk is read alone."""
    sizes = [int(where.shape[-1]) for where in positions]
    bounds = list(accumulate(sizes, initial=start))
    if whole_run is None:
        whole_run = len(sizes) > 1 and cache.layers[0].keys.device.type != "cpu"
    if not whole_run:
        return [
            read_chunk(cache, layout, a, b, where, chunk_key=key, model_fingerprint=model_fingerprint)
            for (a, b), where, key in zip(pairwise(bounds), positions, chunk_keys, strict=True)
        ]
    run = read_chunk(cache, layout, start, bounds[-1], torch.arange(bounds[-1] - start))
    out = []
    for (a, b), where, key in zip(pairwise(bounds), positions, chunk_keys, strict=True):
        check_positions(where, b - a)
        rows = slice(a - start, b - start)
        keys, values = run.keys[:, :, rows].contiguous(), run.values[:, :, rows].contiguous()
        out.append(ChunkKV(keys, values, where.clone(), key, model_fingerprint))
    return out


def _language_rotary_module(model: Any) -> torch.nn.Module:
    """The rotary module of the language model (never the vision tower's)."""
    return _language_rotary_named(model)[1]


def _language_rotary_named(model: Any) -> tuple[str, torch.nn.Module]:
    """The language model's rotary module and its name in ``model``."""
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if _has_frequencies(module) and "visual" not in name and "vision" not in name
    ]
    if not candidates:
        raise UnsupportedModelError(
            f"no rotary embedding module found in {type(model).__name__}; kamera-agent relocates RoPE "
            "models only"
        )
    # The shallowest one is the language model's shared rotary embedding.
    candidates.sort(key=lambda item: item[0].count("."))
    name, module = candidates[0]
    return name, module


def _has_frequencies(module: torch.nn.Module) -> bool:
    """A rotary module: it holds ``inv_freq``, or ``<layer type>_inv_freq`` per layer type."""
    if hasattr(module, "inv_freq"):
        return True
    own = module.named_buffers(recurse=False)
    return any(name.endswith("_inv_freq") and "original" not in name for name, _ in own)


def _mrope_axes(
    family: Family, section: Any, num_freqs: int, module: torch.nn.Module | None = None
) -> torch.Tensor | None:
    """Position row (0 = t, 1 = h, 2 = w) of each frequency, from the model's ``mrope_section``.

    Where the rotary module exposes its own ``recomposition_frequencies`` we ask it directly
    (feed it rows tagged 0, 1, 2 and read back which row each frequency took), so the table
    is the model's by construction; the family's style is the fallback. For
    ``mrope_section = [2, 3, 3]`` (8 frequencies):

    ==========  ========================  ========================
    frequency   blocked (Qwen2/2.5-VL)    interleaved (Qwen3-VL)
    ==========  ========================  ========================
    0 1 2 3     t t h h                   t h w t
    4 5 6 7     h w w w                   h w t h
    ==========  ========================  ========================
    """
    if family.mrope is None:
        return None
    if section is None:
        raise UnsupportedModelError(f"{family.name} uses M-RoPE but its rotary module has no mrope_section")
    section = [int(s) for s in section]
    if sum(section) > num_freqs or len(section) != 3:
        raise LayoutMismatchError(f"mrope_section {section} must be 3 rows covering {num_freqs} frequencies")
    recompose = getattr(module, "recomposition_frequencies", None)
    if callable(recompose):
        tagged = torch.arange(3, dtype=torch.float32).view(3, 1, 1, 1).repeat(1, 1, 1, num_freqs)
        recomposed: torch.Tensor = recompose(tagged)  # [1, 1, 2F]: cat((per_freq, per_freq))
        return recomposed[..., :num_freqs].reshape(num_freqs).round().long()
    if family.mrope == "blocked":
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    axes = torch.zeros(num_freqs, dtype=torch.int64)
    for row in (1, 2):
        idx = torch.arange(row, section[row] * 3, 3)
        axes[idx[idx < num_freqs]] = row  # the model's slice clips at F the same way
    return axes
