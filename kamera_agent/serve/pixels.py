"""Decoded pixels in flight, counted against a tenant's limit and the server's before decoding.

Why: a PNG of 49 megapixels compresses to 50 KB and decodes to 200 MB, and the image processor
then holds several copies of it (PIL's 4-byte RGB, its own arrays); 24 such requests at once
killed the server while the per-tenant queue limit was still counting. An image's size is in
its header, so each is charged `BYTES_PER_PIXEL` per pixel against both limits before a pixel
is decoded, and held until its request's messages are prepared (the chunks then hold the
processor's resized output only). A request over what is free now gets 429 (retry shortly);
an image larger than a whole limit gets 400 (retrying cannot help).
"""

from __future__ import annotations

import threading
from collections import Counter
from types import TracebackType

from kamera_agent.serve.protocol import RequestError

__all__ = ["BYTES_PER_PIXEL", "PixelLease", "PixelLimit"]

BYTES_PER_PIXEL = 16
"""Working memory per decoded pixel, decoding and preprocessing at their peak (measured: 14 on
the demo model's processor: PIL's 4-byte RGB, then the processor's uint8 and resized copies)."""


class PixelLimit:
    """Bytes of decoded images in flight: at most ``total`` on the server, ``per_tenant`` for one
    tenant. Thread-safe.

    Args:
        total: bytes in flight across tenants.
        per_tenant: bytes in flight for one tenant.
    """

    def __init__(self, total: int, per_tenant: int) -> None:
        self.total, self.per_tenant = total, per_tenant
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Bytes charged now, every tenant's together."""
        return sum(self._held.values())

    def lease(self, tenant: str) -> PixelLease:
        """A request's account: images charged to it as they are opened, all released at its end."""
        return PixelLease(self, tenant)

    def _take(self, tenant: str, nbytes: int, before: int, where: str) -> None:
        """Charge ``nbytes`` more to a request that holds ``before`` already."""
        limit = min(self.total, self.per_tenant)
        if before + nbytes > limit:
            raise RequestError(
                400,
                f"{where}: decoding this request's images takes {before + nbytes:,} bytes, more than "
                f"the server decodes at once ({limit:,}); send them smaller or fewer",
                param="messages",
            )
        with self._lock:
            tenant_free = self.per_tenant - self._held[tenant]
            free = self.total - sum(self._held.values())
            if nbytes > min(tenant_free, free):
                raise RequestError(
                    429,
                    f"{where}: images being decoded hold the server's pixel limit; retry shortly",
                    code="rate_limit_exceeded",
                )
            self._held[tenant] += nbytes

    def _give(self, tenant: str, nbytes: int) -> None:
        with self._lock:
            self._held[tenant] -= nbytes
            if self._held[tenant] <= 0:
                del self._held[tenant]


class PixelLease:
    """One request's decoded pixels in flight (a context manager: released on exit)."""

    def __init__(self, limit: PixelLimit, tenant: str) -> None:
        self.limit, self.tenant, self.nbytes = limit, tenant, 0

    def take(self, width: int, height: int, where: str) -> None:
        """Charge an image of ``width × height`` before it is decoded.

        Raises:
            RequestError: 429 when the limits have no room now, 400 when they never would
                (this image and the request's others together).
        """
        nbytes = width * height * BYTES_PER_PIXEL
        self.limit._take(self.tenant, nbytes, self.nbytes, where)
        self.nbytes += nbytes

    def release(self) -> None:
        """Give back everything charged to this lease."""
        if self.nbytes:
            self.limit._give(self.tenant, self.nbytes)
            self.nbytes = 0

    def __enter__(self) -> PixelLease:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.release()
