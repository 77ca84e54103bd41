"""An orbit entry's membership meta is the JSON text ``json.dumps`` writes, read back as written."""

from __future__ import annotations

import json
import secrets

from kamera_agent.core.orbits import _members, _members_meta


def test_an_orbits_members_meta_is_what_json_dumps_writes_and_reads_back() -> None:
    for count in range(4):
        members = [secrets.token_hex(16) for _ in range(count)]
        meta = _members_meta(members)
        assert meta == {"members": json.dumps(members)}
        assert _members(meta) == members


def test_members_read_from_a_store_are_escaped_not_spliced() -> None:
    """Why: a store entry's members come from whoever wrote it; text written by hand would let
    ``x", "y`` become two members."""
    members = [secrets.token_hex(16), 'x", "y', "back\\slash"]
    meta = _members_meta(members)
    assert meta == {"members": json.dumps(members)}
    assert _members(meta) == members
