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
# Usage: bash benchmarks/setup_ort_training.sh [python]   (default: python3)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-ort-training"
python="${1:-python3}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import onnxruntime.training.api, onnxruntime.training.artifacts" 2>/dev/null; then
    echo "$venv is ready"
    exit 0
fi
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet \
    "onnxruntime-training-cpu==1.19.2" "onnx==1.16.2" "numpy==1.26.4" "torch==2.13.0"
"$venv/bin/python" -c "import onnxruntime, onnx, torch; from onnxruntime.training import api, artifacts; print('onnxruntime', onnxruntime.__version__, 'onnx', onnx.__version__, 'torch', torch.__version__)"
echo "$venv is ready"
