"""Narrow products sharing a left operand are batched before the gradients
(onnxtrain.lower.shared_products): a layer's LoRA adapters compute ``x A_i``
in one product, and the step is the same as with the products apart."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession, build
from onnxtrain.core.names import NameGen
from onnxtrain.lower import shared_products


def three_projections(d=24, wide=80):
    """x [B, S, d] -> three projections of x (a query, key and value), summed,
    plus an output projection of their sum: LoRA on all four puts three
    adapters on x and one on the sum."""
    rng = np.random.default_rng(11)
    inits = [numpy_helper.from_array((rng.standard_normal((d, wide)) / 5).astype(np.float32), n)
             for n in ("wq", "wk", "wv")]
    inits.append(numpy_helper.from_array((rng.standard_normal((wide, d)) / 5).astype(np.float32), "wo"))
    nodes = [helper.make_node("MatMul", ["x", w], [f"p_{w}"]) for w in ("wq", "wk", "wv")]
    nodes += [helper.make_node("Sum", ["p_wq", "p_wk", "p_wv"], ["s"]), helper.make_node("Tanh", ["s"], ["t"]),
              helper.make_node("MatMul", ["t", "wo"], ["y"])]
    graph = helper.make_graph(nodes, "three", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 5, d])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 5, d])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def step(monkeypatch, columns: int):
    """Two AdamW steps of LoRA (rank 4, B started non-zero so that every
    gradient flows) with products of up to ``columns`` columns batched: (the
    algorithm program, losses, state)."""
    monkeypatch.setattr(shared_products, "MAX_COLUMNS", columns)
    tm = build.training_model(three_projections(), loss="mse", optimizer=build.AdamW(lr=1e-2),
                              lora=build.LoRA(rank=4, alpha=8.0))
    sess = TrainingSession(tm)
    sess.initialize()
    rng = np.random.default_rng(0)
    sess.load_state({n: 0.1 * rng.standard_normal(v.shape).astype(np.float32)
                     for n, v in sess.state.items() if n.endswith("lora_B")})
    batch = {"x": rng.standard_normal((3, 5, 24)).astype(np.float32),
             "target": rng.standard_normal((3, 5, 24)).astype(np.float32)}
    losses = [float(sess.train_step(batch)["loss"]) for _ in range(2)]
    return sess.programs()["training_info[0].algorithm"], losses, {k: np.array(v) for k, v in sess.state.items()}


def test_adapters_on_one_input_are_one_product(monkeypatch):
    program, losses, state = step(monkeypatch, shared_products.MAX_COLUMNS)
    apart, apart_losses, apart_state = step(monkeypatch, 0)
    reads_x = [n for n in program.graph.node if n.op_type == "MatMul" and n.input[0] == "x"]
    # the three wide projections stay apart; the three adapters are one product of 12 columns
    assert len(reads_x) == 4, [n.input[1] for n in reads_x]
    concat = next(n for n in program.graph.node if n.output[0] in {m.input[1] for m in reads_x})
    assert concat.op_type == "Concat" and len(concat.input) == 3
    assert sum(n.op_type == "MatMul" and n.input[0] == "x" for n in apart.graph.node) == 6
    np.testing.assert_allclose(losses, apart_losses, rtol=1e-6)
    for k in apart_state:
        np.testing.assert_allclose(state[k], apart_state[k], rtol=0, atol=1e-6 * (1 + np.abs(apart_state[k]).max()),
                                   err_msg=k)


@pytest.mark.parametrize("case", ["one product", "other inputs", "too wide"])
def test_left_alone(case):
    """A lone product, products of different left operands, wider than
    ``MAX_COLUMNS`` columns: nothing batched."""
    d, n = 8, shared_products.MAX_COLUMNS + (1 if case == "too wide" else 0)
    right = ["a1"] if case == "one product" else ["a1", "a2"]
    left = {"a1": "x", "a2": "z" if case == "other inputs" else "x"}
    nodes = [helper.make_node("MatMul", [left[r], r], [f"y_{r}"]) for r in right]
    inputs = [helper.make_tensor_value_info(v, TensorProto.FLOAT, [3, d]) for v in ("x", "z")]
    inputs += [helper.make_tensor_value_info(r, TensorProto.FLOAT, [d, n]) for r in right]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(f"y_{r}", TensorProto.FLOAT, None)
                                                   for r in right])
    assert shared_products.batch(graph, 17, NameGen.from_graph(graph)) == 0
    assert [nd.op_type for nd in graph.node] == ["MatMul"] * len(right)


def test_inference_keeps_its_products():
    """Only a program that differentiates batches (``run`` computes as the model says)."""
    tm = build.training_model(three_projections(), loss="mse", lora=build.LoRA(rank=4, alpha=8.0))
    inference = TrainingSession(tm).programs()["inference"]
    assert not any(n.op_type == "Split" for n in inference.graph.node)
