"""Test-wide settings: one torch thread (small ops on busy 2-core machines), fixed seeds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from kamera_agent.settings import configure_threads

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
configure_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
