"""`EntryKey`'s typed makers build exactly the key its constructor builds (they skip its
``__new__``): equal, equally hashed, of the same type."""

from __future__ import annotations

from kamera_agent.store.keys import EntryKey


def test_each_typed_maker_is_the_constructor() -> None:
    made = [EntryKey.canonical("k"), EntryKey.full("k", "s"), EntryKey.vision("v"), EntryKey.patch("k", "p")]
    built = [
        EntryKey("canonical", "k"),
        EntryKey("full", "k", "s"),
        EntryKey("vision", "v"),
        EntryKey("patch", "k", "p"),
    ]
    for key, same in zip(made, built, strict=True):
        assert type(key) is EntryKey and key == same and hash(key) == hash(same) and repr(key) == repr(same)
        assert key.digest == same.digest
