"""Weights that torch's dynamo exporter stored once (tests/data/tied/, made by
scripts/make_tied_exports.py; these tests need no torch).

In a freshly initialized Llama every RMSNorm weight is a vector of ones, and
the exporter's optimizer keeps one initializer for all five, read by five
nodes.  The builder unties them from the exporter's node records (each node
names the parameter it read): one trainable initializer per PyTorch
parameter, named after its module, so that the trained parameter count, the
gradients and one SGD step equal PyTorch's.  A parameter a module reads
twice (``twice__dynamo``: ``a`` called twice) stays one parameter.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from test_llm_exports import expose_gradients, feeds_of, rel

import onnxtrain
from onnxtrain import build
from onnxtrain.summary import parameter_text

DATA = Path(__file__).resolve().parents[1] / "data" / "tied"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
CASES = {c["file"][:-5]: c for c in MANIFEST["cases"]}
LR = MANIFEST["sgd_lr"]
NORMS = ["model.model.layers.0.input_layernorm.weight", "model.model.layers.0.post_attention_layernorm.weight",
         "model.model.layers.1.input_layernorm.weight", "model.model.layers.1.post_attention_layernorm.weight",
         "model.model.norm.weight"]


def load(stem: str):
    with np.load(DATA / f"{stem}.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return CASES[stem], onnx.load(str(DATA / f"{stem}.onnx")), arrays


def readers(model: onnx.ModelProto, name: str) -> int:
    return sum(name in n.input for n in model.graph.node)


@pytest.mark.parametrize("stem", sorted(CASES))
def test_the_default_set_has_pytorchs_parameter_count(stem):
    case, model, _ = load(stem)
    dims = {t.name: t.dims for t in model.graph.initializer}
    choices = build.parameter_choices(model)
    trained = {c.name: math.prod(dims[c.copy_of or c.name]) for c in choices if c.trainable}
    assert sum(trained.values()) == case["total"]  # llama: 5,968, not 5,904 with one shared norm
    by_name = {c.name: c for c in choices}
    if stem.startswith("llama"):
        assert readers(model, NORMS[0]) == 5  # the exporter's one vector
        assert set(NORMS) <= set(trained)
        for name in NORMS[1:]:
            assert by_name[name].copy_of == NORMS[0]
            assert by_name[name].tie.startswith(f"untied from {NORMS[0]!r}")
        assert "4 other parameter(s)" in by_name[NORMS[0]].tie
    else:
        assert set(trained) == set(case["parameters"]) == {"a.weight", "lin.weight", "lin.bias", "b.weight"}
        assert by_name["b.weight"].copy_of == "a.weight"
        assert "one parameter (a.weight) read 2 times: kept shared" in by_name["a.weight"].tie


@pytest.mark.parametrize("stem", sorted(CASES))
def test_inspect_shows_the_untied_parameters(stem):
    _, model, _ = load(stem)
    text = parameter_text(model)
    total = CASES[stem]["total"]
    assert f"({total:,} parameters)" in text
    assert text.count("untied from") == (4 if stem.startswith("llama") else 1)


@pytest.mark.parametrize("stem", sorted(CASES))
def test_gradients_and_an_sgd_step_match_pytorch(stem):
    case, model, arrays = load(stem)
    tm = build.training_model(model, loss=case["loss"], optimizer=build.SGD(lr=LR))
    grads = expose_gradients(tm)
    trained = json.loads(next(p.value for p in tm.metadata_props if p.key == "onnxtrain.trainable"))
    shapes = {t.name: t.dims for t in tm.graph.initializer}
    assert sum(math.prod(shapes[n]) for n in trained) == case["total"]
    sess = onnxtrain.TrainingSession(tm)
    sess.initialize()
    feeds, meta = feeds_of(arrays, tm)
    loss_name = json.loads(meta["onnxtrain.loss"])
    step1 = sess.train_step(feeds)
    np.testing.assert_allclose(float(step1[loss_name]), arrays["loss"], rtol=1e-5)
    # every parameter kept under its PyTorch name (the norms and the scales: no layout change)
    same = [n for n in trained if f"grad/{n}" in arrays]
    assert len(same) >= (6 if stem.startswith("llama") else 4)
    for name in same:
        want = arrays[f"grad/{name}"]
        assert rel(step1[grads[name]], want) <= 1e-4, f"{name}: relative error {rel(step1[grads[name]], want):.2e}"
    loss1 = float(sess.train_step(feeds)[loss_name])
    np.testing.assert_allclose(loss1, arrays["loss_sgd1"], rtol=1e-5)
    # The norms differ after the step: five parameters, as in PyTorch.
    if stem.startswith("llama"):
        norms = [sess.state[n] for n in NORMS]
        assert all(not np.array_equal(norms[0], v) for v in norms[1:])


def test_without_records_for_every_reader_nothing_is_untied():
    """One reader with no record of the parameter it read: sharing stays (a
    shared constant, or an exporter that does not say)."""
    _, model, _ = load("twice__dynamo")
    first = next(n for n in model.graph.node if n.op_type == "Mul" and "%p_a_weight" in str(n.metadata_props))
    del first.metadata_props[:]  # the others still name a.weight and b.weight
    choices = {c.name: c for c in build.parameter_choices(model)}
    assert "b.weight" not in choices and readers(model, "a.weight") == 3
    tm = build.training_model(model, loss="mse")
    assert readers(tm, "a.weight") == 3


def test_a_tied_embedding_stays_one_parameter():
    """lm_head tied to the embedding: both nodes' records read the same
    parameter, so the initializer stays shared (PyTorch trains one)."""
    fx = "%{out} : call_function[target=torch.ops.aten.{op}](args = ({args}), kwargs = {{}})"
    emb = helper.make_node("Gather", ["embed.weight", "ids"], ["h"], name="embedding")
    head_t = helper.make_node("Transpose", ["embed.weight"], ["w_t"], name="t", perm=[1, 0])
    head = helper.make_node("MatMul", ["h", "w_t"], ["logits"], name="linear")
    for node, scope, text in [
        (emb, "embed", fx.format(out="embedding", op="embedding.default", args="%p_embed_weight, %ids")),
        (head_t, "head", fx.format(out="t", op="t.default", args="%p_embed_weight")),
        (head, "head", fx.format(out="linear", op="linear.default", args="%embedding, %t")),
    ]:
        node.metadata_props.add(key="pkg.torch.onnx.fx_node", value=text)
        node.metadata_props.add(key="pkg.torch.onnx.name_scopes", value=str(["", scope, node.name]))
    graph = helper.make_graph(
        [emb, head_t, head], "tied",
        [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", 5])],
        [numpy_helper.from_array(np.ones((5, 3), np.float32), "embed.weight")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    choices = build.parameter_choices(model)
    assert [c.name for c in choices] == ["embed.weight"]
    assert "one parameter (embed.weight) read 2 times: kept shared" in choices[0].tie
    tm = build.training_model(model, loss="cross_entropy")
    assert [t.name for t in tm.graph.initializer] == ["embed.weight"] and readers(tm, "embed.weight") == 2
