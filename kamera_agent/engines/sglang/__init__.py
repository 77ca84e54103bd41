"""SGLang: kamera as a radix-cache backend (``--radix-cache-backend kamera``).

The plugin registers through SGLang's ``sglang.srt.plugins`` entry point; `KameraRadixCache`
keeps SGLang's own radix reuse and extends a match over chunks kamera's store can serve
(`kamera_agent.engines.synthesis`): ``match_prefix`` reports them, ``init_load_back`` writes their
relocated KV into SGLang's MHA/GQA or MLA pool (`SGLangSlots`) and adds the slots to the tree,
``checkpoint`` captures prefilled chunks (read back through `SGLangSlots`). `request_chunks`
cuts a request's key into image chunks (SGLang's content-derived pad values, framed) and text
chunks (one a message).
docs/sglang.md says what is verified and what is not.

Importing this package's modules other than `segments` needs SGLang (the ``sglang`` extra).
"""

from kamera_agent.engines.sglang.segments import ChunkRules, Segment, request_chunks, segment_key

__all__ = ["ChunkRules", "Segment", "request_chunks", "segment_key"]
