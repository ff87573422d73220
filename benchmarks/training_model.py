"""Turn a workload's inference model into an ONNX training model for onnxtrain.

Uses ``onnxtrain.build.training_model`` when that builder exists and accepts
the workload's loss and optimizer (its AdamW follows torch.optim.AdamW's rule,
written as arithmetic); otherwise (or with ``run.py --no-builder``) builds the
``training_info`` by hand with onnx.helper, the way ``tests/models.py`` does:

    algorithm:  loss(output, target) -> Gradient(xs=params, zs=inputs+target, y=loss)
                -> optimizer -> step + 1
    update_binding: every param, every optimizer moment, the step counter

A model with BatchNormalization (W5) gets the forward pass again in the
algorithm with the nodes in training mode (batch statistics, as torch's
``module.train()``), and its running statistics bound as state, updated as
torch does (``_training_forward``).  SGD with momentum is the spec's
``Momentum`` op (mode "standard", alpha=momentum, beta=1, norm_coefficient =
weight decay): torch.optim.SGD with dampening 0 exactly, the buffer starting
at zero so that the first one is the gradient.

AdamW is the spec's Adam op with torch's AdamW numbers::

    Adam(alpha=beta1=0.9, beta=beta2=0.999, epsilon=1e-8, norm_coefficient=0,
         norm_coefficient_post=lr*weight_decay)

with the step counter starting at T=1, so that the bias corrections are
torch's (torch counts its first step as 1; the spec's T=0 means "no
correction").  What differs from torch.optim.AdamW, by design of the spec op:
epsilon is added to sqrt(H) before the bias correction of H (torch adds it
after, so torch's eps is eps/sqrt(1-beta2^T) here), and the decay multiplies
X after the update instead of before (a difference of lr*wd*update, 1e-5 of
an update).  Both move a loss by far less than 1e-4 relative.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

PREVIEW = "ai.onnx.preview.training"


def _tensor(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def _loss_nodes(kind: str, output: str, target: str) -> list[onnx.NodeProto]:
    if kind == "cross_entropy":
        return [helper.make_node("SoftmaxCrossEntropyLoss", [output, target], ["loss"], reduction="mean")]
    if kind == "mse":
        return [
            helper.make_node("Sub", [output, target], ["loss_diff"]),
            helper.make_node("Mul", ["loss_diff", "loss_diff"], ["loss_sq"]),
            helper.make_node("ReduceMean", ["loss_sq"], ["loss"], keepdims=0),
        ]
    raise ValueError(f"unknown loss {kind!r}")


def batchnorm_stats(model: onnx.ModelProto) -> list[str]:
    """Initializers that BatchNormalization nodes read as running mean / variance."""
    return [i for n in model.graph.node if n.op_type == "BatchNormalization" for i in n.input[3:5]]


def trainable(model: onnx.ModelProto) -> list[str]:
    """The parameters: floating-point initializers but BatchNormalization statistics."""
    stats = set(batchnorm_stats(model))
    floats = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)
    return [t.name for t in model.graph.initializer if t.data_type in floats and t.name not in stats]


def _training_forward(model: onnx.ModelProto, output: str):
    """The forward pass again, in training mode, for the algorithm graph.

    Every main-graph node is copied with its outputs renamed ``train/<name>``;
    BatchNormalization nodes run with ``training_mode=1`` (batch statistics,
    as torch's ``module.train()``) and output their new running statistics.
    torch updates running_var with the unbiased batch variance, ONNX with the
    biased one: the ONNX value v' = m v + (1 - m) b is corrected to
    v' + (v' - m v) / (n - 1), n the values per channel (= N*H*W).

    Returns (nodes, the copy's ``output``, [(statistic, its new value)], value_info)."""
    rename: dict[str, str] = {}
    nodes: list[onnx.NodeProto] = []
    stats: list[tuple[str, str]] = []
    for node in model.graph.node:
        if node.op_type == "Dropout":
            raise ValueError("hand-built training forward: Dropout is not supported here")
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = "train/" + (node.name or node.op_type)
        del copy.input[:]
        copy.input.extend(rename.get(i, i) for i in node.input)
        del copy.output[:]
        for o in node.output:
            rename[o] = f"train/{o}" if o else ""
            copy.output.append(rename[o])
        if node.op_type == "BatchNormalization":
            kept = [a for a in copy.attribute if a.name != "training_mode"]
            del copy.attribute[:]
            copy.attribute.extend(kept + [helper.make_attribute("training_mode", 1)])
            mean, var = node.input[3], node.input[4]
            new_mean, new_var = f"train/{mean}.new", f"train/{var}.biased"
            del copy.output[1:]
            copy.output.extend([new_mean, new_var])
            momentum = next((a.f for a in node.attribute if a.name == "momentum"), 0.9)
            x, p = copy.input[0], f"train/{var}"
            nodes.append(copy)
            nodes += [
                helper.make_node("Shape", [x], [p + ".shape"]),
                helper.make_node("Gather", [p + ".shape", "bn_one"], [p + ".channels"], axis=0),
                helper.make_node("Size", [x], [p + ".size"]),
                helper.make_node("Div", [p + ".size", p + ".channels"], [p + ".n"]),
                helper.make_node("Sub", [p + ".n", "bn_one"], [p + ".n1"]),
                helper.make_node("Cast", [p + ".n1"], [p + ".n1f"], to=TensorProto.FLOAT),
                helper.make_node("Mul", [var, _scalar_name(momentum)], [p + ".old"]),
                helper.make_node("Sub", [new_var, p + ".old"], [p + ".inc"]),
                helper.make_node("Div", [p + ".inc", p + ".n1f"], [p + ".corr"]),
                helper.make_node("Add", [new_var, p + ".corr"], [p + ".new"]),
            ]
            stats += [(mean, new_mean), (var, p + ".new")]
            continue
        nodes.append(copy)
    value_info = []
    for vi in list(model.graph.value_info) + list(model.graph.output):
        if vi.name in rename:
            new = onnx.ValueInfoProto()
            new.CopyFrom(vi)
            new.name = rename[vi.name]
            value_info.append(new)
    return nodes, rename[output], stats, value_info


def _scalar_name(value: float) -> str:
    return f"bn_momentum_{value!r}"


def hand_built(model: onnx.ModelProto, workload) -> onnx.ModelProto:
    """The training model of ``workload`` (see the module docstring), by hand."""
    all_params = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    names = trainable(model)
    params = {n: all_params[n] for n in names}
    out_vi = next(o for o in model.graph.output if o.name == workload.output)
    if workload.loss == "cross_entropy":
        n = out_vi.type.tensor_type.shape.dim[0].dim_value
        target_vi = helper.make_tensor_value_info(workload.target, TensorProto.INT64, [n])
    else:
        target_vi = helper.make_tensor_value_info(workload.target, TensorProto.FLOAT, None)
        target_vi.type.tensor_type.CopyFrom(out_vi.type.tensor_type)
    zs = [i.name for i in model.graph.input] + [workload.target]
    grads = [f"grad.{p}" for p in names]
    new = [f"new.{p}" for p in names]

    inits = [_tensor("lr", np.float32(workload.lr)), _tensor("step", np.int64(1)),
             _tensor("one", np.int64(1))]
    nodes: list[onnx.NodeProto] = []
    output, stats, value_info = workload.output, [], []
    if batchnorm_stats(model):
        nodes, output, stats, value_info = _training_forward(model, workload.output)
        inits.append(_tensor("bn_one", np.int64(1)))
        for m in sorted({a.f for n in model.graph.node if n.op_type == "BatchNormalization"
                         for a in n.attribute if a.name == "momentum"} | {0.9}):
            inits.append(_tensor(_scalar_name(m), np.float32(m)))
    nodes += _loss_nodes(workload.loss, output, workload.target)
    nodes.append(helper.make_node("Gradient", names + zs, grads, domain=PREVIEW, xs=names, zs=zs,
                                  y="loss", name="gradient"))
    state: list[str] = []
    momentum = getattr(workload, "momentum", 0.0)
    if workload.optimizer == "sgd" and momentum:
        # torch.optim.SGD(momentum=m, dampening=0) is the spec's standard Momentum with
        # alpha=m, beta=1 (the buffer starts at zero, so the first one is the gradient).
        v = [f"momentum.{p}" for p in names]
        state = v
        inits += [_tensor(s, np.zeros_like(params[p])) for s, p in zip(v, names)]
        nodes.append(helper.make_node(
            "Momentum", ["lr", "step"] + names + grads + v, new + [s + ".new" for s in v],
            domain=PREVIEW, name="sgd_momentum", alpha=float(momentum), beta=1.0,
            norm_coefficient=float(workload.weight_decay), mode="standard"))
    elif workload.optimizer == "sgd":
        for p, g, x_new in zip(names, grads, new):
            nodes += [helper.make_node("Mul", ["lr", g], [g + ".scaled"]),
                      helper.make_node("Sub", [p, g + ".scaled"], [x_new])]
    elif workload.optimizer == "adamw":
        v = [f"adam_v.{p}" for p in names]
        h = [f"adam_h.{p}" for p in names]
        state = v + h
        inits += [_tensor(s, np.zeros_like(params[p])) for s, p in zip(v + h, names + names)]
        nodes.append(helper.make_node(
            "Adam", ["lr", "step"] + names + grads + v + h, new + [s + ".new" for s in state],
            domain=PREVIEW, name="adamw", alpha=0.9, beta=0.999, epsilon=1e-8,
            norm_coefficient=0.0, norm_coefficient_post=workload.lr * workload.weight_decay))
    else:
        raise ValueError(f"unknown optimizer {workload.optimizer!r}")
    nodes.append(helper.make_node("Add", ["step", "one"], ["step.new"]))

    shapes = {p: list(a.shape) for p, a in params.items()}
    outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
    outputs += [helper.make_tensor_value_info(x_new, TensorProto.FLOAT, shapes[p]) for p, x_new in zip(names, new)]
    outputs += [helper.make_tensor_value_info(s + ".new", TensorProto.FLOAT, shapes[p])
                for s, p in zip(state, names + names)]
    outputs.append(helper.make_tensor_value_info("step.new", TensorProto.INT64, []))
    outputs += [helper.make_tensor_value_info(new_stat, TensorProto.FLOAT, list(all_params[stat].shape))
                for stat, new_stat in stats]

    ti = onnx.TrainingInfoProto()
    ti.algorithm.CopyFrom(helper.make_graph(nodes, "algorithm", [target_vi], outputs, inits,
                                            value_info=value_info))
    for p, x_new in zip(names, new):
        ti.update_binding.add(key=p, value=x_new)
    for s in state:
        ti.update_binding.add(key=s, value=s + ".new")
    ti.update_binding.add(key="step", value="step.new")
    for stat, new_stat in stats:
        ti.update_binding.add(key=stat, value=new_stat)

    out = onnx.ModelProto()
    out.CopyFrom(model)
    if not any(o.domain == PREVIEW for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(PREVIEW, 1))
    out.training_info.append(ti)
    return out


def builder_options(build, workload) -> dict:
    """``onnxtrain.build.training_model``'s options for a workload."""
    if workload.optimizer == "adamw":
        opt = build.AdamW(lr=workload.lr, weight_decay=workload.weight_decay)
    else:
        opt = build.SGD(lr=workload.lr, momentum=getattr(workload, "momentum", 0.0))
    loss = {"cross_entropy": "cross_entropy", "mse": "mse"}[workload.loss]
    return dict(loss=loss, target=workload.target, output=workload.output, optimizer=opt)


def _feeds_the_target(built: onnx.ModelProto, workload) -> bool:
    """The worker feeds the workload's input and target names: insist on them."""
    fed = {i.name for ti in built.training_info for i in ti.algorithm.input}
    fed |= {i.name for i in built.graph.input}
    return workload.target in fed


def with_builder(model: onnx.ModelProto, workload) -> onnx.ModelProto | None:
    """The training model from ``onnxtrain.build`` if it is there and takes these settings."""
    try:
        from onnxtrain import build  # noqa: PLC0415 (optional, written concurrently)
    except ImportError:
        return None
    try:
        built = build.training_model(model, **builder_options(build, workload))
    except Exception:  # an API in flux: fall back to the hand-built model
        return None
    return built if _feeds_the_target(built, workload) else None


def training_session(model: onnx.ModelProto, workload, use_builder: bool = True):
    """(onnxtrain.TrainingSession, "builder" | "hand-built"): the builder's
    model through ``build.training_session`` (the one call a script makes)
    where it is there, else ``TrainingSession`` of ``training_model``'s."""
    import onnxtrain  # noqa: PLC0415

    try:
        from onnxtrain import build  # noqa: PLC0415 (optional, written concurrently)
    except ImportError:
        build = None
    if use_builder and hasattr(build, "training_session"):
        try:
            sess = build.training_session(model, **builder_options(build, workload))
        except Exception:  # an API in flux: as training_model does
            sess = None
        if sess is not None and _feeds_the_target(sess.model, workload):
            return sess, "builder"
    built, how = training_model(model, workload, use_builder)
    return onnxtrain.TrainingSession(built), how


def training_model(model: onnx.ModelProto, workload, use_builder: bool = True):
    """(training ModelProto, "builder" | "hand-built")."""
    if use_builder:
        built = with_builder(model, workload)
        if built is not None:
            return built, "builder"
    return hand_built(model, workload), "hand-built"
