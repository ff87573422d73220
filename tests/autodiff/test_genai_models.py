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

import warnings
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


def _step(family, proto, ref, names, trainable="names"):
    """One SGD step training ``names`` (``trainable=None``: the builder's default set)."""
    tm = build.training_model(proto, loss="cross_entropy", output="logits", optimizer=build.SGD(lr=LR),
                              trainable=names if trainable == "names" else trainable)
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


def _levels(graph) -> dict[str, int]:
    return {n.name: next(a.i for a in n.attribute if a.name == "accuracy_level")
            for n in graph.node if n.op_type == "MatMulNBits"}


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_genai_int4_as_built_trains_its_scales_by_default(family, tmp_path):
    """The builder's int4 default (accuracy_level 4) with the default trainable
    set, scales included: onnxruntime computes level 4 wrongly with scales fed
    at run time, so the programs run those nodes at the exact float product,
    with one warning, and match PyTorch as the accuracy_level 1 model does.
    The exports keep every node as it was."""
    ref, proto = _load(family, "int4")
    levels = _levels(proto.graph)
    assert set(levels.values()) == {4}
    names = _params(ref)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, before, after = _step(family, proto, ref, names, trainable=None)
    said = [w for w in caught if "accuracy_level" in str(w.message)]
    assert len(said) == 1 and f"{len(levels)} MatMulNBits node(s)" in str(said[0].message)
    _compare(ref, names, loss, before, after, rtol=1e-5, atol=2e-5)

    tm = build.training_model(proto, loss="cross_entropy", output="logits")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = TrainingSession(tm)
    for label, program in sess.programs().items():
        if label != "inference" and "algorithm" not in label:
            continue
        assert set(_levels(program.graph).values()) == {1}, label
    # run() is the exact product too: PyTorch's loss from its logits (float64 softmax).
    kv, past, head = PAST[family]
    empty = np.zeros((2, kv, past, head), np.float32)
    logits = sess.run({"input_ids": ref["input_ids"], "attention_mask": ref["attention_mask"],
                       "past_key_values.0.key": empty, "past_key_values.0.value": empty})["logits"]
    z = logits.astype(np.float64)
    labels = ref["labels"]
    kept = labels != -100
    log_p = z - z.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_p, np.where(kept, labels, 0)[..., None], -1)[..., 0]
    np.testing.assert_allclose(-picked[kept].mean(), ref["loss"], rtol=1e-5)
    for training in (False, True):
        exported = onnx.load(str(sess.export(tmp_path / f"out{training}.onnx", training=training)))
        assert _levels(exported.graph) == levels


def test_genai_llama_int4_as_built_is_straight_through():
    """The builder's int4 default, accuracy_level 4 (activations rounded to int8
    inside MatMulNBits): the loss is onnxruntime's, and the gradients are the
    exact product's up to that rounding.  The scales stay frozen constants here,
    so the nodes keep accuracy_level 4 (trained, they run at level 1: the test
    above)."""
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


def test_genai_shapes_reach_through_the_contrib_ops():
    """Shape inference goes on through MatMulNBits, GroupQueryAttention and
    the skip norms with the model's named dims (onnx has no schema for them),
    even without the value_info the builder writes, so that the MLP's SiLU
    chain runs the kernel library's fused kernel in the executed program."""
    from onnxtrain.core.graph import infer_types
    from onnxtrain.kernels import library

    _, proto = _load("llama", "int4")
    del proto.graph.value_info[:]
    _, shapes = infer_types(proto.graph, proto.opset_import)
    seen = set()
    for node in proto.graph.node:
        x, y = shapes.get(node.input[0]) if node.input else None, shapes.get(node.output[0])
        if node.op_type == "MatMulNBits":
            n = next(a.i for a in node.attribute if a.name == "N")
            assert y == (*x[:-1], n), node.name
        elif node.op_type == "GroupQueryAttention":  # packed [B, S, (2 + 2) 16] -> [B, S, 2 16]
            assert (x, y) == (("batch_size", "sequence_length", 64), ("batch_size", "sequence_length", 32))
        elif node.op_type in ("SkipSimplifiedLayerNormalization", "Sigmoid"):
            assert y == x and x[:2] == ("batch_size", "sequence_length"), node.name
        else:
            continue
        seen.add(node.op_type)
    assert seen == {"MatMulNBits", "GroupQueryAttention", "SkipSimplifiedLayerNormalization", "Sigmoid"}
    if library.library() is None:
        pytest.skip(f"kernel library: {library.status()}")
    sess = TrainingSession(build.training_model(proto, loss="cross_entropy", output="logits"))
    executed = sess.programs(executed=True)["training_info[0].algorithm"]
    fused = {n.op_type for n in executed.graph.node if n.domain == "ai.onnxtrain.kernels"}
    assert {"SiluMulF32", "SiluMulGradF32"} <= fused, fused


def test_genai_attention_replaced_but_where_recomputed():
    """Training, the GroupQueryAttention forward is replaced by the standard
    ops its gradient reads (computed once); with ``recompute=`` the fused
    kernel stays in the forward and the backward recomputes (it keeps
    nothing).  Both take PyTorch's step, and inference keeps the fused kernel."""
    ref, proto = _load("llama", "fp32")
    names = _params(ref)
    for recompute, fused in ((None, False), ("blocks", True)):
        tm = build.training_model(proto, loss="cross_entropy", output="logits", optimizer=build.SGD(lr=LR),
                                  trainable=names, recompute=recompute)
        sess = TrainingSession(tm)
        programs = sess.programs()
        step = programs["training_info[0].algorithm"]
        assert any(n.op_type == "GroupQueryAttention" for n in step.graph.node) == fused, recompute
        assert any(n.op_type == "GroupQueryAttention" for n in programs["inference"].graph.node)
        sess.initialize()
        kv, past, head = PAST["llama"]
        empty = np.zeros((2, kv, past, head), np.float32)
        batch = {"input_ids": ref["input_ids"], "attention_mask": ref["attention_mask"],
                 "past_key_values.0.key": empty, "past_key_values.0.value": empty, "target": ref["labels"]}
        before = {n: np.array(sess.state[n]) for n in names}
        loss = float(sess.train_step(batch)["loss"])
        _compare(ref, names, loss, before, {n: np.array(sess.state[n]) for n in names}, rtol=1e-5, atol=2e-5)
