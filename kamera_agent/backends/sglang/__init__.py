"""SGLang: kamera as a radix-cache backend (``--radix-cache-backend kamera``), issue 13.

Stage reached: the plugin registers through SGLang's ``sglang.srt.plugins`` entry point and
``create_tree_cache`` routes the flag to `KameraRadixCache`, which serves SGLang's own exact
radix reuse; `segment_key` cuts a request's key into image runs (SGLang's content-derived pad
values) and text runs, the first step of extending a match past the radix prefix. Serving
relocated and patched chunk KV (``match_prefix`` + ``init_load_back``) and capturing it from the
pool are not built yet (docs/sglang.md says what is verified and what is not).

Importing this package needs SGLang (the ``sglang`` extra); the rest of kamera never does.
"""

from kamera_agent.backends.sglang.segments import Segment, segment_key

__all__ = ["Segment", "segment_key"]
