#!/usr/bin/env bash
# Create benchmarks/.venv-ort-training: ONNX Runtime training 1.19.2 (CPU), the
# peer that benchmarks/run.py drives as a subprocess.
#
# Pins:
# - onnx 1.16.2: onnx >= 1.18 writes IR 14 models that break the 1.19 training
#   optimizer/artifact code;
# - numpy 1.26.4: the 1.19 wheels are built against the numpy 1.x ABI;
# - torch: onnxruntime.training imports it without declaring it (the CPU wheel
#   is taken from pip's find-links when one is configured).
#
# The same environment exports W5/W6 from PyTorch (benchmarks/export_models.py)
# and runs their torch peer, so it also holds:
# - torchvision 0.28.0 (the release for torch 2.13) with --no-deps: the registry
#   wheel is a CUDA build whose dependencies would pull CUDA torch; only its
#   pure-Python model definitions are used (its compiled operator registrations
#   are kept from loading, see torch_models.py), with pillow, which it imports;
# - transformers 5.24.0 (W6's BERT; random weights from a config, no download).
#
# Usage: bash benchmarks/setup_ort_training.sh [python]   (default: python3)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-ort-training"
python="${1:-python3}"
check='import sys, types; sys.modules["torchvision._meta_registrations"] = types.ModuleType("stub"); import onnxruntime.training.api, onnxruntime.training.artifacts, torch, torchvision, transformers'
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$check" 2>/dev/null; then
    echo "$venv is ready"
    exit 0
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet \
    "onnxruntime-training-cpu==1.19.2" "onnx==1.16.2" "numpy==1.26.4" "torch==2.13.0"
"$venv/bin/pip" install --quiet "transformers==5.24.0" "pillow>=10" "numpy==1.26.4"
"$venv/bin/pip" install --quiet --no-deps "torchvision==0.28.0"
"$venv/bin/python" -c "$check"
"$venv/bin/python" -c "import onnxruntime, onnx, torch; from onnxruntime.training import api, artifacts; print('onnxruntime', onnxruntime.__version__, 'onnx', onnx.__version__, 'torch', torch.__version__)"
echo "$venv is ready"
