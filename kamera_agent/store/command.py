"""``kamera store stats|clear [--url URL] [--model FINGERPRINT]``: a shared store from the shell.

The URL defaults to ``$KAMERA_STORE_URL``, the variable every window reads, so an operator
inspects exactly the store the workers share. Its scheme names the tier (`TIERS`), and the tier
counts and deletes its own entries (`Tier.url_usage`, `Tier.url_clear`): a Valkey/Redis server,
an S3 bucket, or any tier registered with those classmethods, with no code here per tier.
"""

from __future__ import annotations

import argparse
import os

from rich.console import Console
from rich.table import Table

from kamera_agent.errors import StoreUnavailableError, StoreURLError
from kamera_agent.parsers.model import add_store_parser  # declared without torch: `kamera --help`
from kamera_agent.store.registry import TIERS, masked_url
from kamera_agent.store.usage import TierUsage

__all__ = ["add_store_parser", "run_store_command"]

_VARIABLE = "KAMERA_STORE_URL"


def run_store_command(args: argparse.Namespace, console: Console) -> int:
    url = args.url or os.environ.get(_VARIABLE)
    if not url:
        console.print(
            f"[red]no store URL: pass --url redis://host:6379/0 (or s3://bucket/prefix), "
            f"or set ${_VARIABLE}[/red]"
        )
        return 2
    try:
        tier = TIERS.tier_class(url)
        tier.check_url(url)
        if args.action == "clear":
            if not args.yes:
                console.print(f"[yellow]this deletes kamera's entries at {_where(url)}; add --yes[/yellow]")
                return 2
            removed = tier.url_clear(url, args.model)
            console.print(f"removed {removed:,} keys from {_where(url)}")
            return 0
        found = tier.url_usage(url, args.model)
    except (StoreURLError, StoreUnavailableError) as exc:  # a URL refused: 2; a store away: 1
        console.print(f"[red]{exc}[/red]")
        return 1 if isinstance(exc, StoreUnavailableError) else 2
    _print_usage(console, found, _where(url))
    return 0


def _print_usage(console: Console, found: TierUsage, where: str) -> None:
    table = Table(title=f"kamera entries at {where}")
    for column in ("kind", "entries", "KiB"):
        table.add_column(column, justify="right")
    for kind in sorted(set(found.entries) | set(found.nbytes)):
        table.add_row(kind, f"{found.entries[kind]:,}", f"{found.nbytes[kind] / 2**10:,.1f}")
    table.add_row("all", f"{sum(found.entries.values()):,}", f"{sum(found.nbytes.values()) / 2**10:,.1f}")
    console.print(table)
    models = ", ".join(f"{fp[:16]}… {n:,}" for fp, n in found.models.most_common()) or "none"
    parts = f"{found.parts:,} part values; " if found.parts else ""
    console.print(f"{parts}entries by model: {models}")
    for note in found.notes:
        console.print(note)


def _where(url: str) -> str:
    """The URL without its query and password: what a message may show."""
    return masked_url(url.partition("?")[0])
