#!/usr/bin/env bash
# Create benchmarks/.venv-peft: PyTorch (CPU) + transformers + peft, the peer
# of benchmarks/lora_peft.py, with onnxtrain installed editable beside them so
# one interpreter can export the model and drive both frameworks.
#
# - torch==2.13.0: the CPU wheel (from pip's find-links when one is configured;
#   otherwise from PyTorch's CPU index). A bare `pip install torch` from PyPI
#   pulls the CUDA build, several GB.
# - onnxscript: torch.onnx.export's dynamo exporter needs it.
# - transformers, peft, onnxscript: the versions the numbers in docs/large-models.md
#   were measured with.
#
# Usage: bash benchmarks/setup_peft.sh [python]   (default: python3)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
venv="$here/.venv-peft"
python="${1:-python3}"
check='import torch, transformers, peft, onnxscript, onnxruntime_genai, onnxtrain; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "onnxscript", onnxscript.__version__)'
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$check" 2>/dev/null; then
    echo "$venv is ready"
    exit 0
fi
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "torch==2.13.0"
"$venv/bin/pip" install --quiet "transformers==5.24.0" "peft==0.21.2" "onnxscript==0.7.2" "onnxruntime-genai==0.18.0" -e "$root"
"$venv/bin/python" -c "$check"
echo "$venv is ready"
