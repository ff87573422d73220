"""Losses for the builder: each appends ONNX nodes that compute one scalar.

Every loss follows the PyTorch definition with ``reduction="mean"`` (the
default of ``torch.nn.functional``).  With p the prediction and t the target:

- ``MSE``            mean((p - t)^2)
- ``L1``             mean(|p - t|)
- ``Huber(delta)``   mean(h(p - t)),  h(d) = d^2 / 2 if |d| < delta else delta (|d| - delta / 2)
- ``BCEWithLogits``  mean((1 - t) x + (1 + (pw - 1) t) softplus(-x)),  x = p, pw = pos_weight
- ``CrossEntropy``   logits p[N, C, d...], class indices t[N, d...]:
                     (1 - eps) * sum_i w[t_i] (-logp[i, t_i]) / sum_i w[t_i]
                     + eps / C * sum_i sum_c w[c] (-logp[i, c]) / sum_i w[t_i]
                     with logp = log_softmax(p, axis=1), w = weight (ones without), eps = label_smoothing
- ``NLL``            p already log-probabilities: sum_i w[t_i] (-p[i, t_i]) / sum_i w[t_i]

A loss object has three parts: ``target_type`` (the element type and shape
of the target input, given the prediction's), ``emit`` (the nodes) and
``task`` ("classification" or "regression", for the fit loop's metrics).
A plain callable ``fn(emit, prediction, target) -> name`` becomes a
``CustomLoss`` whose target has the prediction's type.

>>> from onnxtrain.emitter import Emitter
>>> from onnxtrain.names import NameGen
>>> e = Emitter(opset=17, names=NameGen(["y", "t"]), dtypes={"y": 1, "t": 1}, hint="loss")
>>> name = MSE().emit(e, "y", "t")
>>> [n.op_type for n in e.nodes]
['Sub', 'Mul', 'ReduceMean']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import TensorProto, numpy_helper

from ..emitter import FLOAT_TYPES, Emitter

#: Dimensions of a value as shape inference reports them (int, symbol or None), or None.
Shape = tuple | None

CLASSIFICATION = "classification"
REGRESSION = "regression"


class Loss:
    """A training loss: the target it needs and the nodes that compute it."""

    #: "classification" or "regression": tells the fit loop which metrics apply.
    task: str = REGRESSION

    def target_type(self, elem_type: int, shape: Shape) -> tuple[int, Shape]:
        """(element type, shape) of the target, given the prediction's.

        Regression losses take a target shaped like the prediction."""
        return elem_type, shape

    def emit(self, e: Emitter, prediction: str, target: str) -> str:
        """Append the loss nodes to ``e``; return the name of the scalar loss."""
        raise NotImplementedError


def _difference(e: Emitter, prediction: str, target: str) -> str:
    return e.Sub(prediction, target)


def _mean_all(e: Emitter, x: str) -> str:
    """mean over every element, as a 0-D tensor."""
    return e.reduce_mean(x, None, keepdims=False)


@dataclass(frozen=True)
class MSE(Loss):
    """mean((p - t)^2)  (torch.nn.MSELoss)."""

    task = REGRESSION

    def emit(self, e: Emitter, prediction: str, target: str) -> str:
        d = _difference(e, prediction, target)
        return _mean_all(e, e.Mul(d, d))


@dataclass(frozen=True)
class L1(Loss):
    """mean(|p - t|)  (torch.nn.L1Loss)."""

    task = REGRESSION

    def emit(self, e: Emitter, prediction: str, target: str) -> str:
        return _mean_all(e, e.Abs(_difference(e, prediction, target)))


@dataclass(frozen=True)
class Huber(Loss):
    """mean(h(p - t)) with h(d) = d^2/2 if |d| < delta else delta (|d| - delta/2)  (torch.nn.HuberLoss).

    Written without a branch: with a = |d| and q = min(a, delta),
    h = q (a - q/2), which is a^2/2 below delta and delta (a - delta/2) above."""

    delta: float = 1.0
    task = REGRESSION

    def __post_init__(self) -> None:
        if not self.delta > 0:
            raise ValueError(f"Huber: delta must be > 0, got {self.delta!r}")

    def emit(self, e: Emitter, prediction: str, target: str) -> str:
        a = e.Abs(_difference(e, prediction, target))
        q = e.Min(a, e.const(self.delta, like=prediction))
        half_q = e.Mul(q, e.const(0.5, like=prediction))
        return _mean_all(e, e.Mul(q, e.Sub(a, half_q)))


@dataclass(frozen=True)
class BCEWithLogits(Loss):
    """mean((1 - t) x + (1 + (pw - 1) t) softplus(-x))  (torch.nn.BCEWithLogitsLoss).

    This is -[pw t log sigmoid(x) + (1 - t) log(1 - sigmoid(x))] rewritten with
    log sigmoid(x) = -softplus(-x) and log(1 - sigmoid(x)) = -x - softplus(-x).
    softplus(-x) = max(-x, 0) + log(1 + exp(-|x|)) never overflows.
    ``pos_weight`` (a number or an array broadcast against the target, one
    value per class on the last axis) weighs the positive term."""

    pos_weight: Any = None
    task = CLASSIFICATION

    def emit(self, e: Emitter, prediction: str, target: str) -> str:
        x = prediction
        one = e.const(1.0, like=x)
        softplus_neg = e.Add(e.Relu(e.Neg(x)), e.Log(e.Add(one, e.Exp(e.Neg(e.Abs(x))))))
        if self.pos_weight is None:
            log_weight = one
        else:
            pw_minus_one = e.const(np.asarray(self.pos_weight, dtype=np.float64) - 1.0, like=x)
            log_weight = e.Add(one, e.Mul(pw_minus_one, target))
        negative_part = e.Mul(e.Sub(one, target), x)
        return _mean_all(e, e.Add(negative_part, e.Mul(log_weight, softplus_neg)))


def _class_target(elem_type: int, shape: Shape) -> tuple[int, Shape]:
    """int64 class indices shaped like the scores without the class axis 1."""
    if shape is None:
        return TensorProto.INT64, None
    if len(shape) < 2:
        raise ValueError(
            f"a class-index loss needs scores of rank >= 2 ([N, C, ...]), the prediction has "
            f"shape {list(shape)}"
        )
    return TensorProto.INT64, (shape[0],) + tuple(shape[2:])


def _weight_const(e: Emitter, weight: Any, like: str) -> str | None:
    if weight is None:
        return None
    w = np.asarray(weight, dtype=np.float64)
    if w.ndim != 1:
        raise ValueError(f"class weights must be a 1-D array (one per class), got shape {list(w.shape)}")
    return e.const(w, like=like)


@dataclass(frozen=True)
class NLL(Loss):
    """sum_i w[t_i] (-p[i, t_i]) / sum_i w[t_i] on log-probabilities p  (torch.nn.NLLLoss).

    One NegativeLogLikelihoodLoss node with reduction "mean", whose weighted
    mean is the same as torch's."""

    weight: Any = None
    task = CLASSIFICATION

    def target_type(self, elem_type: int, shape: Shape) -> tuple[int, Shape]:
        return _class_target(elem_type, shape)

    def emit(self, e: Emitter, prediction: str, target: str) -> str:
        w = _weight_const(e, self.weight, prediction)
        return e.NegativeLogLikelihoodLoss(prediction, target, w, reduction="mean")


@dataclass(frozen=True)
class CrossEntropy(Loss):
    """Softmax cross-entropy on logits with class-index targets  (torch.nn.CrossEntropyLoss).

    With logp = log_softmax(p, axis=1), w the class weights (ones without),
    eps = label_smoothing and C classes:

        nll    = sum_i w[t_i] (-logp[i, t_i]) / sum_i w[t_i]
        smooth = sum_i sum_c w[c] (-logp[i, c]) / sum_i w[t_i]
        loss   = (1 - eps) nll + eps / C * smooth

    (i runs over samples and spatial positions).  This is torch's weighted
    mean, label smoothing included.  nll is a SoftmaxCrossEntropyLoss node;
    its log_prob output feeds the smoothing term."""

    label_smoothing: float = 0.0
    weight: Any = None
    task = CLASSIFICATION

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(
                f"CrossEntropy: label_smoothing must be in [0, 1], got {self.label_smoothing!r}"
            )

    def target_type(self, elem_type: int, shape: Shape) -> tuple[int, Shape]:
        return _class_target(elem_type, shape)

    def emit(self, e: Emitter, prediction: str, target: str) -> str:
        w = _weight_const(e, self.weight, prediction)
        if self.label_smoothing == 0.0:
            return e.SoftmaxCrossEntropyLoss(prediction, target, w, reduction="mean")
        nll, logp = e.op(
            "SoftmaxCrossEntropyLoss", [prediction, target, w], outputs=2, reduction="mean"
        )
        e.dtypes[logp] = e.dtype(prediction)
        eps = self.label_smoothing
        total = self._total_weight(e, target, w, prediction)
        smooth = e.Div(self._weighted_sum(e, logp, w, prediction), total)
        per_class = e.Div(e.const(eps, like=prediction), self._num_classes(e, prediction))
        return e.Add(e.Mul(e.const(1.0 - eps, like=prediction), nll), e.Mul(per_class, smooth))

    @staticmethod
    def _weighted_sum(e: Emitter, logp: str, w: str | None, like: str) -> str:
        """sum_i sum_c w[c] (-logp[i, c]).

        w is reshaped to [C, 1, ..., 1] (rank(logp) - 2 ones, computed at run
        time) so that it broadcasts along the class axis of [N, C, d...]."""
        if w is not None:
            rank = e.Size(e.Shape(logp))
            spatial = e.unsqueeze(e.Sub(rank, e.scalar_int(2)), [0])
            ones = e.op("ConstantOfShape", [spatial], value=_int64_one())
            w = e.Reshape(w, e.Concat(e.ints([-1]), ones, axis=0))
            logp = e.Mul(logp, w)
        return e.Neg(e.reduce_sum(logp, None, keepdims=False))

    @staticmethod
    def _total_weight(e: Emitter, target: str, w: str | None, like: str) -> str:
        """sum_i w[t_i] (the number of targets without weights)."""
        if w is None:
            return e.Cast(e.Size(target), to=e.dtype(like))
        return e.reduce_sum(e.Gather(w, target, axis=0), None, keepdims=False)

    @staticmethod
    def _num_classes(e: Emitter, scores: str) -> str:
        """C = shape(scores)[1] as a 0-D float."""
        c = e.Gather(e.Shape(scores), e.scalar_int(1), axis=0)
        return e.Cast(c, to=e.dtype(scores))


def _int64_one() -> TensorProto:
    return numpy_helper.from_array(np.ones(1, dtype=np.int64))


@dataclass(frozen=True)
class CustomLoss(Loss):
    """A loss given as ``fn(emit, prediction, target) -> name of a scalar``.

    The target gets the prediction's element type and shape."""

    fn: Callable[[Emitter, str, str], str]
    task: str = REGRESSION

    def emit(self, e: Emitter, prediction: str, target: str) -> str:
        name = self.fn(e, prediction, target)
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"a loss callable must return the name of the loss tensor (a str), got {name!r}"
            )
        return name


#: The loss names ``training_model(loss=...)`` accepts.
LOSSES: dict[str, Callable[[], Loss]] = {
    "mse": MSE,
    "l1": L1,
    "huber": Huber,
    "cross_entropy": CrossEntropy,
    "bce_with_logits": BCEWithLogits,
    "nll": NLL,
}


def resolve(loss: str | Loss | Callable) -> Loss:
    """A Loss from a name, a Loss object or a callable."""
    if isinstance(loss, Loss):
        return loss
    if isinstance(loss, str):
        try:
            return LOSSES[loss]()
        except KeyError:
            raise ValueError(
                f"unknown loss {loss!r}; expected one of {sorted(LOSSES)}, a loss object "
                "(build.MSE(), build.CrossEntropy(...), ...) or a callable "
                "fn(emit, prediction, target) -> loss name"
            ) from None
    if callable(loss):
        return CustomLoss(fn=loss)
    raise TypeError(f"loss must be a name, a loss object or a callable, not {type(loss).__name__}")


def check_prediction_type(elem_type: int | None, name: str) -> None:
    """The prediction must be a floating-point tensor."""
    if elem_type is not None and elem_type not in FLOAT_TYPES:
        raise ValueError(
            f"output {name!r} has element type {TensorProto.DataType.Name(elem_type)}; a loss "
            "needs a floating-point prediction"
        )


__all__: Sequence[str] = [
    "Loss", "MSE", "L1", "Huber", "BCEWithLogits", "CrossEntropy", "NLL", "CustomLoss",
    "LOSSES", "resolve",
]
