#!/usr/bin/env bash
# Make (or refresh) the project's virtual environment in .venv: what the demo and the main test
# suite need, nothing more. Offline-friendly and idempotent; one line per step.
#
# Why a script: a fresh machine has only Python and pip, and an unpinned `pip install torch`
# pulls a multi-GB CUDA build. We install the pinned CPU build first where torch is absent,
# then the project with its dev extras (the range in pyproject.toml is satisfied by it).
# The engines' own environments (.venv-sglang, .venv-vllm) are built on first use by the tests
# that need them (tests/engines/test_sglang_env.py, tests/engines/test_vllm_env.py), so the README's
# test command still builds and runs them on a fresh clone, and the demo never waits for them.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/side_env.sh

PYTHON="${PYTHON:-python3}"
TORCH_PIN="${KAMERA_TORCH_PIN:-torch==2.13.0}"
started=$SECONDS

step() { echo "bootstrap: $*"; }

if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv .venv
  quiet_pip .venv/bin/python --upgrade pip
fi

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  step "installing $TORCH_PIN (CPU build)"
  quiet_pip .venv/bin/python "$TORCH_PIN"
fi

# Reinstall the project only when its metadata changed since the last bootstrap.
stamp=".venv/.kamera-bootstrap"
want="$(sha256sum < pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  step "installing kamera-agent and its dev tools into .venv"
  quiet_pip .venv/bin/python -e ".[dev]"
  echo "$want" > "$stamp"
fi
step ".venv ready ($(( SECONDS - started )) s)"
