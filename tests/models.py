"""Small training models built with onnx.helper, shared by the tests."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

PREVIEW = "ai.onnx.preview.training"
F32 = TensorProto.FLOAT
F64 = TensorProto.DOUBLE


def tensor(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def vi(name: str, elem: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def training_info(
    algo_nodes=(),
    algo_inits=(),
    algo_inputs=(),
    algo_outputs=(),
    update=(),
    init_nodes=None,
    init_outputs=(),
    init_inits=(),
    init_binding=(),
    init_inputs=(),
) -> onnx.TrainingInfoProto:
    ti = onnx.TrainingInfoProto()
    ti.algorithm.CopyFrom(
        helper.make_graph(list(algo_nodes), "algorithm", list(algo_inputs), list(algo_outputs),
                          list(algo_inits))
    )
    for k, v in update:
        ti.update_binding.add(key=k, value=v)
    if init_nodes is not None:
        ti.initialization.CopyFrom(
            helper.make_graph(list(init_nodes), "initialization", list(init_inputs),
                              list(init_outputs), list(init_inits))
        )
    for k, v in init_binding:
        ti.initialization_binding.add(key=k, value=v)
    return ti


def model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    inits: Sequence[onnx.TensorProto] = (),
    infos: Sequence[onnx.TrainingInfoProto] = (),
    opset: int = 17,
    ir_version: int | None = None,
) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "main", list(inputs), list(outputs), list(inits))
    m = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(PREVIEW, 1)],
    )
    if ir_version is not None:
        m.ir_version = ir_version
    m.training_info.extend(infos)
    return m


# ----------------------------------------------------------------- regressors
def linear_regression(
    optimizer: str = "sgd",
    n_in: int = 3,
    lr: float = 0.05,
    dtype=np.float32,
    seed: int = 0,
    opset: int = 17,
) -> onnx.ModelProto:
    """Y = X W + B; loss = mean((Y - T)^2); Gradient; an optimizer update.

    optimizer: 'sgd' (arithmetic), 'momentum', 'nesterov', 'adam', 'adagrad'."""
    rng = np.random.default_rng(seed)
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    W = rng.standard_normal((n_in, 1)).astype(dtype) * 0.1
    B = np.zeros((1,), dtype=dtype)
    main_nodes = [
        helper.make_node("MatMul", ["X", "W"], ["XW"]),
        helper.make_node("Add", ["XW", "B"], ["Y"]),
    ]
    algo_nodes = [
        helper.make_node("Sub", ["Y", "T"], ["diff"]),
        helper.make_node("Mul", ["diff", "diff"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0),
        helper.make_node("Gradient", ["W", "B", "X", "T"], ["dW", "dB"], domain=PREVIEW,
                         xs=["W", "B"], zs=["X", "T"], y="loss"),
    ]
    algo_inits = [tensor("lr", np.asarray(lr, dtype=dtype)), tensor("step", np.asarray(0, np.int64)),
                  tensor("one", np.asarray(1, np.int64))]
    update, extra_outputs = _optimizer(optimizer, algo_nodes, algo_inits, ["W", "B"], ["dW", "dB"],
                                       [W, B], dtype)
    algo_nodes.append(helper.make_node("Add", ["step", "one"], ["step_new"]))
    update.append(("step", "step_new"))
    algo_outputs = [vi("loss", et, [])] + extra_outputs + [vi("step_new", TensorProto.INT64, [])]
    ti = training_info(
        algo_nodes, algo_inits, [vi("T", et, ["N", 1])], algo_outputs, update,
        init_nodes=[helper.make_node("Constant", [], ["W0"], value=tensor("w0", W)),
                    helper.make_node("Constant", [], ["B0"], value=tensor("b0", B)),
                    helper.make_node("Constant", [], ["S0"], value=tensor("s0", np.asarray(0, np.int64)))]
        + _zero_state_nodes(optimizer, [W, B]),
        init_outputs=[vi("W0", et, list(W.shape)), vi("B0", et, [1]),
                      vi("S0", TensorProto.INT64, [])] + _zero_state_outputs(optimizer, [W, B], et),
        init_binding=[("W", "W0"), ("B", "B0"), ("step", "S0")] + _zero_state_binding(optimizer, [W, B]),
    )
    return model(main_nodes, [vi("X", et, ["N", n_in])], [vi("Y", et, ["N", 1])],
                 [tensor("W", W), tensor("B", B)], [ti], opset=opset)


def _state_names(optimizer: str, params: Sequence[str]) -> list[list[str]]:
    if optimizer in ("momentum", "nesterov"):
        return [[f"{p}_v" for p in params]]
    if optimizer == "adagrad":
        return [[f"{p}_h" for p in params]]
    if optimizer == "adam":
        return [[f"{p}_v" for p in params], [f"{p}_h" for p in params]]
    return []


def _zero_state_nodes(optimizer, values):
    nodes = []
    for group in _state_names(optimizer, [f"p{i}" for i in range(len(values))]):
        for name, v in zip(group, values):
            nodes.append(helper.make_node("Constant", [], [name + "_0"], value=tensor(name + "_z", np.zeros_like(v))))
    return nodes


def _zero_state_outputs(optimizer, values, et):
    outs = []
    for group in _state_names(optimizer, [f"p{i}" for i in range(len(values))]):
        for name, v in zip(group, values):
            outs.append(vi(name + "_0", et, list(v.shape)))
    return outs


def _zero_state_binding(optimizer, values):
    binding = []
    groups_p = _state_names(optimizer, [f"p{i}" for i in range(len(values))])
    groups_n = _state_names(optimizer, ["W", "B"][: len(values)])
    for gp, gn in zip(groups_p, groups_n):
        for p, n in zip(gp, gn):
            binding.append((n, p + "_0"))
    return binding


def _optimizer(optimizer, nodes, inits, params, grads, values, dtype):
    """Append the optimizer update; return (update bindings, extra outputs)."""
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    new = [p + "_new" for p in params]
    if optimizer == "sgd":
        for p, g, n in zip(params, grads, new):
            nodes.append(helper.make_node("Mul", ["lr", g], [g + "_scaled"]))
            nodes.append(helper.make_node("Sub", [p, g + "_scaled"], [n]))
        outs = [vi(n, et, list(v.shape)) for n, v in zip(new, values)]
        return list(zip(params, new)), outs
    state = _state_names(optimizer, params)
    for group in state:
        for name, v in zip(group, values):
            inits.append(tensor(name, np.zeros_like(v)))
    state_new = [[s + "_new" for s in group] for group in state]
    flat_state = [s for g in state for s in g]
    flat_state_new = [s for g in state_new for s in g]
    ins = ["lr", "step"] + params + grads + flat_state
    outs_names = new + flat_state_new
    if optimizer in ("momentum", "nesterov"):
        nodes.append(helper.make_node("Momentum", ins, outs_names, domain=PREVIEW, alpha=0.9, beta=1.0,
                                      mode="standard" if optimizer == "momentum" else "nesterov",
                                      norm_coefficient=0.0))
    elif optimizer == "adagrad":
        nodes.append(helper.make_node("Adagrad", ins, outs_names, domain=PREVIEW, epsilon=1e-6,
                                      decay_factor=0.1, norm_coefficient=0.0))
    elif optimizer == "adam":
        nodes.append(helper.make_node("Adam", ins, outs_names, domain=PREVIEW, alpha=0.9, beta=0.999,
                                      epsilon=1e-6, norm_coefficient=0.0))
    else:
        raise ValueError(optimizer)
    all_values = values * (1 + len(state))
    outs = [vi(n, et, list(v.shape)) for n, v in zip(outs_names, all_values)]
    return list(zip(params + flat_state, outs_names)), outs
