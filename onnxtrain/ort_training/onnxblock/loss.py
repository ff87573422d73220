"""Losses as blocks (ONNX Runtime training's ``onnxblock.loss``).

``reduction``: "mean" (default), "sum" or "none".  The target input
(``target`` / ``labels``) is added as a graph input when the model has none:
for MSE, L1 and BCE with the type of the prediction; for cross entropy int64
class indices with the prediction's last (class) dimension removed.

BCEWithLogitsLoss uses the stable form (PyTorch's), with lw = 1 + (pos_weight - 1) t:
  loss = (1 - t) x + lw (log(1 + exp(-|x|)) + max(-x, 0))
which equals -[pw t log s(x) + (1 - t) log(1 - s(x))] without overflowing for large |x|.
"""

from __future__ import annotations

import copy
from typing import Optional

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from . import blocks

_REDUCTIONS = ("mean", "sum", "none")


def _check(reduction: str) -> str:
    if reduction not in _REDUCTIONS:
        raise RuntimeError(f"Reduction {reduction} not supported.")
    return reduction


class _Reduced(blocks.Block):
    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self._reduction = _check(reduction)

    def _reduce(self, name: str) -> str:
        if self._reduction == "mean":
            return blocks.ReduceMean(keepdims=False)(name)
        if self._reduction == "sum":
            return blocks.ReduceSum(keepdims=False)(name)
        return name

    def _target(self, like: str, target_name: str) -> str:
        if blocks.exists(self.base, target_name):
            return target_name
        return blocks.InputLike(like)(target_name)

    def _constant(self, value, hint: str) -> str:
        name = blocks.fresh(hint)
        self.base.graph.initializer.append(
            numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name


class MSELoss(_Reduced):
    """reduce((x - target)^2)."""

    def build(self, loss_input_name: str, target_name: str = "target") -> str:
        target = self._target(loss_input_name, target_name)
        diff = blocks.Sub()(loss_input_name, target)
        return self._reduce(blocks.Mul()(diff, diff))


class L1Loss(_Reduced):
    """reduce(|x - target|)."""

    def build(self, loss_input_name: str, target_name: Optional[str] = "target") -> str:
        target = self._target(loss_input_name, target_name)
        return self._reduce(blocks.Abs()(blocks.Sub()(loss_input_name, target)))


class BCEWithLogitsLoss(_Reduced):
    """Binary cross entropy on logits (see the module docstring); ``weight``
    multiplies each element's loss, ``pos_weight`` the positive term."""

    def __init__(self, weight=None, reduction: str = "mean", pos_weight=None) -> None:
        super().__init__(reduction)
        self._weight, self._pos_weight = weight, pos_weight

    def build(self, loss_input_name: str, target_name: str = "target") -> str:
        x = loss_input_name
        t = self._target(x, target_name)
        one = blocks.Constant(1.0)()
        # log(1 + exp(-|x|)) + max(-x, 0)
        softplus = blocks.Add()(
            blocks.Log()(blocks.Add()(one, blocks.Exp()(blocks.Neg()(blocks.Abs()(x))))),
            blocks.Relu()(blocks.Neg()(x)))
        lw = None
        if self._pos_weight is not None:
            pw_minus_one = self._constant(np.asarray(self._pos_weight) - 1.0, "bceloss.pos_weight")
            lw = blocks.Add()(one, blocks.Mul()(pw_minus_one, t))
        loss = blocks.Add()(blocks.Mul()(blocks.Sub()(one, t), x),
                            blocks.Mul()(lw, softplus) if lw is not None else softplus)
        if self._weight is not None:
            loss = blocks.Mul()(self._constant(self._weight, "bceloss.weight"), loss)
        return self._reduce(loss)


class CrossEntropyLoss(blocks.Block):
    """SoftmaxCrossEntropyLoss over the last axis of the scores, int64 labels."""

    def __init__(self, weight=None, reduction: str = "mean", ignore_index: Optional[int] = None):
        super().__init__()
        self._weight = weight
        self._reduction = _check(reduction)
        self._ignore_index = ignore_index

    def build(self, scores_input_name: str, labels_name: str = "labels") -> str:
        if not blocks.exists(self.base, labels_name):
            found = blocks.value_info(self.base, scores_input_name)
            if found is None:
                raise LookupError(f"Could not find the type of {scores_input_name}")
            labels = copy.deepcopy(found)
            labels.name = labels_name
            labels.type.tensor_type.elem_type = TensorProto.INT64
            del labels.type.tensor_type.shape.dim[-1]  # classes are the last dimension
            self.base.graph.input.append(labels)
        inputs = [scores_input_name, labels_name]
        if self._weight is not None:
            weight = blocks.fresh("celoss.weight")
            self.base.graph.initializer.append(
                numpy_helper.from_array(np.asarray(self._weight, np.float32), weight))
            inputs.append(weight)
        attrs = {"reduction": self._reduction}
        if self._ignore_index is not None:
            attrs["ignore_index"] = int(self._ignore_index)
        loss = blocks.fresh("loss")
        self.base.graph.node.append(helper.make_node(
            "SoftmaxCrossEntropyLoss", inputs, [loss, blocks.fresh("log_prob")],
            name=blocks.fresh("SoftmaxCrossEntropyLoss"), **attrs))
        return loss
