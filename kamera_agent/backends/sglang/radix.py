"""`KameraRadixCache`: the radix cache SGLang builds for ``--radix-cache-backend kamera``.

Stage reached: SGLang's own ``RadixCache`` (exact prefix reuse, its eviction and its locking),
under kamera's name and settings, so the server runs with the flag and the routing is tested
against SGLang's real registry. Extending a match past the radix prefix (``host_hit_length``
over chunks whose stored KV fits their antecedent states) and writing relocated + patched KV in
``init_load_back`` are the next stage (issue 13); nothing here pretends to do them.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.radix_cache import RadixCache

from kamera_agent.config import WindowConfig

__all__ = ["KameraRadixCache"]


class KameraRadixCache(RadixCache):  # type: ignore[misc]
    """SGLang's radix cache, built by kamera's factory with the settings it will serve under.

    Args:
        params: SGLang's ``CacheInitParams`` (pools, allocator, page size).
        config: which approximations the plugin may serve (`WindowConfig` fields).
    """

    def __init__(self, params: Any, config: WindowConfig | None = None) -> None:
        super().__init__(params)
        self.config = config or WindowConfig.exact()
