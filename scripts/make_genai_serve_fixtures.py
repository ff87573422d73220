"""Build the tiny onnxruntime-genai Llamas (fp32, int4) of the LoRA/QLoRA serving tests.

Offline: a random LlamaConfig (hidden 64, 2 layers, 4 heads of 16, 2 KV
heads, intermediate 96) and a small byte-level BPE tokenizer (320 tokens),
``save_pretrained`` of both, then the onnxruntime-genai model builder
(``-p fp32`` and ``-p int4``, ``-e cpu``): examples/finetune_genai_lora.py's
``make_genai_models``.  Needs torch, transformers, tokenizers and
onnxruntime-genai (e.g. the shared /work/venvs/llm venv):

    python scripts/make_genai_serve_fixtures.py [OUT]   # default tests/data/genai_serve

writes OUT/llama-fp32/ and OUT/llama-int4/ (genai model folders).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from finetune_genai_lora import make_genai_models  # noqa: E402

if __name__ == "__main__":
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests" / "data" / "genai_serve"
    for p, f in make_genai_models(dest, "tiny").items():
        print(p, f, sorted(os.listdir(f)))
