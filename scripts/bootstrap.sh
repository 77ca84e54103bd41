#!/usr/bin/env bash
# Make (or refresh) the project's virtual environment in .venv, offline-friendly and idempotent.
#
# Why a script: a fresh machine has only Python and pip, and an unpinned `pip install torch`
# pulls a multi-GB CUDA build. We install the pinned CPU build first where torch is absent,
# then the project with its dev extras (the range in pyproject.toml is satisfied by it).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
TORCH_PIN="${KAMERA_TORCH_PIN:-torch==2.13.0}"

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "bootstrap: installing $TORCH_PIN (CPU build)"
  .venv/bin/python -m pip install -q "$TORCH_PIN"
fi

# Reinstall the project only when its metadata changed since the last bootstrap.
stamp=".venv/.kamera-bootstrap"
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing kamera-agent and its dev tools into .venv"
  .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi

# vLLM's CPU build for the connector's tests (its own environment; idempotent, ~1.5 min new).
bash scripts/vllm_env.sh
