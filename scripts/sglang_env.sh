#!/usr/bin/env bash
# Make (or refresh) .venv-sglang: SGLang 0.5.23's own classes on CPU, for the `sglang` tests.
#
# Why a second environment: SGLang 0.5.23 pins transformers 5.19 (the project's .venv has a
# newer one) and torch 2.14 with CUDA. Here torch stays the CPU build 2.13.0 (a constraint
# keeps every install from replacing it), SGLang is installed without its dependencies, and
# only what its scheduler-side modules import is added (found by importing them: pools,
# allocators, radix caches, the registry, Req, ScheduleBatch, PrefillAdder). PyPI's
# torchvision does not import beside the CPU torch: a stand-in (scripts/sglang_stubs) takes
# its place for the module-level imports that those classes never call.
# Idempotent: a stamp of this script and pyproject.toml skips an up-to-date environment.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-sglang
source scripts/side_env.sh
side_env_begin "$VENV" sglang "sglang_env: building $VENV (SGLang 0.5.23 classes on the CPU torch)" \
  scripts/sglang_env.sh scripts/sglang_stubs/torchvision/__init__.py pyproject.toml
pip_install --no-deps "sglang==0.5.23"
pip_install "transformers==5.19.*" orjson psutil pybase64 requests pillow starlette msgspec pyzmq \
  aiohttp dill triton ipython "apache-tvm-ffi==0.1.11" sentencepiece compressed-tensors gguf openai \
  partial-json-parser einops
# kamera-agent itself (its runtime dependencies, not the dev tools) and the test runner
pip_install pydantic networkx rich safetensors opencv-python-headless pytest
pip_install --no-deps -e .
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -rf "$site/torchvision"
cp -r scripts/sglang_stubs/torchvision "$site/torchvision"
"$VENV/bin/python" -c "import sglang.srt.mem_cache.registry, sglang.srt.managers.schedule_policy, kamera_agent"
side_env_done
