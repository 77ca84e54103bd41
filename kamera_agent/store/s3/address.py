"""Where an S3-compatible tier lives: a parsed ``s3://`` store URL.

Why one URL, as for Valkey: a deployment sets one variable (``KAMERA_STORE_URL``) on every
worker, so the URL carries every setting that must agree between processes. Credentials do not
ride in it: they come from the usual AWS places (``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY``, a profile, an instance role), so a URL in a log leaks nothing.

    s3://bucket[/prefix][?option=value&...]

Options: ``endpoint`` the server's URL for a store other than AWS (MinIO, Ceph, a local test
server: ``http://127.0.0.1:9000``; default: AWS), ``region`` (``us-east-1``), ``timeout``
seconds one HTTP call may take to connect and to answer (1.0), ``backoff`` seconds a tier that
did not answer is skipped before it is asked again (1.0, doubling up to 30 while it stays
away), ``pending_bytes`` the most bytes waiting to be written in the background (256 MiB; a
write beyond it is skipped and counted).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

from kamera_agent.errors import StoreURLError

__all__ = ["S3Address", "parse_s3_url"]

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class S3Address:
    """A parsed ``s3://`` URL (`parse_s3_url`); ``str()`` gives it back without options.

    Attributes:
        bucket: the bucket every entry is written to (it must exist).
        prefix: the key prefix of every entry (``""``, or ending in ``/``).
        endpoint: the server's URL, or ``None`` for AWS itself.
        region: the region the client signs for.
        timeout: seconds one HTTP call may take to connect, and again to answer.
        backoff: seconds an unanswering tier is skipped, to start with.
        pending_bytes: most bytes queued for background writes.
    """

    bucket: str
    prefix: str = ""
    endpoint: str | None = None
    region: str = "us-east-1"
    timeout: float = 1.0
    backoff: float = 1.0
    pending_bytes: int = 256 << 20

    def __str__(self) -> str:
        where = f" at {self.endpoint}" if self.endpoint else ""
        return f"s3://{self.bucket}/{self.prefix}{where}"


def parse_s3_url(url: str) -> S3Address:
    """The `S3Address` an ``s3://`` URL names.

    Raises:
        StoreURLError: another scheme, no bucket, a bucket name S3 refuses, an unknown option or
            a value out of range (the message names it and the fix).
    """
    parts = urlsplit(url)
    if parts.scheme.lower() != "s3":
        raise StoreURLError(f"{url!r} is not an s3:// URL; write s3://bucket/prefix")
    if parts.username or parts.password:
        raise StoreURLError(
            f"s3 URL for bucket {parts.hostname!r} carries credentials: leave them out and set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile) instead"
        )
    bucket = parts.netloc
    if not _BUCKET.match(bucket):
        raise StoreURLError(
            f"store URL {url!r}: {bucket!r} is not a bucket name (3-63 lower-case letters, digits, "
            "dots, hyphens); write s3://bucket/prefix"
        )
    prefix = parts.path.strip("/")
    return S3Address(bucket, f"{prefix}/" if prefix else "", **_options(parts.query, url))  # type: ignore[arg-type]


_NUMBERS = {"timeout": float, "backoff": float, "pending_bytes": int}


def _options(query: str, url: str) -> dict[str, str | float | int]:
    options: dict[str, str | float | int] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name == "endpoint":
            if not value.startswith(("http://", "https://")):
                raise StoreURLError(f"store URL {url!r}: endpoint must be http:// or https://, got {value!r}")
            options[name] = value
        elif name == "region":
            if not value:
                raise StoreURLError(f"store URL {url!r}: region is empty; e.g. region=us-east-1")
            options[name] = value
        elif name in _NUMBERS:
            try:
                number = _NUMBERS[name](value)
            except ValueError:
                raise StoreURLError(f"store URL {url!r}: {name}={value!r} is not a number") from None
            if not number > 0:
                raise StoreURLError(f"store URL {url!r}: {name} must be positive")
            options[name] = number
        else:
            known = ", ".join(sorted(["endpoint", "region", *_NUMBERS]))
            raise StoreURLError(f"store URL {url!r}: unknown option {name!r}; known: {known}")
    return options
