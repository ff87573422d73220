"""onnxruntime-genai models (the model builder's own graphs: GroupQueryAttention,
SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization and, in int4,
MatMulNBits and GatherBlockQuantized) train like PyTorch's models with the
same weights: a Llama and a Gemma-2 (softcapped sliding-window attention,
tanh Gelu, tied embeddings, softcapped LM head).

Fixtures: tests/data/genai/, made by scripts/make_genai_fixtures.py (tiny
random models, builder fp32 and int4, PyTorch loss, gradients and one SGD
step).  The builder's model takes the KV cache as inputs: a training step is
GroupQueryAttention's prompt call, with the past keys/values fed empty,
``[batch, kv_heads, 0, head_size]``; a model with a windowed cache
(``sliding_window_cache=1``, Gemma-2) wants a capacity of at least the window
even then: zeros ``[batch, kv_heads, window, head_size]``, which the prompt
does not read.  The present outputs are not used.  The Llama batch has a
right-padded row: ``attention_mask`` gives GroupQueryAttention its
``seqlens_k``, and the labels ignore the padding (-100); a windowed cache
takes no right padding.

The SGD step (lr 0.5) gives the gradient back as (before - after) / lr.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxtrain import TrainingSession, build

DATA = Path(__file__).resolve().parent.parent / "data" / "genai"
LR = 0.5


#: (kv heads, past length fed, head size) of each fixture family
PAST = {"llama": (1, 0, 16), "gemma2": (1, 4, 16)}


def _load(family: str, precision: str, accuracy_level: int | None = None):
    ref = np.load(DATA / f"{family}_{precision}.npz")
    proto = onnx.load(str(DATA / f"{family}_{precision}" / "model.onnx"))
    if accuracy_level is not None:
        for node in proto.graph.node:
            for a in node.attribute:
                if a.name == "accuracy_level":
                    a.i = accuracy_level
    return ref, proto


def _step(family, proto, ref, names):
    tm = build.training_model(proto, loss="cross_entropy", output="logits", optimizer=build.SGD(lr=LR),
                              trainable=names)
    sess = TrainingSession(tm)
    sess.initialize()
    kv, past, head = PAST[family]
    empty = np.zeros((2, kv, past, head), np.float32)  # the prompt call: no past keys/values
    batch = {"input_ids": ref["input_ids"], "attention_mask": ref["attention_mask"],
             "past_key_values.0.key": empty, "past_key_values.0.value": empty, "target": ref["labels"]}
    before = {n: np.array(sess.state[n]) for n in names}
    loss = float(sess.train_step(batch)["loss"])
    after = {n: np.array(sess.state[n]) for n in names}
    return loss, before, after


def _compare(ref, names, loss, before, after, rtol, atol):
    np.testing.assert_allclose(loss, ref["loss"], rtol=rtol)
    for n in names:
        grad = (before[n] - after[n]) / LR
        scale = np.abs(ref[f"grad/{n}"]).max()
        rounding = 4 * np.finfo(np.float32).eps * np.abs(before[n]).max() / LR  # of the step's difference
        np.testing.assert_allclose(grad, ref[f"grad/{n}"], rtol=0, atol=atol * scale + rounding,
                                   err_msg=f"gradient of {n}")
        np.testing.assert_allclose(after[n], ref[f"sgd/{n}"], rtol=0, atol=atol * scale * LR + 1e-6,
                                   err_msg=f"SGD step of {n}")


def _params(ref) -> list[str]:
    return [k[len("grad/"):] for k in ref.files if k.startswith("grad/")]


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_genai_fp32_matches_pytorch(family):
    """Every weight (embedding, norms, packed qkv, o, MLP, LM head) but the rotary caches."""
    ref, proto = _load(family, "fp32")
    names = _params(ref)
    assert "model.layers.0.attn.qkv_proj.MatMul.weight" in names and "cos_cache" not in names
    _compare(ref, names, *_step(family, proto, ref, names), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_genai_int4_matches_pytorch(family):
    """MatMulNBits scales (Gemma-2: the LM head's shared with the embedding's
    GatherBlockQuantized), norms (and Llama's float embedding) against PyTorch
    on the dequantized weights, with the product in float32 (accuracy_level 1)."""
    ref, proto = _load(family, "int4", accuracy_level=1)
    names = _params(ref)
    assert "lm_head.MatMul.weight_scales" in names
    if family == "gemma2":
        assert any(n.op_type == "GatherBlockQuantized" for n in proto.graph.node)
    _compare(ref, names, *_step(family, proto, ref, names), rtol=1e-5, atol=2e-5)


def test_genai_llama_int4_as_built_is_straight_through():
    """The builder's int4 default, accuracy_level 4 (activations rounded to int8
    inside MatMulNBits): the loss is onnxruntime's, and the gradients are the
    exact product's up to that rounding.  The scales stay frozen constants here:
    onnxruntime 1.32 computes accuracy_level 4 wrongly when the scales are
    not constant initializers, so MatMulNBits' rule refuses to train them
    (test_grad_contrib.py)."""
    ref, proto = _load("llama", "int4")
    assert any(a.name == "accuracy_level" and a.i == 4 for n in proto.graph.node for a in n.attribute)
    names = [n for n in _params(ref) if not n.endswith("_scales")]
    loss, before, after = _step("llama", proto, ref, names)
    assert loss != pytest.approx(float(ref["loss"]), rel=1e-6, abs=0)  # the int8 rounding is there
    _compare(ref, names, loss, before, after, rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_genai_packed_qkv_lora_matches_pytorch(family):
    """LoRA on the builder's packed qkv_proj, one adapter pair for the packed
    matrix (W [in, 3 projections] + s A B).  From B = 0 the first step sees
    the base model, so dL/dB = s A^T dL/dW and dL/dA = 0, with dL/dW
    PyTorch's gradient of the packed weight."""
    ref, proto = _load(family, "fp32")
    target = "model.layers.0.attn.qkv_proj.MatMul.weight"
    rank, alpha = 2, 4.0
    tm = build.training_model(proto, loss="cross_entropy", output="logits", optimizer=build.SGD(lr=LR),
                              lora=build.LoRA(rank=rank, alpha=alpha, targets=[target]))
    sess = TrainingSession(tm)
    sess.initialize()
    a0 = np.array(sess.state[f"{target}.lora_A"])
    assert not np.any(np.array(sess.state[f"{target}.lora_B"]))
    kv, past, head = PAST[family]
    empty = np.zeros((2, kv, past, head), np.float32)
    loss = float(sess.train_step({"input_ids": ref["input_ids"], "attention_mask": ref["attention_mask"],
                                  "past_key_values.0.key": empty, "past_key_values.0.value": empty,
                                  "target": ref["labels"]})["loss"])
    np.testing.assert_allclose(loss, ref["loss"], rtol=1e-5)
    g = ref[f"grad/{target}"]
    expected_b = -LR * (alpha / rank) * a0.T @ g
    np.testing.assert_allclose(sess.state[f"{target}.lora_B"], expected_b, rtol=0,
                               atol=2e-5 * np.abs(expected_b).max())
    np.testing.assert_array_equal(sess.state[f"{target}.lora_A"], a0)
