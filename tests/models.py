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


# ------------------------------------------------------------ training models
OPTIMIZER_STATE = {"sgd": (), "momentum": ("v",), "nesterov": ("v",), "adagrad": ("h",),
                   "adam": ("v", "h")}


def trainable_model(
    main_nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    params: dict[str, np.ndarray],
    loss_nodes: Sequence[onnx.NodeProto],
    target: onnx.ValueInfoProto,
    optimizer: str = "sgd",
    lr: float = 0.05,
    groups: Sequence[Sequence[str]] | None = None,
    opset: int = 17,
    consts: dict[str, np.ndarray] | None = None,
) -> onnx.ModelProto:
    """A training model: main graph; per group of params one TrainingInfoProto
    with loss_nodes (producing 'loss') -> Gradient -> optimizer -> step counter,
    and an initialization graph that resets the group's params and state."""
    groups = [list(params)] if groups is None else [list(g) for g in groups]
    dtype = next(iter(params.values())).dtype
    et = helper.np_dtype_to_tensor_dtype(dtype)
    zs = [i.name for i in inputs] + [target.name]
    infos = []
    for gi, group in enumerate(groups):
        step = f"step{gi}"
        nodes = list(loss_nodes)
        grads = [f"d_{p}" for p in group]
        nodes.append(helper.make_node("Gradient", group + zs, grads, domain=PREVIEW, xs=group, zs=zs,
                                      y="loss", name=f"gradient{gi}"))
        inits = [tensor("lr", np.asarray(lr, dtype=dtype)), tensor(step, np.asarray(0, np.int64)),
                 tensor("one", np.asarray(1, np.int64))]
        states = {k: [f"{p}_{k}" for p in group] for k in OPTIMIZER_STATE[optimizer]}
        for k, names in states.items():
            inits += [tensor(n, np.zeros_like(params[p])) for n, p in zip(names, group)]
        new = [f"{p}_new" for p in group]
        flat_state = [n for names in states.values() for n in names]
        flat_new = [n + "_new" for n in flat_state]
        if optimizer == "sgd":
            for p, g, n in zip(group, grads, new):
                nodes += [helper.make_node("Mul", ["lr", g], [g + "_lr"]),
                          helper.make_node("Sub", [p, g + "_lr"], [n])]
        else:
            op, attrs = {
                "momentum": ("Momentum", dict(alpha=0.9, beta=1.0, mode="standard", norm_coefficient=0.0)),
                "nesterov": ("Momentum", dict(alpha=0.9, beta=1.0, mode="nesterov", norm_coefficient=0.001)),
                "adagrad": ("Adagrad", dict(epsilon=1e-6, decay_factor=0.1, norm_coefficient=0.0)),
                "adam": ("Adam", dict(alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.0)),
            }[optimizer]
            nodes.append(helper.make_node(op, ["lr", step] + group + grads + flat_state, new + flat_new,
                                          domain=PREVIEW, name=f"opt{gi}", **attrs))
        nodes.append(helper.make_node("Add", [step, "one"], [step + "_new"]))
        shapes = [params[p].shape for p in group] + [params[p].shape for _ in states for p in group]
        algo_outputs = [vi("loss", et, [])] + [
            vi(n, et, list(shp)) for n, shp in zip(new + flat_new, shapes)
        ] + [vi(step + "_new", TensorProto.INT64, [])]
        update = list(zip(group + flat_state, new + flat_new)) + [(step, step + "_new")]
        init_nodes, init_outputs, init_binding = [], [], []
        for name, value in [(p, params[p]) for p in group] + [
            (n, np.zeros_like(params[p])) for names in states.values() for n, p in zip(names, group)
        ] + [(step, np.asarray(0, np.int64))]:
            init_nodes.append(helper.make_node("Constant", [], [name + "_init"], value=tensor(name + "_v", value)))
            init_outputs.append(vi(name + "_init", helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape)))
            init_binding.append((name, name + "_init"))
        algo_consts = [tensor(k, v) for k, v in (consts or {}).items()]
        infos.append(training_info(nodes, inits + algo_consts, [target], algo_outputs, update,
                                   init_nodes=init_nodes, init_outputs=init_outputs,
                                   init_binding=init_binding))
    return model(main_nodes, inputs, outputs, [tensor(k, v) for k, v in params.items()], infos,
                 opset=opset)


def linear_regression(optimizer="sgd", n_in=3, lr=0.05, dtype=np.float32, seed=0, opset=17):
    """Y = X W + B, loss = mean((Y - T)^2)."""
    rng = np.random.default_rng(seed)
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    params = {"W": (rng.standard_normal((n_in, 1)) * 0.1).astype(dtype), "B": np.zeros((1,), dtype)}
    main = [helper.make_node("MatMul", ["X", "W"], ["XW"]), helper.make_node("Add", ["XW", "B"], ["Y"])]
    loss = [helper.make_node("Sub", ["Y", "T"], ["diff"]), helper.make_node("Mul", ["diff", "diff"], ["sq"]),
            helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    return trainable_model(main, [vi("X", et, ["N", n_in])], [vi("Y", et, ["N", 1])], params, loss,
                           vi("T", et, ["N", 1]), optimizer, lr, opset=opset)


def mlp_classifier(optimizer="sgd", sizes=(4, 8, 3), lr=0.1, dtype=np.float32, seed=0, opset=17,
                   groups=None):
    """logits = relu(X W1 + b1) W2 + b2 (Gemm), loss = SoftmaxCrossEntropyLoss(mean)."""
    rng = np.random.default_rng(seed)
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    n_in, n_hidden, n_out = sizes
    params = {
        "W1": (rng.standard_normal((n_in, n_hidden)) / np.sqrt(n_in)).astype(dtype),
        "b1": np.zeros((n_hidden,), dtype),
        "W2": (rng.standard_normal((n_hidden, n_out)) / np.sqrt(n_hidden)).astype(dtype),
        "b2": np.zeros((n_out,), dtype),
    }
    main = [helper.make_node("Gemm", ["X", "W1", "b1"], ["h_pre"]),
            helper.make_node("Relu", ["h_pre"], ["h"]),
            helper.make_node("Gemm", ["h", "W2", "b2"], ["logits"])]
    loss = [helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "label"], ["loss"], reduction="mean")]
    return trainable_model(main, [vi("X", et, ["N", n_in])], [vi("logits", et, ["N", n_out])], params,
                           loss, vi("label", TensorProto.INT64, ["N"]), optimizer, lr, groups, opset)


def overridable_regression(n_in=3, n_out=2, scale=2.0, lr=0.5, dtype=np.float64, seed=0):
    """Y = Gemm(X, W) * scale, loss = mean((Y - T)^2), W -= lr * dloss/dW.

    ``scale`` (main graph) and ``lr`` (algorithm) are inputs with a default
    (an initializer of the same name, IR >= 4): fed, the feed wins.  The
    algorithm also returns ``d_scale``, the gradient with respect to scale."""
    rng = np.random.default_rng(seed)
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    main = [helper.make_node("Gemm", ["X", "W"], ["XW"]), helper.make_node("Mul", ["XW", "scale"], ["Y"])]
    algo = [helper.make_node("Sub", ["Y", "T"], ["diff"]), helper.make_node("Mul", ["diff", "diff"], ["sq"]),
            helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0),
            helper.make_node("Gradient", ["W", "scale", "X", "T"], ["d_W", "d_scale"], domain=PREVIEW,
                             xs=["W", "scale"], zs=["X", "T"], y="loss"),
            helper.make_node("Mul", ["lr", "d_W"], ["step"]), helper.make_node("Sub", ["W", "step"], ["W_new"])]
    info = training_info(algo, [tensor("lr", np.asarray(lr, dtype))],
                         [vi("T", et, ["N", n_out]), vi("lr", et, [])],
                         [vi("loss", et, []), vi("d_scale", et, []), vi("W_new", et, [n_in, n_out])],
                         [("W", "W_new")])
    w = (rng.standard_normal((n_in, n_out)) * 0.5).astype(dtype)
    return model(main, [vi("X", et, ["N", n_in]), vi("scale", et, [])], [vi("Y", et, ["N", n_out])],
                 [tensor("W", w), tensor("scale", np.asarray(scale, dtype))], [info])


def gemm_inference(n_in: int = 4, n_out: int = 3, seed: int = 0) -> onnx.ModelProto:
    """An inference model y = x @ W + b (Gemm), x float32 [N, n_in], for the builder."""
    rng = np.random.default_rng(seed)
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["y"])], "g",
        [vi("x", F32, ["N", n_in])], [vi("y", F32, ["N", n_out])],
        [tensor("W", rng.standard_normal((n_in, n_out)).astype(np.float32)),
         tensor("b", np.zeros(n_out, np.float32))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def inference_mlp(batch_norm: bool = False, dropout: bool = False, opset: int = 17) -> onnx.ModelProto:
    """X [N, 6] -> MatMul, [BatchNormalization], Relu, [Dropout], MatMul -> Y [N, 3]."""
    rng = np.random.default_rng(0)
    w1 = onnx.numpy_helper.from_array(rng.standard_normal((6, 8)).astype(np.float32), "W1")
    w2 = onnx.numpy_helper.from_array(rng.standard_normal((8, 3)).astype(np.float32), "W2")
    inits = [w1, w2]
    nodes = [helper.make_node("MatMul", ["X", "W1"], ["h0"])]
    h = "h0"
    if batch_norm:
        for name, value in (("g", 1.0), ("b", 0.0), ("mean", 0.0), ("var", 1.0)):
            inits.append(onnx.numpy_helper.from_array(np.full(8, value, np.float32), name))
        nodes.append(helper.make_node("BatchNormalization", [h, "g", "b", "mean", "var"], ["hb"]))
        h = "hb"
    nodes.append(helper.make_node("Relu", [h], ["h1"]))
    h = "h1"
    if dropout:
        nodes.append(helper.make_node("Dropout", [h], ["hd"]))
        h = "hd"
    nodes.append(helper.make_node("MatMul", [h, "W2"], ["Y"]))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 6])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
