"""What an S3 tier's bucket holds, and emptying it: ``kamera store stats|clear`` on ``s3://``.

Why a listing of our own prefix: a bucket holds whatever else its owners keep; an operator
sizing the tier needs kamera's entries by kind and by model, which their object names say
(``<prefix><model>/<chunk>/<kind>[/<variant>]``, `S3Tier`). Listing and deleting go a page
(1,000 objects) at a time, so a large bucket is never read whole into memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kamera_agent.store.s3.address import S3Address
from kamera_agent.store.usage import TierUsage

__all__ = ["clear", "usage"]


def usage(address: S3Address, client: Any, model: str | None = None) -> TierUsage:
    """Count kamera's objects under the address's prefix (of ``model`` only, when given)."""
    found, other = TierUsage(), 0
    for page in _pages(address, client, model):
        for listed in page:
            fields = listed["Key"][len(address.prefix) :].split("/")
            if len(fields) < 3:  # not an entry's name: another owner's object under the prefix
                other += 1
                continue
            found.entries[fields[2]] += 1
            found.nbytes[fields[2]] += int(listed.get("Size", 0))
            found.models[fields[0]] += 1
    if other:
        found.notes.append(f"{other:,} other objects under {address} (not kamera's entries)")
    return found


def clear(address: S3Address, client: Any, model: str | None = None) -> int:
    """Delete kamera's objects under the address's prefix (of ``model`` only, when given);
    returns how many went."""
    removed = 0
    for page in _pages(address, client, model):
        names = [
            {"Key": listed["Key"]} for listed in page if listed["Key"][len(address.prefix) :].count("/") >= 2
        ]
        if names:
            client.delete_objects(Bucket=address.bucket, Delete={"Objects": names, "Quiet": True})
            removed += len(names)
    return removed


def _pages(address: S3Address, client: Any, model: str | None) -> Iterator[list[dict[str, Any]]]:
    prefix = f"{address.prefix}{model}/" if model else address.prefix
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=address.bucket, Prefix=prefix):
        yield list(page.get("Contents", []))
