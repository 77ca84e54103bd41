"""``kamera store stats|clear [--url URL] [--model FINGERPRINT]``: a shared store from the shell.

The URL defaults to ``$KAMERA_STORE_URL``, the variable every window reads, so an operator
inspects exactly the store the workers share.
"""

from __future__ import annotations

import argparse
import os

from rich.console import Console
from rich.table import Table

from kamera_agent.errors import StoreURLError
from kamera_agent.parsers.model import add_store_parser  # declared without torch: `kamera --help`
from kamera_agent.store.registry import TIERS, scheme_of
from kamera_agent.store.remote.address import parse_store_url
from kamera_agent.store.remote.admin import clear, usage
from kamera_agent.store.remote.connection import RemoteUnavailable
from kamera_agent.store.remote.tier import RemoteTier

__all__ = ["add_store_parser", "run_store_command"]

_VARIABLE = "KAMERA_STORE_URL"


def run_store_command(args: argparse.Namespace, console: Console) -> int:
    url = args.url or os.environ.get(_VARIABLE)
    if not url:
        console.print(f"[red]no store URL: pass --url redis://host:6379/0 or set ${_VARIABLE}[/red]")
        return 2
    try:
        if TIERS.tier_class(url) is not RemoteTier:  # a URL of another registered tier
            raise StoreURLError(
                f"kamera store counts and clears Valkey/Redis stores; {scheme_of(url)}:// is another "
                "tier's: use its own tools (an S3 bucket: aws s3 ls / aws s3 rm on its prefix)"
            )
        address = parse_store_url(url)
    except StoreURLError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    try:
        if args.action == "clear":
            if not args.yes:
                console.print(f"[yellow]this deletes kamera's entries on {address}; add --yes[/yellow]")
                return 2
            removed = clear(address, args.model)
            console.print(f"removed {removed:,} keys from {address}")
            return 0
        found = usage(address, args.model)
    except RemoteUnavailable as exc:
        console.print(f"[red]{address} did not answer: {exc}[/red]")
        return 1
    table = Table(title=f"kamera entries on {address}")
    for column in ("kind", "entries", "KiB"):
        table.add_column(column, justify="right")
    for kind in sorted(set(found.entries) | set(found.nbytes)):
        table.add_row(kind, f"{found.entries[kind]:,}", f"{found.nbytes[kind] / 2**10:,.1f}")
    table.add_row("all", f"{sum(found.entries.values()):,}", f"{sum(found.nbytes.values()) / 2**10:,.1f}")
    console.print(table)
    models = ", ".join(f"{fp[:16]}… {n:,}" for fp, n in found.models.most_common()) or "none"
    console.print(f"{found.parts:,} part values; entries by model: {models}")
    server = found.server
    console.print(
        f"server: used_memory {server.get('used_memory')} bytes, maxmemory {server.get('maxmemory')} "
        f"(0: unlimited), policy {server.get('maxmemory_policy')}"
    )
    return 0
