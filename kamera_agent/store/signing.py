"""Signed store entries: a keyed MAC that tells an entry this deployment wrote from a forgery.

Why: the checksums (a disk file's sha256, a remote head's payload digest) stop accidents, not
writers. Anyone who can write to the shared server or the disk directory can re-address chunk
A's canonical as chunk B's, fix up the sha256, and every process serves it. With a shared
secret, every entry a tier stores carries ``mac = HMAC-SHA256(secret, content digest)`` in its
own metadata, where the content digest (`kamera_agent.store.codec.content_digest`) covers the
address (kind, key, variant), the model fingerprint, the codec metadata and every tensor's
dtype, shape and bytes: a re-addressed, re-fingerprinted or edited entry no longer verifies.

Rotation: entries are signed with the current secret and accepted under the current or any
previous one, so during a rollover processes with the new secret still read what the old one
signed (and write entries the old processes, given the new secret as a previous one, accept).
Without a secret nothing is signed or checked: write access to the store is full trust.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kamera_agent.errors import SettingsError

__all__ = ["MAC_FIELD", "PREVIOUS_SECRETS_VARIABLE", "SECRET_VARIABLE", "Signer"]

MAC_FIELD = "mac"
"""The entry metadata field that holds the MAC (hex), absent from unsigned entries."""
SECRET_VARIABLE = "KAMERA_STORE_SECRET"
"""The environment variable the secret is read from when the settings name none."""
PREVIOUS_SECRETS_VARIABLE = "KAMERA_STORE_PREVIOUS_SECRETS"
"""Comma-separated secrets still accepted on read during a rollover."""


@dataclass(frozen=True, repr=False)
class Signer:
    """Signs entries with ``secret`` and accepts those signed with it or any of ``previous``.

    Never printed (``repr`` names no secret).
    """

    secret: bytes
    previous: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if not self.secret:
            raise ValueError("a store secret must not be empty")

    @classmethod
    def from_settings(cls, secret: str | bytes | None, previous: Sequence[str | bytes] = ()) -> Signer | None:
        """A signer for ``secret`` (else ``$KAMERA_STORE_SECRET``), accepting ``previous`` (else
        ``$KAMERA_STORE_PREVIOUS_SECRETS``, comma-separated); ``None`` when no secret is set.

        Raises:
            SettingsError: an empty secret, given or in the environment (it used to mean "no
                signing", silently).
        """
        if secret is None:
            secret = os.environ.get(SECRET_VARIABLE)
            if secret is not None and not secret:
                raise SettingsError(
                    f"{SECRET_VARIABLE} is set but empty: an empty secret would sign nothing and "
                    f"accept forged entries; set a secret, or unset {SECRET_VARIABLE} for an unsigned store"
                )
        if secret is None:
            return None
        if not secret:
            raise SettingsError(
                "store_secret is empty: an empty secret would sign nothing and accept forged entries; "
                "set a secret, or pass None for an unsigned store"
            )
        if not previous:
            previous = [s for s in os.environ.get(PREVIOUS_SECRETS_VARIABLE, "").split(",") if s]
        return cls(_bytes(secret), tuple(_bytes(s) for s in previous))

    def sign(self, digest: str) -> str:
        """The MAC of an entry's content digest under the current secret (hex)."""
        return _mac(self.secret, digest)

    def verifies(self, digest: str, mac: str) -> bool:
        """Whether ``mac`` is the MAC of ``digest`` under the current or a previous secret."""
        return any(hmac.compare_digest(_mac(key, digest), mac) for key in (self.secret, *self.previous))

    def __repr__(self) -> str:
        return f"Signer(1 secret, {len(self.previous)} previous)"


def _mac(secret: bytes, digest: str) -> str:
    return hmac.new(secret, digest.encode(), hashlib.sha256).hexdigest()


def _bytes(secret: str | bytes) -> bytes:
    return secret.encode() if isinstance(secret, str) else bytes(secret)
