"""The transformers backend (CPU/GPU reference engine) and the readers it alone needs.

`TransformersBackend` offers the seam's primitives over a Hugging Face model; `kv_layout`,
`rotary_spec` and `read_chunk` (`read_chunks` for one forward's run of chunks) read a loaded
model's KV layout, rotary module and cache; `FAMILIES` says how each model family pairs its
rotary features.
"""

from kamera_agent.backends.transformers.backend import TransformersBackend, eos_token_ids
from kamera_agent.backends.transformers.families import FAMILIES, Family, family_of
from kamera_agent.backends.transformers.positions import MRopePositions, position_scheme
from kamera_agent.backends.transformers.reading import kv_layout, read_chunk, read_chunks, rotary_spec

__all__ = [
    "FAMILIES",
    "Family",
    "MRopePositions",
    "TransformersBackend",
    "eos_token_ids",
    "family_of",
    "kv_layout",
    "position_scheme",
    "read_chunk",
    "read_chunks",
    "rotary_spec",
]
