"""Build tiny onnxruntime-genai Llama models (fp32 and int4) for the tests.

Offline: a random LlamaConfig, a small byte-level BPE tokenizer trained on a
few sentences, ``save_pretrained`` of both, then the onnxruntime-genai model
builder (``-p fp32`` and ``-p int4``, ``-e cpu``).  Needs torch, transformers,
tokenizers and onnxruntime-genai (the shared /work/venvs/llm venv):

    python scripts/make_genai_fixtures.py [OUT]   # default tests/data/genai

writes OUT/llama-fp32/ and OUT/llama-int4/ (genai model folders).  The
builder's conditions: a tokenizer beside the model, a head size that is a
multiple of 16 (CPU GroupQueryAttention), intermediate_size != vocab_size.
``make_folder`` is reused by examples/finetune_genai_lora.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "onnx models train on onnxruntime with low rank adapters",
    "a small language model learns a phrase by heart",
    "hello world, this is a tiny tokenizer for tests",
    "the answer is forty two and the sky is blue",
    "numbers 0 1 2 3 4 5 6 7 8 9 and letters a b c d e f g",
]


def make_tokenizer(folder: Path, vocab_size: int):
    """A byte-level BPE tokenizer (og.Tokenizer loads BPE, not word-level)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    return fast


def make_hf(folder: Path, *, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96,
            vocab=320, seed=0):
    """A random Llama with its tokenizer saved in ``folder`` (transformers layout)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer(folder, vocab)
    n_vocab = len(tok)
    if intermediate == n_vocab:
        intermediate += 16  # the builder would take a layer for the LM head
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=n_vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger random weights: a less uniform next-token distribution
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    return model


def build(hf: Path, out: Path, precision: str) -> Path:
    """Run the onnxruntime-genai builder on a saved Hugging Face folder."""
    cache = Path(tempfile.mkdtemp(prefix="genai-cache-"))
    try:
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf),
                        "-o", str(out), "-p", precision, "-e", "cpu", "-c", str(cache)],
                       check=True, stdout=subprocess.DEVNULL)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return out


def make_folder(out: Path, precisions=("fp32", "int4"), **config) -> dict[str, Path]:
    """Build genai folders ``out/llama-<precision>`` from one random Llama."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        make_hf(hf, **config)
        folders = {}
        for p in precisions:
            target = out / f"llama-{p}"
            if target.exists():
                shutil.rmtree(target)
            folders[p] = build(hf, target, p)
    return folders


if __name__ == "__main__":
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "tests/data/genai"
    for p, f in make_folder(dest).items():
        print(p, f, sorted(os.listdir(f)))
