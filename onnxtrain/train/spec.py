"""What ``fit`` needs to know about a training model: ``FitSpec``.

Which inputs the data feeds, which output is the loss and which the
prediction, the task and its classes, which algorithm runs on which batch.
It comes from ``model.metadata_props`` written by ``onnxtrain.build`` (JSON
values; ``io.metadata`` lists the keys), and is inferred from the graphs for
hand-built models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from ..errors import TrainingModelError
from ..io.metadata import model_metadata

TASKS = ("classification", "regression")


@dataclass(frozen=True)
class FitSpec:
    """What the training loop knows about a model (from metadata, else inferred)."""

    inputs: tuple[str, ...]
    target: str | None
    loss: str | None
    prediction: str | None
    task: str | None
    #: Algorithm index per batch, repeated; None runs every algorithm (one spec iteration).
    cycle: tuple[int | None, ...]
    #: The algorithm whose combined graph computes the loss (for evaluate).
    loss_algorithm: int | None
    from_metadata: tuple[str, ...] = field(default=())


def fit_spec(sess: Any) -> FitSpec:
    """Read the model's ``onnxtrain.*`` metadata, inferring what is missing (see the module doc)."""
    meta = model_metadata(sess.model)
    main_inputs = list(sess.inference_inputs)
    main_outputs = list(sess.inference_outputs)
    algo_inputs = sess.algorithm_inputs
    algo_outputs = sess.algorithm_outputs

    inputs = meta.get("inputs", main_inputs)
    if not isinstance(inputs, list) or not all(isinstance(n, str) for n in inputs):
        raise TrainingModelError(f"metadata onnxtrain.inputs: expected a list of names, got {inputs!r}")

    if "target" in meta:
        target = meta["target"]
    else:
        extra = sorted({n for feeds in algo_inputs for n in feeds} - set(main_inputs))
        target = extra[0] if len(extra) == 1 else None

    if "loss" in meta:
        loss = meta["loss"]
    else:
        loss = _infer_loss(sess, main_outputs, algo_outputs)

    prediction = meta.get("prediction", main_outputs[0] if main_outputs else None)
    if prediction is not None and prediction not in main_outputs:
        raise TrainingModelError(
            f"metadata onnxtrain.prediction: {prediction!r} is not an output of the main graph "
            f"{main_outputs}"
        )

    task = meta.get("task")
    if task is None and target is not None:
        vi = find_value_info(sess, target)
        if vi is not None:
            dtype = np_dtype(vi)
            if dtype is not None:
                task = "classification" if dtype.kind in "iub" else "regression"
    if task is not None and task not in TASKS:
        raise TrainingModelError(f"metadata onnxtrain.task: expected one of {TASKS}, got {task!r}")

    n = sess.num_algorithms
    cycle = meta.get("cycle")
    if cycle is None:
        cycle = [None]
    elif (not isinstance(cycle, list) or not cycle
          or not all(isinstance(i, int) and 0 <= i < n for i in cycle)):
        raise TrainingModelError(
            f"metadata onnxtrain.cycle: expected a non-empty list of algorithm indices in "
            f"[0, {n}), got {cycle!r}"
        )

    loss_algorithm = None
    if loss is not None:
        order = [i for i in cycle if i is not None] + list(range(n))
        for i in order:
            if loss in algo_outputs[i]:
                loss_algorithm = i
                break
        if loss_algorithm is None:
            raise TrainingModelError(
                f"the loss {loss!r} is not an output of any algorithm; outputs are {algo_outputs}"
            )
    known = tuple(k for k in ("inputs", "target", "loss", "prediction", "task", "cycle") if k in meta)
    return FitSpec(tuple(inputs), target, loss, prediction, task, tuple(cycle), loss_algorithm, known)


def _infer_loss(sess: Any, main_outputs: list[str], algo_outputs: list[list[str]]) -> str | None:
    """'loss' if an algorithm returns it, else the single algorithm-only output, else None."""
    candidates: list[str] = []
    for outs in algo_outputs:
        for name in outs:
            if name not in main_outputs and name not in candidates:
                candidates.append(name)
    if "loss" in candidates:
        return "loss"
    return candidates[0] if len(candidates) == 1 else None


#: Class-index loss ops of the default domain: (scores, labels, [weights]) inputs.
_CLASS_LOSS_OPS = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")


def _classes_from_loss_nodes(model: onnx.ModelProto, target: str) -> dict[str, Any] | None:
    """The label check's facts for a model not made by ``onnxtrain.build``
    (no metadata ``onnxtrain.classes``): an algorithm's SoftmaxCrossEntropyLoss
    or NegativeLogLikelihoodLoss that reads ``target`` as its labels gives C
    (dim 1 of its scores, where a graph declares it statically) and its
    ignore_index.  None when no such node reads the target."""
    declared: dict[str, onnx.ValueInfoProto] = {}
    graphs = [model.graph] + [ti.algorithm for ti in model.training_info]
    for g in graphs:
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            declared.setdefault(vi.name, vi)
    for g in graphs[1:]:
        for node in g.node:
            if node.op_type not in _CLASS_LOSS_OPS or node.domain not in ("", "ai.onnx"):
                continue
            if len(node.input) < 2 or node.input[1] != target:
                continue
            ignore = next((a.i for a in node.attribute if a.name == "ignore_index"), None)
            count = None
            vi = declared.get(node.input[0])
            if vi is not None and vi.type.tensor_type.HasField("shape"):
                dims = vi.type.tensor_type.shape.dim
                if len(dims) >= 2 and dims[1].HasField("dim_value") and dims[1].dim_value > 0:
                    count = int(dims[1].dim_value)
            return {"count": count, "axis": 1, "ignore_index": ignore}
    return None


def find_value_info(sess: Any, name: str) -> onnx.ValueInfoProto | None:
    for feeds in [sess.inference_inputs, *sess.algorithm_inputs]:
        if name in feeds:
            return feeds[name]
    return None


def np_dtype(vi: onnx.ValueInfoProto) -> np.dtype | None:
    elem = vi.type.tensor_type.elem_type
    if not elem:
        return None
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
    except (KeyError, TypeError, ValueError):
        return None


def label_classes(sess: Any, target: str) -> dict[str, Any] | None:
    """What labels of ``target`` are checked against: metadata
    ``onnxtrain.classes`` of a built model, else the class-index loss node that
    reads the target (``_classes_from_loss_nodes``); None for other losses."""
    return model_metadata(sess.model).get("classes") or _classes_from_loss_nodes(sess.model, target)
