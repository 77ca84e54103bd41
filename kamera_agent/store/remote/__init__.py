"""The shared tier of the store: Valkey/Redis, under memory and disk (``store_url``).

`parse_store_url` reads a URL into a `RemoteAddress`; `RemoteTier` moves serialized entries;
`framing` names keys and frames values; `connection` bounds every call.
"""

from kamera_agent.store.remote.address import RemoteAddress, parse_store_url
from kamera_agent.store.remote.tier import RemoteTier

__all__ = ["RemoteAddress", "RemoteTier", "parse_store_url"]
