"""Shared helpers of the onnxruntime-genai tests: the committed genai Llama
fixtures (tests/data/genai_serve, made by scripts/make_genai_serve_fixtures.py), their
feeds, a memorized-phrase task and greedy decoding with ``sess.run``.

onnxruntime-genai is imported only by ``og_greedy``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from onnxtrain import TrainingSession, build

DATA = Path(__file__).resolve().parents[1] / "data" / "genai_serve"
FOLDERS = {"fp32": DATA / "llama-fp32", "int4": DATA / "llama-int4"}
LAYERS, KV_HEADS, HEAD = 2, 2, 16
EOS = 1
#: The memorized phrase (token ids): a prompt and the continuation taught.
PROMPT = [17, 42, 99]
PHRASE = [203, 11, 57, 140, 57, 88, 301, 64]


def feeds(ids: np.ndarray) -> dict[str, np.ndarray]:
    """The genai decoder's inputs for a full prompt: all-ones mask, empty past."""
    ids = np.asarray(ids, np.int64)
    out = {"input_ids": ids, "attention_mask": np.ones(ids.shape, np.int64)}
    for layer in range(LAYERS):
        for kv in ("key", "value"):
            out[f"past_key_values.{layer}.{kv}"] = np.zeros((ids.shape[0], KV_HEADS, 0, HEAD), np.float32)
    return out


def phrase_batch(rows: int = 2) -> dict[str, np.ndarray]:
    """``rows`` copies of PROMPT + PHRASE as next-token training data."""
    seq = np.array([PROMPT + PHRASE] * rows, np.int64)
    out = feeds(seq[:, :-1])
    out["target"] = seq[:, 1:]
    return out


def training_session(precision: str, lr: float = 2e-2, **lora) -> TrainingSession:
    model = onnx.load(str(FOLDERS[precision] / "model.onnx"))
    lora.setdefault("rank", 4)
    lora.setdefault("alpha", 8)
    tm = build.training_model(model, loss="cross_entropy", optimizer=build.AdamW(lr=lr),
                              lora=build.LoRA(**lora))
    sess = TrainingSession(tm)
    sess.initialize()
    return sess


def greedy(sess: TrainingSession, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with ``sess.run`` (the whole sequence each step)."""
    seq = list(prompt)
    for _ in range(n):
        logits = sess.run(feeds(np.array([seq])))["logits"]
        seq.append(int(logits[0, -1].argmax()))
        if seq[-1] == EOS:
            break
    return seq


def _og_generator(folder, prompt: list[int], max_length: int, adapter=None):
    """An onnxruntime-genai greedy generator over ``prompt`` (the adapter file
    ``adapter`` active when given)."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, do_sample=False)
    gen = og.Generator(model, params)
    if adapter is not None:
        adapters = og.Adapters(model)
        adapters.load(str(adapter), "trained")
        gen.set_active_adapter(adapters, "trained")
    gen.append_tokens(np.array(prompt, np.int32))
    return gen


def og_greedy(folder, prompt: list[int], n: int, adapter=None) -> list[int]:
    """Greedy generation with onnxruntime-genai from a model folder, with the
    adapter file ``adapter`` active when given."""
    gen = _og_generator(folder, prompt, len(prompt) + n, adapter)
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)]


def og_logits(folder, prompt: list[int], adapter=None) -> np.ndarray:
    """onnxruntime-genai's logits of the last prompt position [vocab]."""
    gen = _og_generator(folder, prompt, len(prompt) + 1, adapter)
    logits = np.asarray(gen.get_output("logits"))
    return logits.reshape(-1, logits.shape[-1])[-1]
