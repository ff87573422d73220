#!/usr/bin/env bash
# Create benchmarks/.venv-onnx2torch: onnx2torch + PyTorch (CPU), the "convert and
# train in PyTorch" peer that benchmarks/run.py drives as the onnx2torch column.
#
# - torch==2.13.0: the CPU wheel (from pip's find-links when one is configured);
#   a bare `pip install torch` from PyPI pulls the CUDA build.
# - onnx2torch 1.5.15 with --no-deps: its declared dependencies would pull
#   torchvision's CUDA wheels. It imports torchvision (for NMS and RoiAlign), so
#   torchvision 0.28 (the release for torch 2.13) goes in with --no-deps too,
#   with pillow, which it imports; its compiled operator registrations are kept
#   from loading by the worker (benchmarks/worker.py), the Python parts work.
#
# Usage: bash benchmarks/setup_onnx2torch.sh [python]   (default: python3)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-onnx2torch"
python="${1:-python3}"
check='import sys, types; sys.modules["torchvision._meta_registrations"] = types.ModuleType("stub"); import torch, onnx, onnx2torch; from importlib.metadata import version; print("torch", torch.__version__, "onnx", onnx.__version__, "onnx2torch", version("onnx2torch"))'
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$check" 2>/dev/null; then
    echo "$venv is ready"
    exit 0
fi
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "torch==2.13.0" "onnx==1.23.2" numpy
"$venv/bin/pip" install --quiet "pillow>=10"
"$venv/bin/pip" install --quiet --no-deps "torchvision==0.28.0" "onnx2torch==1.5.15"
"$venv/bin/python" -c "$check"
echo "$venv is ready"
