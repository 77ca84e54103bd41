"""SGLang: kamera as a radix-cache backend (``--radix-cache-backend kamera``), issue 13.

Stage reached: the plugin registers through SGLang's ``sglang.srt.plugins`` entry point and
``create_tree_cache`` routes the flag to `KameraRadixCache`, which serves SGLang's own exact
radix reuse; `segment_key` cuts a request's key into image runs (SGLang's content-derived pad
values) and text runs; `write_chunk` / `read_chunk` move a chunk's KV into and out of SGLang's
MHA pool at a request's positions. Extending ``match_prefix`` past the radix prefix and calling
``write_chunk`` from ``init_load_back`` are not built yet (docs/sglang.md: what is verified).

Importing this package needs SGLang (the ``sglang`` extra); the rest of kamera never does.
"""

from kamera_agent.backends.sglang.segments import Segment, segment_key

__all__ = ["Segment", "segment_key"]
