"""Tiers by URL scheme: a store URL's scheme names the `Tier` class that opens it.

Why: a store used to know its three tiers by name, so a fourth (an object store, a file
system) meant touching config, URLs, stats and every place that builds a store. Here a scheme
maps to ``"module.path:ClassName"``, imported on first use (vLLM's ``KVConnectorFactory``
shape): the built-in schemes cost no import until a URL names them (an S3 tier's client library
stays optional), and a third party adds a tier with one line, or with an entry point in the
``kamera_agent.tiers`` group (``s3 = "my_package.tier:MyTier"``), found on first use.

    store_url "s3://bucket/prefix?endpoint=…"
        └─ scheme "s3" ─► "kamera_agent.store.s3.tier:S3Tier" ─► import ─► S3Tier.from_url(url, context)

The class answers two classmethods of the `Tier` protocol: ``check_url`` (refuse a URL before
any store is built: settings are checked when they are made) and ``from_url`` (open it).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence
from importlib.metadata import entry_points

from kamera_agent.errors import StoreURLError, UnknownTierSchemeError
from kamera_agent.store.tier import Tier, TierContext

__all__ = ["BUILTIN_TIERS", "ENTRY_POINT_GROUP", "TIERS", "TierRegistry", "masked_url", "scheme_of"]

_REMOTE = "kamera_agent.store.remote.tier:RemoteTier"
BUILTIN_TIERS: dict[str, str] = {
    **{
        f"{base}{mode}": _REMOTE
        for base in ("redis", "valkey", "rediss", "valkeys")
        for mode in ("", "+cluster")
    },
    "s3": "kamera_agent.store.s3.tier:S3Tier",
}
"""The schemes kamera ships: Valkey/Redis (TLS, cluster) and S3-compatible object stores."""
ENTRY_POINT_GROUP = "kamera_agent.tiers"
"""The entry-point group a package names its tiers in (scheme = ``"module:Class"``)."""


def scheme_of(url: str) -> str:
    """The lower-cased scheme of ``url`` (``""`` when it has none)."""
    scheme, sep, _ = url.partition("://")
    return scheme.lower() if sep else ""


class TierRegistry:
    """Schemes to tier classes, each imported on first use. Thread-safe.

    Args:
        targets: scheme -> ``"module.path:ClassName"`` to start with (`BUILTIN_TIERS`).
        entry_points: also look an unknown scheme up in the `ENTRY_POINT_GROUP` entry points.
    """

    def __init__(self, targets: dict[str, str] | None = None, *, entry_points: bool = True) -> None:
        self._targets = dict(BUILTIN_TIERS if targets is None else targets)
        self._loaded: dict[str, type[Tier]] = {}
        self._lock = threading.Lock()
        self._entry_points = entry_points

    def register(self, scheme: str, target: str | type[Tier]) -> None:
        """Let URLs of ``scheme`` open ``target``: a `Tier` class, or ``"module.path:ClassName"``
        imported when a URL first names it (registering one twice replaces it).

        Raises:
            StoreURLError: a scheme that is not a URL scheme, or a target not of that form.
        """
        name = scheme.lower()
        if not name or not all(c.isalnum() or c in "+-." for c in name):
            raise StoreURLError(f"tier scheme {scheme!r} is not a URL scheme: use letters, digits, + - .")
        if isinstance(target, str) and target.count(":") != 1:
            raise StoreURLError(f"tier {target!r} for {name}:// is not 'module.path:ClassName'")
        with self._lock:
            self._loaded.pop(name, None)
            if isinstance(target, str):
                self._targets[name] = target
            else:
                self._targets[name] = f"{target.__module__}:{target.__qualname__}"
                self._loaded[name] = target

    @property
    def schemes(self) -> list[str]:
        """Every registered scheme, sorted (entry points count once they were looked up)."""
        with self._lock:
            return sorted(self._targets)

    def tier_class(self, url: str) -> type[Tier]:
        """The `Tier` class ``url``'s scheme names, imported now if it was not yet.

        Raises:
            UnknownTierSchemeError: no tier is registered for the scheme (the message lists them).
            StoreURLError: the registered target does not import or is not a `Tier`.
        """
        scheme = scheme_of(url)
        with self._lock:
            if scheme in self._loaded:
                return self._loaded[scheme]
            target = self._targets.get(scheme) or self._from_entry_points(scheme)
        if target is None:
            raise self._unknown(url, scheme)
        loaded = _load(scheme, target)
        with self._lock:
            self._loaded[scheme] = loaded
        return loaded

    def check(self, url: str) -> None:
        """Refuse ``url`` unless a registered tier would open it (connects to nothing)."""
        self.tier_class(url).check_url(url)

    def open(self, url: str, context: TierContext) -> Tier:
        """The tier ``url`` names, opened for ``context``'s model and deadlines."""
        return self.tier_class(url).from_url(url, context)

    def open_all(self, urls: Sequence[str], context: TierContext) -> list[Tier]:
        """The tiers of ``urls`` in order; all checked before any is opened, and those opened
        closed again when a later one fails (a failed store build leaves nothing running)."""
        for url in urls:
            self.check(url)
        opened: list[Tier] = []
        try:
            for url in urls:
                opened.append(self.open(url, context))
        except BaseException:
            for tier in opened:
                tier.close()
            raise
        return opened

    def _from_entry_points(self, scheme: str) -> str | None:
        """A third party's target for ``scheme`` (called under the lock), remembered."""
        if not self._entry_points or not scheme:
            return None
        for point in entry_points(group=ENTRY_POINT_GROUP):
            if point.name.lower() == scheme:
                self._targets[scheme] = point.value
                return point.value
        return None

    def _unknown(self, url: str, scheme: str) -> UnknownTierSchemeError:
        said = f"scheme {scheme!r}" if scheme else "no scheme"
        return UnknownTierSchemeError(
            f"store URL {masked_url(url)!r} has {said}, and no tier is registered for it; registered: "
            f"{', '.join(self.schemes)}. Write one of those (e.g. redis://host:6379/0, "
            "s3://bucket/prefix), or register a tier: kamera_agent.store.registry.TIERS.register"
            f"({scheme or 'scheme'!r}, 'module.path:ClassName')"
        )


def _load(scheme: str, target: str) -> type[Tier]:
    """Import ``"module.path:ClassName"`` and check it is a `Tier`."""
    module_name, _, attribute = target.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise StoreURLError(
            f"the tier registered for {scheme}:// ({target}) does not import: {exc}. Install the "
            "package that provides it, or register the right 'module.path:ClassName'"
        ) from exc
    if not (isinstance(found, type) and issubclass(found, Tier)):
        raise StoreURLError(f"{target}, registered for {scheme}://, is not a Tier class")
    return found


def masked_url(url: str) -> str:
    """``url`` with any password masked (messages never print one)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        return url
    return f"{scheme}{sep}{userinfo.partition(':')[0]}:***@{hosts}{slash}{path}"


TIERS = TierRegistry()
"""This process's tiers by scheme: what every store built from a URL asks (register yours here)."""
