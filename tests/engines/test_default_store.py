"""An engine with no store named keeps its entries in one disk folder every process of the machine
shares (`kamera_agent.engines.stores`): two processes write and read one default folder at once."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kamera_agent.config import WindowConfig
from kamera_agent.engines.stores import DEFAULT_DISK_LIMIT, STORE_DIR_VARIABLE, StoreRegistry
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.store import EntryKey

ROOT = Path(__file__).resolve().parents[2]
FP = "e" * 64

_OTHER = """
import sys
import torch
from kamera_agent.config import WindowConfig
from kamera_agent.engines.stores import STORES
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.store import EntryKey

store = STORES.open(sys.argv[1], WindowConfig.exact())
kv = ChunkKV(torch.full((2, 1, 3, 4), 7.0), torch.zeros(2, 1, 3, 4), None, "theirs", sys.argv[1])
store.put(EntryKey.full("theirs", "s"), kv)
print("filed", flush=True)
sys.stdin.readline()  # the test files its own entry meanwhile
mine = store.get(EntryKey.full("mine", "s"))
assert isinstance(mine, ChunkKV) and float(mine.keys.sum()) == 24.0, mine
print("read", flush=True)
"""


def test_two_processes_write_and_read_one_default_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(STORE_DIR_VARIABLE, str(tmp_path))
    monkeypatch.delenv("KAMERA_STORE_URL", raising=False)
    other = subprocess.Popen(
        [sys.executable, "-c", _OTHER, FP],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    registry = StoreRegistry()
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "filed"
        with caplog.at_level(logging.WARNING, logger="kamera_agent.engines.stores"):
            store = registry.open(FP, WindowConfig.exact())
        folder = tmp_path / FP[:32]
        assert store.disk_dir == folder and str(folder) in caplog.text  # one line names the folder
        assert store.stats().disk_limit == DEFAULT_DISK_LIMIT
        theirs = store.get(EntryKey.full("theirs", "s"))  # filed by the other process, still running
        assert isinstance(theirs, ChunkKV) and float(theirs.keys.sum()) == 7.0 * 24
        store.put(EntryKey.full("mine", "s"), ChunkKV(torch.ones(2, 1, 3, 4), torch.zeros(2, 1, 3, 4)))
        assert other.stdin is not None
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "read"  # the other read this process's entry
    finally:
        registry.close()
        if other.stdin is not None:
            other.stdin.close()
        other.wait(timeout=60)
        if other.stdout is not None:
            other.stdout.close()
    assert other.returncode == 0


def test_a_store_url_or_a_disk_dir_in_the_settings_is_used_as_named(tmp_path: Path) -> None:
    registry = StoreRegistry()
    try:
        config = WindowConfig.exact(disk_dir=tmp_path / "mine", disk_limit=1 << 20)
        store = registry.open(FP, config)
        assert store.disk_dir == tmp_path / "mine" and store.stats().disk_limit == 1 << 20
        assert registry.open(FP, config) is store and len(registry) == 1  # opened once
    finally:
        registry.close()
