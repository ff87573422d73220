"""Ops differentiated through their ONNX function bodies (a body counts as a rule)."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_vjp
from models import F64, PREVIEW, vi
from onnx import helper

from onnxtrain import TrainingSession
from onnxtrain.autodiff import REGISTRY

RNG = np.random.default_rng(0)


def r(*shape):
    return RNG.standard_normal(shape)


ATTENTION = [
    ("3d", {"Q": r(2, 3, 8), "K": r(2, 4, 8), "V": r(2, 4, 8)}, {"q_num_heads": 2, "kv_num_heads": 2}),
    ("4d", {"Q": r(1, 2, 3, 4), "K": r(1, 2, 5, 4), "V": r(1, 2, 5, 4)}, {}),
    ("causal", {"Q": r(1, 2, 4, 4), "K": r(1, 2, 4, 4), "V": r(1, 2, 4, 4)}, {"is_causal": 1}),
    ("gqa", {"Q": r(1, 4, 3, 4), "K": r(1, 2, 3, 4), "V": r(1, 2, 3, 4)}, {}),
    ("scale_softcap", {"Q": r(1, 1, 3, 4), "K": r(1, 1, 3, 4), "V": r(1, 1, 3, 4)},
     {"scale": 0.3, "softcap": 2.0}),
]


@pytest.mark.parametrize("case", ATTENTION, ids=[c[0] for c in ATTENTION])
def test_attention_opset23_through_its_function_body(case):
    _, inputs, attrs = case
    assert REGISTRY.get("", "Attention") is None  # no hand-written rule: the body is the rule
    check_vjp("Attention", inputs, attrs, opset=23, rtol=1e-4)


def test_attention_with_additive_mask():
    inputs = {"Q": r(1, 2, 3, 4), "K": r(1, 2, 5, 4), "V": r(1, 2, 5, 4), "M": r(3, 5)}
    check_vjp("Attention", inputs, {}, opset=23, rtol=1e-4)


def test_rms_normalization_opset23():
    check_vjp("RMSNormalization", {"X": r(2, 3, 8), "S": r(8)}, {"axis": -1}, opset=23, rtol=1e-4)


def test_swish_opset24():
    check_vjp("Swish", {"X": r(3, 4)}, {"alpha": 1.5}, opset=24, rtol=1e-4)


def test_model_local_function_is_inlined_for_gradients():
    """A model-local function 'custom.SquarePlus(x, b) = x*x + b' is differentiated."""
    fn = helper.make_function(
        "custom", "SquarePlus", ["x", "b"], ["y"],
        [helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("Add", ["sq", "b"], ["y"])],
        [helper.make_opsetid("", 17)],
    )
    nodes = [
        helper.make_node("SquarePlus", ["a", "c"], ["out"], domain="custom"),
        helper.make_node("Gradient", ["a", "c"], ["da", "dc"], domain=PREVIEW, xs=["a", "c"], y="out"),
    ]
    graph = helper.make_graph(nodes, "g", [vi("a", F64, [3]), vi("c", F64, [3])],
                              [vi("out", F64, [3]), vi("da", F64, [3]), vi("dc", F64, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("custom", 1),
                                                    helper.make_opsetid(PREVIEW, 1)], functions=[fn])
    model.ir_version = 10
    a, c = r(3), r(3)
    out = TrainingSession(model).run({"a": a, "c": c})
    np.testing.assert_allclose(out["da"], 2 * a)
    np.testing.assert_allclose(out["dc"], np.ones(3))
    np.testing.assert_allclose(out["out"], a * a + c)
