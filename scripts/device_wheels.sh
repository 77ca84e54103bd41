#!/usr/bin/env bash
# The wheels the lent GPU machine lacks, downloaded into .device/wheels (ignored, carried by the
# device run): its image has torch, transformers, networkx, pillow, opencv, rich and safetensors
# but not pydantic, and it cannot reach the network. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device/wheels
if ! ls .device/wheels/pydantic_core-*.whl >/dev/null 2>&1; then
    .venv/bin/python -m pip download --quiet --dest .device/wheels --only-binary=:all: \
        --python-version 3.12 --platform manylinux2014_x86_64 "pydantic>=2.6"
fi
ls .device/wheels
