"""Engine tests keep the engines' default stores (`kamera_agent.engines.stores`) in a folder of
this run, never in the user's cache: a tiny model saved with a fixed seed has the same
fingerprint in every run, and a run must not find the last one's captures. Subprocesses (a
scenario's interpreter, ``vllm serve``) inherit it; a test that needs a store of its own sets
``KAMERA_STORE_DIR`` for its process."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from kamera_agent.engines.stores import STORE_DIR_VARIABLE

os.environ[STORE_DIR_VARIABLE] = tempfile.mkdtemp(prefix="kamera-engine-stores-")
atexit.register(shutil.rmtree, os.environ[STORE_DIR_VARIABLE], True)
