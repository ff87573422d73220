"""Turn a workload's inference model into an ONNX training model for onnxtrain.

Uses ``onnxtrain.build.training_model`` when that builder exists and accepts
the workload's loss and optimizer (its AdamW follows torch.optim.AdamW's rule,
written as arithmetic); otherwise (or with ``run.py --no-builder``) builds the
``training_info`` by hand with onnx.helper, the way ``tests/models.py`` does:

    algorithm:  loss(output, target) -> Gradient(xs=params, zs=inputs+target, y=loss)
                -> optimizer -> step + 1
    update_binding: every param, every optimizer moment, the step counter

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


def hand_built(model: onnx.ModelProto, workload) -> onnx.ModelProto:
    """The training model of ``workload`` (see the module docstring), by hand."""
    params = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    names = list(params)
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

    nodes = _loss_nodes(workload.loss, workload.output, workload.target)
    nodes.append(helper.make_node("Gradient", names + zs, grads, domain=PREVIEW, xs=names, zs=zs,
                                  y="loss", name="gradient"))
    inits = [_tensor("lr", np.float32(workload.lr)), _tensor("step", np.int64(1)),
             _tensor("one", np.int64(1))]
    state: list[str] = []
    if workload.optimizer == "sgd":
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

    ti = onnx.TrainingInfoProto()
    ti.algorithm.CopyFrom(helper.make_graph(nodes, "algorithm", [target_vi], outputs, inits))
    for p, x_new in zip(names, new):
        ti.update_binding.add(key=p, value=x_new)
    for s in state:
        ti.update_binding.add(key=s, value=s + ".new")
    ti.update_binding.add(key="step", value="step.new")

    out = onnx.ModelProto()
    out.CopyFrom(model)
    if not any(o.domain == PREVIEW for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(PREVIEW, 1))
    out.training_info.append(ti)
    return out


def with_builder(model: onnx.ModelProto, workload) -> onnx.ModelProto | None:
    """The training model from ``onnxtrain.build`` if it is there and takes these settings."""
    try:
        from onnxtrain import build  # noqa: PLC0415 (optional, written concurrently)
    except ImportError:
        return None
    try:
        if workload.optimizer == "adamw":
            opt = build.AdamW(lr=workload.lr, weight_decay=workload.weight_decay)
        else:
            opt = build.SGD(lr=workload.lr)
        loss = {"cross_entropy": "cross_entropy", "mse": "mse"}[workload.loss]
        built = build.training_model(model, loss=loss, target=workload.target,
                                     output=workload.output, optimizer=opt)
    except Exception:  # an API in flux: fall back to the hand-built model
        return None
    # The worker feeds the workload's input and target names: insist on them.
    fed = {i.name for ti in built.training_info for i in ti.algorithm.input}
    fed |= {i.name for i in built.graph.input}
    if workload.target not in fed:
        return None
    return built


def training_model(model: onnx.ModelProto, workload, use_builder: bool = True):
    """(training ModelProto, "builder" | "hand-built")."""
    if use_builder:
        built = with_builder(model, workload)
        if built is not None:
            return built, "builder"
    return hand_built(model, workload), "hand-built"
