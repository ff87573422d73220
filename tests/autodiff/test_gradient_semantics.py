"""Semantics of ai.onnx.preview.training.Gradient (DESIGN.md §2)."""

from __future__ import annotations

import numpy as np
import pytest
from models import F64, PREVIEW, model, vi
from onnx import helper

from onnxtrain import GradientError, TrainingModelError, TrainingSession

RNG = np.random.default_rng(0)


def grad_node(inputs, outputs, xs, y, zs=(), name="G"):
    kw = {"zs": list(zs)} if zs else {}
    return helper.make_node("Gradient", list(inputs), list(outputs), domain=PREVIEW, xs=list(xs),
                            y=y, name=name, **kw)


def run_main(nodes, inputs: dict, outputs: list[str], opset=17):
    m = model(nodes, [vi(k, F64, list(v.shape)) for k, v in inputs.items()],
              [vi(o, F64, None) for o in outputs], opset=opset)
    return TrainingSession(m).run(inputs)


def test_gradient_in_main_graph_of_a_model_without_training_info():
    a, b = np.array(1.5), np.array(-2.0)
    nodes = [helper.make_node("Mul", ["a", "b"], ["c"]), helper.make_node("Add", ["c", "a"], ["d"]),
             grad_node(["a", "b"], ["da", "db"], ["a", "b"], "d")]
    out = run_main(nodes, {"a": a, "b": b}, ["d", "da", "db"])
    assert out["da"] == b + 1 and out["db"] == a


def test_non_scalar_y_means_gradient_of_its_sum():
    x = RNG.standard_normal((3, 4))
    nodes = [helper.make_node("Mul", ["x", "x"], ["y"]), grad_node(["x"], ["dx"], ["x"], "y")]
    out = run_main(nodes, {"x": x}, ["dx"])
    np.testing.assert_allclose(out["dx"], 2 * x)


def test_empty_output_name_skips_that_gradient():
    a, b = np.array(3.0), np.array(4.0)
    nodes = [helper.make_node("Mul", ["a", "b"], ["c"]), grad_node(["a", "b"], ["", "db"], ["a", "b"], "c")]
    out = run_main(nodes, {"a": a, "b": b}, ["db"])
    assert out["db"] == 3.0


def test_intermediate_tensor_in_xs_cuts_the_graph():
    """y = (x*x) * w with xs=[h, w] where h = x*x: dy/dh = w, and h is a leaf."""
    x, w = np.array(3.0), np.array(2.0)
    nodes = [helper.make_node("Mul", ["x", "x"], ["h"]), helper.make_node("Mul", ["h", "w"], ["y"]),
             grad_node(["h", "w"], ["dh", "dw"], ["h", "w"], "y")]
    out = run_main(nodes, {"x": x, "w": w}, ["dh", "dw"])
    assert out["dh"] == 2.0 and out["dw"] == 9.0


def test_cut_blocks_paths_through_the_cut_tensor():
    """xs=[x, h] with h = 2x, y = h + x: dy/dx counts only the direct path (1), dy/dh = 1."""
    x = np.array(5.0)
    nodes = [helper.make_node("Add", ["x", "x"], ["h"]), helper.make_node("Add", ["h", "x"], ["y"]),
             grad_node(["x", "h"], ["dx", "dh"], ["x", "h"], "y")]
    out = run_main(nodes, {"x": x}, ["dx", "dh"])
    assert out["dx"] == 1.0 and out["dh"] == 1.0


def test_inputs_define_the_point_of_evaluation():
    """Gradient of y = h*h*w w.r.t. h, evaluated at h1 instead of h (spec example)."""
    x, w, h1 = np.array(3.0), np.array(2.0), np.array(10.0)
    nodes = [helper.make_node("Mul", ["x", "x"], ["h"]), helper.make_node("Mul", ["h", "h"], ["hh"]),
             helper.make_node("Mul", ["hh", "w"], ["y"]),
             grad_node(["h1", "w"], ["dh", "dw"], ["h", "w"], "y")]
    out = run_main(nodes, {"x": x, "w": w, "h1": h1}, ["y", "dh", "dw"])
    assert out["y"] == 81 * 2  # the forward value is untouched
    assert out["dh"] == 2 * h1 * w and out["dw"] == h1 * h1


def test_forward_activations_are_reused_not_recomputed():
    from models import mlp_classifier

    sess = TrainingSession(mlp_classifier("sgd"))
    program = sess.programs()["training_info[0].algorithm"]
    ops = [n.op_type for n in program.graph.node]
    assert ops.count("SoftmaxCrossEntropyLoss") == 1
    assert ops.count("Relu") == 1
    assert not [n for n in program.graph.node if "at_point" in n.name]


def test_second_order_gradient():
    """O = sum(w^3 * x): dO/dw = 3 w^2 x, d(sum dO/dw)/dw = 6 w x."""
    w, x = RNG.standard_normal(4), RNG.standard_normal(4)
    nodes = [helper.make_node("Mul", ["w", "w"], ["w2"]), helper.make_node("Mul", ["w2", "w"], ["w3"]),
             helper.make_node("Mul", ["w3", "x"], ["o"]),
             grad_node(["w", "x"], ["dw"], ["w"], "o", zs=["x"], name="G1"),
             grad_node(["w", "x"], ["d2w", "dx_of_dw"], ["w", "x"], "dw", name="G2")]
    out = run_main(nodes, {"w": w, "x": x}, ["dw", "d2w", "dx_of_dw"])
    np.testing.assert_allclose(out["dw"], 3 * w**2 * x)
    np.testing.assert_allclose(out["d2w"], 6 * w * x)
    np.testing.assert_allclose(out["dx_of_dw"], 3 * w**2)


def test_y_independent_of_x_gives_zeros():
    a, b = np.array([1.0, 2.0]), np.array([3.0, 4.0])
    nodes = [helper.make_node("Mul", ["b", "b"], ["y"]), grad_node(["a", "b"], ["da", "db"], ["a", "b"], "y")]
    out = run_main(nodes, {"a": a, "b": b}, ["da", "db"])
    np.testing.assert_array_equal(out["da"], [0, 0])
    np.testing.assert_array_equal(out["db"], 2 * b)


def test_gradient_in_an_old_opset_model():
    x = RNG.standard_normal((2, 3))
    nodes = [helper.make_node("Mul", ["x", "x"], ["y"]),
             helper.make_node("ReduceSum", ["y"], ["s"], axes=[1], keepdims=0),
             grad_node(["x"], ["dx"], ["x"], "s")]
    out = run_main(nodes, {"x": x}, ["dx"], opset=9)
    np.testing.assert_allclose(out["dx"], 2 * x)


def test_missing_rule_names_the_op_and_node():
    """An op with neither a rule nor a function body is an error, never a zero."""
    nodes = [helper.make_node("Mystery", ["x"], ["d"], name="my_op", domain="example.custom"),
             grad_node(["x"], ["dx"], ["x"], "d")]
    m = model(nodes, [vi("x", F64, [2, 2])], [vi("dx", F64, [2, 2])])
    m.opset_import.append(helper.make_opsetid("example.custom", 1))
    with pytest.raises(GradientError) as info:
        TrainingSession(m)
    assert isinstance(info.value, TrainingModelError)
    msg = str(info.value)
    assert "no gradient rule for op 'Mystery' in domain 'example.custom'" in msg
    assert "'my_op'" in msg


def test_malformed_gradient_nodes_are_refused():
    x = vi("x", F64, [2])
    bad_arity = helper.make_node("Gradient", ["x"], ["dx"], domain=PREVIEW, xs=["x"], zs=["z"], y="y")
    nodes = [helper.make_node("Mul", ["x", "x"], ["y"]), bad_arity]
    with pytest.raises(GradientError, match="inputs but xs and zs name 2"):
        TrainingSession(model(nodes, [x], [vi("dx", F64, [2])]))
    no_y = helper.make_node("Gradient", ["x"], ["dx"], domain=PREVIEW, xs=["x"])
    with pytest.raises(GradientError, match="'y' is missing"):
        TrainingSession(model([helper.make_node("Mul", ["x", "x"], ["y"]), no_y], [x],
                              [vi("dx", F64, [2])]))
