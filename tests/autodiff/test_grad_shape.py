"""Gradient checks of the data-movement rules (onnxtrain/autodiff/rules/shape.py)."""

from __future__ import annotations

import numpy as np
import pytest
from grad_cases import (
    Case,
    case_params,
    const_node,
    float32_params,
    ins,
    normal,
    run_case,
    run_case_float32,
    scalar_node,
)
from gradcheck import check_vjp
from onnx import helper

from onnxtrain.errors import GradientError, TrainingModelError


def i64(*values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def consts(**values):
    """extra= for Constant int64 inputs (the same at every opset)."""
    return lambda opset: [const_node(k, v) for k, v in values.items()]


def distinct(*shape: int):
    """A permutation of well separated values (TopK/Max need no near-ties)."""
    return lambda rng: (
        rng.permutation(np.prod(shape)).reshape(shape) * 0.5 + rng.uniform(0, 0.1, shape)
    )


def topk_node(inputs, **attrs):
    return helper.make_node("TopK", inputs, ["v", "idx"], **attrs)


GATHER_ND_SYMBOLIC = (
    lambda opset, symbolic: symbolic and opset < 16,
    "before opset 16 (no ScatterND reduction) the GatherND gradient linearizes the "
    "indices, which needs the last dimension of the indices statically",
    TrainingModelError,
)

OLD = (9, 13, 18)  # attribute signatures before 13 (or 10/11)
NEW = (13, 18)

CASES = [
    # ------------------------------------------------------------ reshaping
    Case("Reshape-runtime-shape", "Reshape", ins(x=normal(2, 3, 4), s=i64(4, 6)), opsets=NEW),
    Case(
        "Reshape-const-shape",
        "Reshape",
        ins(x=normal(2, 3, 4)),
        node_inputs=["x", "s"],
        extra=consts(s=[0, -1, 2]),
    ),
    Case("Flatten", "Flatten", ins(x=normal(2, 3, 4)), attrs={"axis": 2}),
    Case("Flatten-axis0", "Flatten", ins(x=normal(2, 3)), attrs={"axis": 0}),
    Case(
        "Flatten-negative", "Flatten", ins(x=normal(2, 3, 4)), attrs={"axis": -1}, opsets=(11, 13)
    ),
    Case("Transpose", "Transpose", ins(x=normal(2, 3, 4)), attrs={"perm": [1, 2, 0]}),
    Case("Transpose-default", "Transpose", ins(x=normal(2, 3, 4))),
    Case(
        "Squeeze-attr", "Squeeze", ins(x=normal(2, 1, 3, 1)), attrs={"axes": [1, 3]}, opsets=(9, 11)
    ),
    Case(
        "Squeeze-input",
        "Squeeze",
        ins(x=normal(2, 1, 3, 1)),
        node_inputs=["x", "a"],
        extra=consts(a=[-1, 1]),
        opsets=NEW,
    ),
    Case("Squeeze-all", "Squeeze", ins(x=normal(2, 1, 3, 1))),
    Case(
        "Unsqueeze-attr", "Unsqueeze", ins(x=normal(2, 3)), attrs={"axes": [0, 3]}, opsets=(9, 11)
    ),
    Case(
        "Unsqueeze-input",
        "Unsqueeze",
        ins(x=normal(2, 3)),
        node_inputs=["x", "a"],
        extra=consts(a=[0, -1]),
        opsets=NEW,
    ),
    Case("Expand", "Expand", ins(x=normal(3, 1), s=i64(2, 3, 4)), opsets=NEW, broadcasts=True),
    Case(
        "Expand-const",
        "Expand",
        ins(x=normal(3, 1)),
        node_inputs=["x", "s"],
        extra=consts(s=[2, 3, 4]),
        opsets=(9, 18),
        broadcasts=True,
    ),
    Case(
        "Expand-both-ways",
        "Expand",
        ins(x=normal(1, 3, 4), s=i64(2, 1, 1)),
        opsets=NEW,
        broadcasts=True,
    ),
    Case("Tile", "Tile", ins(x=normal(2, 3), r=i64(2, 3)), opsets=NEW),
    Case(
        "Tile-const",
        "Tile",
        ins(x=normal(2, 1, 3)),
        node_inputs=["x", "r"],
        extra=consts(r=[1, 4, 2]),
        opsets=OLD,
    ),
    Case("DepthToSpace-DCR", "DepthToSpace", ins(x=normal(2, 8, 2, 3)), attrs={"blocksize": 2}),
    Case(
        "DepthToSpace-CRD",
        "DepthToSpace",
        ins(x=normal(2, 8, 2, 3)),
        attrs={"blocksize": 2, "mode": "CRD"},
        opsets=(11, 13, 18),
    ),
    Case("SpaceToDepth", "SpaceToDepth", ins(x=normal(2, 2, 4, 6)), attrs={"blocksize": 2}),
    # -------------------------------------------------------- concat / split
    Case(
        "Concat", "Concat", ins(a=normal(2, 3), b=normal(2, 1), c=normal(2, 4)), attrs={"axis": 1}
    ),
    Case("Concat-axis0", "Concat", ins(a=normal(1, 3), b=normal(4, 3)), attrs={"axis": 0}),
    Case(
        "Concat-negative",
        "Concat",
        ins(a=normal(2, 2, 3), b=normal(2, 2, 2)),
        attrs={"axis": -1},
        opsets=(11, 13, 18),
    ),
    Case("Concat-one", "Concat", ins(a=normal(2, 3)), attrs={"axis": 0}),
    Case(
        "Concat-const-part",
        "Concat",
        ins(a=normal(2, 3)),
        attrs={"axis": 1},
        node_inputs=["a", "k"],
        extra=lambda opset: [const_node("k", np.ones((2, 2)), np.float64)],
    ),
    Case(
        "Split-equal", "Split", ins(x=normal(2, 6)), attrs={"axis": 1}, n_outputs=3, opsets=(9, 13)
    ),
    Case(
        "Split-attr",
        "Split",
        ins(x=normal(6, 2)),
        attrs={"split": [1, 2, 3]},
        n_outputs=3,
        opsets=(9, 11),
    ),
    Case("Split-input", "Split", ins(x=normal(6, 2), s=i64(1, 2, 3)), n_outputs=3, opsets=NEW),
    Case(
        "Split-num-outputs",
        "Split",
        ins(x=normal(2, 7)),
        attrs={"axis": -1, "num_outputs": 3},
        n_outputs=3,
        opsets=(18, 21),
    ),
    Case(
        "Split-unused-output",
        "Split",
        ins(x=normal(2, 6)),
        attrs={"axis": 1},
        n_outputs=3,
        diff_outputs=[0, 2],
        opsets=(11, 13),
    ),
    # --------------------------------------------------------------- Slice
    Case(
        "Slice-attrs",
        "Slice",
        ins(x=normal(4, 5, 3)),
        attrs={"starts": [1, -4], "ends": [3, 1000], "axes": [0, 1]},
        opsets=(9,),
    ),
    Case(
        "Slice-attrs-noaxes",
        "Slice",
        ins(x=normal(4, 5)),
        attrs={"starts": [1, 0], "ends": [-1, 2]},
        opsets=(9,),
    ),
    Case(
        "Slice-const",
        "Slice",
        ins(x=normal(4, 5, 3)),
        node_inputs=["x", "s", "e", "a"],
        extra=consts(s=[1, -4], e=[3, 1000], a=[0, -2]),
        opsets=(10, 13, 18),
    ),
    Case(
        "Slice-steps",
        "Slice",
        ins(x=normal(7, 6)),
        node_inputs=["x", "s", "e", "a", "k"],
        extra=consts(s=[1, -1], e=[7, -100], a=[0, 1], k=[2, -2]),
        opsets=(10, 13, 18),
    ),
    # Unit steps given: dx is dy padded (opset >= 11); starts clamped at both ends.
    Case(
        "Slice-unit-steps",
        "Slice",
        ins(x=normal(4, 5, 6)),
        node_inputs=["x", "s", "e", "a", "k"],
        extra=consts(s=[-100, 2, -2], e=[3, 1000, 100], a=[0, 2, 1], k=[1, 1, 1]),
        opsets=(11, 13, 18),
    ),
    Case(
        "Slice-past-the-end",
        "Slice",
        ins(x=normal(4, 5)),
        node_inputs=["x", "s", "e", "a", "k"],
        extra=consts(s=[1, 7], e=[3, 9], a=[0, 1], k=[1, 1]),
        opsets=(11, 18),
    ),
    Case(
        "Slice-runtime",
        "Slice",
        ins(x=normal(7, 6), s=i64(-6, 10), e=i64(1000, 0), k=i64(3, -1)),
        node_inputs=["x", "s", "e", "a", "k"],
        extra=consts(a=[0, 1]),
        opsets=NEW,
    ),
    Case(
        "Slice-empty",
        "Slice",
        ins(x=normal(4, 3)),
        node_inputs=["x", "s", "e"],
        extra=consts(s=[2], e=[2]),
        opsets=NEW,
    ),
    # ------------------------------------------------------ gather / scatter
    Case("Gather", "Gather", ins(x=normal(5, 3), i=i64(4, 0, -1, 0, 2))),
    Case(
        "Gather-axis1-2d",
        "Gather",
        ins(x=normal(2, 4, 3), i=i64(3, 1, 1, 0).reshape(2, 2)),
        attrs={"axis": 1},
        opsets=(11, 13, 18),
    ),
    Case(
        "Gather-scalar-index",
        "Gather",
        ins(x=normal(3, 4), i=np.array(2, np.int64)),
        attrs={"axis": -1},
        opsets=(11, 18),
    ),
    Case(
        "GatherElements",
        "GatherElements",
        ins(x=normal(3, 4), i=i64(0, 2, 2, -1, 1, 1, 0, 0).reshape(2, 4)),
        attrs={"axis": 0},
        opsets=(11, 13, 18),
    ),
    Case(
        "GatherElements-axis1-small",
        "GatherElements",
        ins(x=normal(3, 4), i=i64(3, 3, 0, 1).reshape(2, 2)),
        attrs={"axis": 1},
        opsets=(11, 13, 18),
    ),
    Case(
        "GatherND",
        "GatherND",
        ins(x=normal(3, 4, 2), i=i64(0, 1, 2, 3, 0, 1, -1, 0).reshape(4, 2)),
        opsets=(11, 13, 18),
        xfail=GATHER_ND_SYMBOLIC,
    ),
    Case(
        "GatherND-batch",
        "GatherND",
        ins(x=normal(2, 3, 4), i=i64(1, 0, 2, 2, 1, 1).reshape(2, 3, 1)),
        attrs={"batch_dims": 1},
        opsets=(12, 13, 18),
        xfail=GATHER_ND_SYMBOLIC,
    ),
    Case(
        "ScatterElements",
        "ScatterElements",
        ins(x=normal(3, 4), i=i64(1, 0, 2, 0, 2, 1).reshape(2, 3), u=normal(2, 3)),
        attrs={"axis": 0},
        opsets=(11, 13, 18),
    ),
    Case(
        "ScatterElements-add",
        "ScatterElements",
        ins(x=normal(3, 4), i=i64(1, 1, 2, 1, 1, 0).reshape(2, 3), u=normal(2, 3)),
        attrs={"axis": 1, "reduction": "add"},
        opsets=(16, 18),
    ),
    Case(
        "ScatterND",
        "ScatterND",
        ins(x=normal(4, 3), i=i64(2, 0).reshape(2, 1), u=normal(2, 3)),
        opsets=(11, 13, 18),
    ),
    Case(
        "ScatterND-add",
        "ScatterND",
        ins(x=normal(4, 3), i=i64(2, 0, 2).reshape(3, 1), u=normal(3, 3)),
        attrs={"reduction": "add"},
        opsets=(16, 18),
    ),
    # TopK's Indices output is int64, which check_vjp's probe cannot declare: TopK
    # runs as an extra node and the checked op is Identity on its Values.
    Case(
        "TopK-attr",
        "Identity",
        ins(x=distinct(3, 5)),
        node_inputs=["v"],
        opsets=(9,),
        extra=lambda opset: [topk_node(["x"], k=2)],
    ),
    Case(
        "TopK",
        "Identity",
        ins(x=distinct(3, 5), k=i64(3)),
        node_inputs=["v"],
        opsets=NEW,
        extra=lambda opset: [topk_node(["x", "k"], axis=0)],
    ),
    Case(
        "TopK-const-k",
        "Identity",
        ins(x=distinct(3, 5)),
        node_inputs=["v"],
        opsets=(10, 11),
        extra=lambda opset: [const_node("k", [3]), topk_node(["x", "k"])],
    ),
    Case(
        "TopK-smallest",
        "Identity",
        ins(x=distinct(3, 5)),
        node_inputs=["v"],
        opsets=(11, 18),
        extra=lambda opset: [const_node("k", [2]), topk_node(["x", "k"], largest=0, axis=-2)],
    ),
    # ------------------------------------------------------------------ Pad
    Case(
        "Pad-constant-attrs", "Pad", ins(x=normal(2, 3)), attrs={"pads": [1, 0, 0, 2]}, opsets=(9,)
    ),
    Case(
        "Pad-negative-attrs",
        "Pad",
        ins(x=normal(3, 4)),
        attrs={"pads": [-1, 1, 0, -2]},
        opsets=(9,),
    ),
    Case("Pad-constant", "Pad", ins(x=normal(2, 3), p=i64(1, 0, 0, 2)), opsets=NEW),
    Case(
        "Pad-constant-const",
        "Pad",
        ins(x=normal(2, 3)),
        node_inputs=["x", "p"],
        extra=consts(p=[1, 0, 0, 2]),
        opsets=(11, 18),
    ),
    Case("Pad-negative", "Pad", ins(x=normal(3, 4), p=i64(-1, 1, 0, -2)), opsets=NEW),
    Case(
        "Pad-value",
        "Pad",
        ins(x=normal(2, 3), v1=normal(1)),
        node_inputs=["x", "p", "v"],
        extra=lambda opset: scalar_node("v") + [const_node("p", [1, 1, 0, 2])],
        opsets=(11, 18),
    ),
    Case(
        "Pad-axes",
        "Pad",
        ins(x=normal(2, 3, 2), p=i64(1, 2)),
        node_inputs=["x", "p", "", "a"],
        extra=consts(a=[-2]),
        opsets=(18, 21),
    ),
    Case(
        "Pad-reflect-attrs",
        "Pad",
        ins(x=normal(3, 4)),
        attrs={"pads": [2, 1, 1, 3], "mode": "reflect"},
        opsets=(9,),
    ),
    Case(
        "Pad-edge-attrs",
        "Pad",
        ins(x=normal(3, 4)),
        attrs={"pads": [2, 0, 3, 1], "mode": "edge"},
        opsets=(9,),
    ),
    Case(
        "Pad-reflect",
        "Pad",
        ins(x=normal(3, 4), p=i64(2, 1, 1, 3)),
        attrs={"mode": "reflect"},
        opsets=NEW,
    ),
    Case(
        "Pad-reflect-const",
        "Pad",
        ins(x=normal(3, 4)),
        attrs={"mode": "reflect"},
        node_inputs=["x", "p"],
        extra=consts(p=[2, 1, 1, 3]),
        opsets=(11, 18),
    ),
    Case(
        "Pad-edge",
        "Pad",
        ins(x=normal(3, 4), p=i64(2, 0, 3, 1)),
        attrs={"mode": "edge"},
        opsets=NEW,
    ),
    Case(
        "Pad-edge-const",
        "Pad",
        ins(x=normal(3, 4)),
        attrs={"mode": "edge"},
        node_inputs=["x", "p"],
        extra=consts(p=[0, 2, 0, 1]),
        opsets=(11, 18),
    ),
    Case(
        "Pad-wrap",
        "Pad",
        ins(x=normal(3, 4), p=i64(2, 1, 1, 3)),
        attrs={"mode": "wrap"},
        opsets=(19, 21),
    ),
    # ---------------------------------------------------------------- masks
    Case("Trilu", "Trilu", ins(x=normal(2, 4, 5)), opsets=(14, 18)),
    Case(
        "Trilu-lower-k",
        "Trilu",
        ins(x=normal(4, 5), k=i64(-1)),
        attrs={"upper": 0},
        opsets=(14, 18),
    ),
]


@pytest.mark.parametrize("case, opset, symbolic", case_params(CASES))
def test_shape_vjp(case, opset, symbolic):
    run_case(case, opset, symbolic)


@pytest.mark.parametrize("case, opset", float32_params(CASES))
def test_shape_float32(case, opset):
    run_case_float32(case, opset)


def test_gather_duplicates_add_up():
    """Gather reading row 0 three times sends three times its weight back to row 0."""
    x = np.arange(6.0).reshape(3, 2)
    for opset in (11, 18):  # one-hot contraction / ScatterElements(add)
        g = check_vjp("Gather", {"x": x, "i": i64(0, 0, 0)}, opset=opset, directions=1)["x"]
        assert np.all(g[1:] == 0) and np.all(g[0] != 0)


def test_slice_with_unit_steps_pads():
    """From opset 11 a step-1 Slice's gradient is one Pad: no zero fill, no
    ScatterElements; other steps keep the scatter."""
    from onnx import TensorProto

    from onnxtrain.autodiff import expand_gradients
    from onnxtrain.core.graph import PREVIEW_DOMAIN
    from onnxtrain.core.names import NameGen

    for steps, scatters in (([1, 1], 0), ([1, 2], 2)):
        g = helper.make_graph(
            [const_node("s", [1, 0]), const_node("e", [3, 5]), const_node("a", [0, 1]), const_node("k", steps),
             helper.make_node("Slice", ["x", "s", "e", "a", "k"], ["y"]),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
             helper.make_node("Gradient", ["x"], ["dx"], domain=PREVIEW_DOMAIN, xs=["x"], y="loss")],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])],
            [helper.make_tensor_value_info("dx", TensorProto.FLOAT, [4, 6])],
        )
        opsets = [helper.make_opsetid("", 13), helper.make_opsetid(PREVIEW_DOMAIN, 1)]
        expand_gradients(g, opsets, NameGen(["x", "s", "e", "a", "k", "y", "loss", "dx"]), ["x"])
        ops = [n.op_type for n in g.node]
        assert ops.count("ScatterElements") == scatters and ops.count("Pad") == (scatters == 0), (steps, ops)


def test_slice_runtime_axes_is_an_error():
    with pytest.raises(GradientError, match="constant axes"):
        check_vjp("Slice", {"x": np.ones((3, 4)), "s": i64(0), "e": i64(2), "a": i64(1)}, opset=13)


def test_scatter_mul_reduction_is_an_error():
    with pytest.raises(GradientError, match="reduction='mul'"):
        check_vjp(
            "ScatterElements",
            {"x": np.ones((3,)), "i": i64(0), "u": np.ones((1,))},
            {"reduction": "mul"},
            opset=18,
        )


@pytest.mark.parametrize("opset", [14, 19, 21])
@pytest.mark.parametrize(
    "x_shape, target, allowzero",
    [((0, 3), [3, 0], 1), ((2, 0, 3), [0, 2, 3], 1), ((4, 0), [2, 2, 0], 1), ((2, 3), [3, 0], 0)],
)
def test_reshape_zero_sized_dims(opset, x_shape, target, allowzero):
    """The backward Reshape reads Shape(x) literally: x's zero-sized dims stay
    zero-sized (allowzero=1), whatever the forward node's allowzero."""
    x = np.zeros(x_shape) if 0 in x_shape else np.random.default_rng(0).standard_normal(x_shape)
    if 0 not in x_shape:
        target = [0, -1]  # allowzero=0: 0 copies x's dim 0
    g = check_vjp(
        "Reshape", {"x": x}, {"allowzero": allowzero}, node_inputs=["x", "s"],
        extra_nodes=[const_node("s", target)], opset=opset,
    )
    assert g["x"].shape == x_shape


def test_unsqueeze_of_zero_sized_dim():
    g = check_vjp("Unsqueeze", {"x": np.zeros((3, 0, 2))}, node_inputs=["x", "a"],
                  extra_nodes=[const_node("a", [0])], opset=18)
    assert g["x"].shape == (3, 0, 2)
