"""Losses for the builder: each appends ONNX nodes that compute one scalar.

Every loss follows the PyTorch definition with ``reduction="mean"`` (the
default of ``torch.nn.functional``).  With p the prediction and t the target:

- ``MSE``            mean((p - t)^2)
- ``L1``             mean(|p - t|)
- ``Huber(delta)``   mean(h(p - t)),  h(d) = d^2 / 2 if |d| < delta else delta (|d| - delta / 2)
- ``BCEWithLogits``  mean((1 - t) x + (1 + (pw - 1) t) softplus(-x)),  x = p, pw = pos_weight
- ``CrossEntropy``   logits p[N, C, d...] (or p[B, T, V] with the class axis last), class indices
                     t[N, d...] (t[B, T]); i runs over the targets that are not ``ignore_index``:
                     (1 - eps) * sum_i w[t_i] (-logp[i, t_i]) / sum_i w[t_i]
                     + eps / C * sum_i sum_c w[c] (-logp[i, c]) / sum_i w[t_i]
                     with logp = log_softmax(p, class axis), w = weight (ones without), eps = label_smoothing
- ``NLL``            p already log-probabilities: sum_i w[t_i] (-p[i, t_i]) / sum_i w[t_i]
                     (same class axis and ignore_index rules)

A loss object has three parts: ``target_type`` (the element type and shape
of the target input, given the prediction's), ``emit`` (the nodes) and
``task`` ("classification" or "regression", for the fit loop's metrics).
``for_model`` lets a loss settle what depends on the model before that
(the class axis of a cross-entropy).
A plain callable ``fn(emit, prediction, target) -> name`` becomes a
``CustomLoss`` whose target has the prediction's type.

>>> from onnxtrain.core.emitter import Emitter
>>> from onnxtrain.core.names import NameGen
>>> e = Emitter(opset=17, names=NameGen(["y", "t"]), dtypes={"y": 1, "t": 1}, hint="loss")
>>> name = MSE().emit(e, "y", "t")
>>> [n.op_type for n in e.nodes]
['Sub', 'Mul', 'ReduceMean']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ..core.emitter import FLOAT_TYPES, Emitter

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

    def for_model(self, graph: onnx.GraphProto, prediction: str, shape: Shape) -> "Loss":
        """This loss with what depends on the model decided (default: itself).

        ``graph`` is the main graph, ``prediction`` the output the loss reads
        and ``shape`` its inferred shape."""
        return self


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


#: Producers whose output has the class (feature) axis last: projections.
LAST_AXIS_OPS = {"MatMul", "Gemm", "Einsum", "MatMulInteger", "FusedMatMul", "QLinearMatMul"}
#: Producers whose output has the class (channel) axis 1.
CHANNEL_AXIS_OPS = {
    "Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "MaxPool", "AveragePool", "LpPool",
    "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool", "BatchNormalization",
    "InstanceNormalization", "Upsample", "Resize", "DepthToSpace", "SpaceToDepth",
}
#: Ops that keep the axis layout of their first computed input (followed backwards).
LAYOUT_KEEPING_OPS = {
    "Add", "Sub", "Mul", "Div", "Identity", "Cast", "Reshape", "Relu", "LeakyRelu", "Tanh",
    "Sigmoid", "Neg", "Dropout", "Clip", "Elu", "Selu", "Gelu", "Softplus", "Abs", "Max", "Min",
}


def _class_axis_from_structure(
    graph: onnx.GraphProto, prediction: str, rank: int | None
) -> tuple[int | None, str]:
    """(-1 or 1 or None, why) from the op producing the prediction.

    Follows layout-keeping ops (elementwise ops, Reshape, Cast, ...) back
    through their first input computed by a node; a projection (MatMul,
    Gemm, Einsum) puts the classes last, a convolution or pooling on axis 1,
    a (Log)Softmax on its ``axis`` (when that is 1 or the last axis)."""
    producer = {o: n for n in graph.node for o in n.output if o}
    name, seen = prediction, set()
    while name in producer and name not in seen:
        seen.add(name)
        node = producer[name]
        if node.op_type in ("LogSoftmax", "Softmax"):
            axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
            if rank is not None and axis == rank - 1:
                axis = -1
            if axis in (1, -1):
                return axis, f"it is computed by {node.op_type} node {node.name or node.op_type!r} over axis {axis}"
            return None, ""
        if node.op_type in LAST_AXIS_OPS:
            return -1, f"it is computed by {node.op_type} node {node.name or node.op_type!r}"
        if node.op_type in CHANNEL_AXIS_OPS:
            return 1, f"it is computed by {node.op_type} node {node.name or node.op_type!r}"
        if node.op_type not in LAYOUT_KEEPING_OPS:
            return None, ""
        computed = [i for i in node.input if i in producer]
        if not computed:
            return None, ""
        name = computed[0]
    return None, ""


def _class_axis_from_dims(shape: Shape) -> tuple[int | None, str]:
    """(-1 or 1 or None, why) from which of axis 1 and the last axis is a fixed size.

    Class counts are fixed; sequence and spatial lengths are usually
    symbolic: [batch, seq, 50257] has its classes last, [N, 10, h, w] on axis 1."""
    if shape is None or len(shape) < 3:
        return None, ""
    second, last = shape[1], shape[-1]
    fixed = lambda d: isinstance(d, int) and not isinstance(d, bool)  # noqa: E731
    if fixed(last) and not fixed(second):
        return -1, f"its last axis has a fixed size ({last}) and axis 1 does not ({second})"
    if fixed(second) and not fixed(last):
        return 1, f"axis 1 has a fixed size ({second}) and its last axis does not ({last})"
    return None, ""


def _class_axis_from_weight(weight: Any, shape: Shape) -> tuple[int | None, str]:
    """(-1 or 1 or None, why) from which axis the class weights' length matches."""
    if weight is None or shape is None or len(shape) < 3:
        return None, ""
    n = int(np.asarray(weight).size)
    second, last = shape[1] == n, shape[-1] == n
    if second and not last:
        return 1, f"the {n} class weights match axis 1"
    if last and not second:
        return -1, f"the {n} class weights match the last axis"
    return None, ""


def resolve_class_axis(
    loss_name: str, class_axis: Any, weight: Any, graph: onnx.GraphProto, prediction: str,
    shape: Shape,
) -> int:
    """1 or -1: the class axis of the scores ``prediction`` for ``loss_name``.

    - rank 2: axis 1 (which is also the last);
    - ``class_axis`` 1 or -1 (or rank - 1) as given;
    - "auto" and rank >= 3 (or an unknown rank): the evidence of the
      producing op (MatMul/Gemm/Einsum -> last, Conv/pooling -> 1, through
      elementwise ops and Reshape), of the fixed sizes (``[batch, seq, 50257]``
      -> last) and of the class weights' length must point one way;
      anything else raises a ValueError asking for ``class_axis``."""
    rank = None if shape is None else len(shape)
    if rank is not None and rank < 2:
        raise ValueError(
            f"{loss_name}: a class-index loss needs scores of rank >= 2 ([N, C, ...] or "
            f"[B, T, C]); the prediction {prediction!r} has shape {list(shape)}"
        )
    if class_axis != "auto":
        if isinstance(class_axis, bool) or not isinstance(class_axis, (int, np.integer)):
            raise ValueError(f"{loss_name}: class_axis must be 'auto', 1 or -1, got {class_axis!r}")
        axis = int(class_axis)
        if rank is not None and axis == rank - 1:
            axis = -1
        if axis not in (1, -1):
            raise ValueError(
                f"{loss_name}: class_axis must be 'auto', 1 or -1 (the last axis), got {class_axis!r}"
            )
        return 1 if rank == 2 else axis
    if rank == 2:
        return 1
    votes = [v for v in (_class_axis_from_structure(graph, prediction, rank),
                         _class_axis_from_dims(shape),
                         _class_axis_from_weight(weight, shape)) if v[0] is not None]
    axes = {axis for axis, _ in votes}
    if len(axes) == 1:
        return axes.pop()
    shown = "unknown" if shape is None else str(list(shape))
    if not votes:
        why = "nothing in the model tells whether the classes are on axis 1 or on the last axis"
    else:
        why = "; ".join(f"axis {'last' if a == -1 else 1} because {reason}" for a, reason in votes)
        why = f"the evidence disagrees ({why})"
    raise ValueError(
        f"{loss_name}: cannot tell the class axis of prediction {prediction!r} with shape {shown}: "
        f"{why}. Pass build.{loss_name}(class_axis=1) for scores [N, C, d...] or "
        f"build.{loss_name}(class_axis=-1) for scores [B, T, C] (classes last, as language "
        "models emit)"
    )


def check_classes(loss_name: str, prediction: str, shape: Shape, axis: int) -> None:
    """ValueError when the class axis of ``prediction`` holds one class: a
    softmax over one score is 1, so the loss is 0 whatever the weights (a
    regression or yes/no output)."""
    if shape is None or len(shape) < 2:
        return
    if shape[axis] == 1:
        raise ValueError(
            f"{loss_name}: the prediction {prediction!r} has shape {list(shape)}: one class, over "
            "which the loss is always 0 and nothing trains; use loss='mse' for a regression "
            "(float targets) or loss='bce_with_logits' for 0/1 targets"
        )


def _class_target(elem_type: int, shape: Shape, class_axis: Any = 1) -> tuple[int, Shape]:
    """int64 class indices shaped like the scores without their class axis."""
    if shape is None:
        return TensorProto.INT64, None
    if len(shape) < 2:
        raise ValueError(
            f"a class-index loss needs scores of rank >= 2 ([N, C, ...]), the prediction has "
            f"shape {list(shape)}"
        )
    if class_axis == -1:
        return TensorProto.INT64, tuple(shape[:-1])
    return TensorProto.INT64, (shape[0],) + tuple(shape[2:])


def _weight_const(e: Emitter, weight: Any, like: str) -> str | None:
    if weight is None:
        return None
    w = np.asarray(weight, dtype=np.float64)
    if w.ndim != 1:
        raise ValueError(f"class weights must be a 1-D array (one per class), got shape {list(w.shape)}")
    return e.const(w, like=like)


def _classes_last_flat(e: Emitter, scores: str, target: str) -> tuple[str, str]:
    """scores [d..., C] -> [M, C] and target [d...] -> [M]: the same positions,
    each a row, so a loss over axis 1 of the rows is the loss over the last axis."""
    classes = e.op("Slice", [e.Shape(scores), e.ints([-1]), e.ints([np.iinfo(np.int64).max])])
    rows = e.Reshape(scores, e.Concat(e.ints([-1]), classes, axis=0))
    labels = e.Reshape(target, e.ints([-1]))
    return rows, labels


def _check_ignore_index(loss_name: str, ignore_index: Any) -> None:
    if ignore_index is not None and (
        isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer))
    ):
        raise ValueError(f"{loss_name}: ignore_index must be an integer or None, got {ignore_index!r}")


def _check_decided(loss_name: str, class_axis: Any) -> None:
    if class_axis not in (1, -1):
        raise ValueError(
            f"{loss_name}: class_axis={class_axis!r} is decided by training_model (for_model); "
            "pass class_axis=1 or -1 to emit the loss directly"
        )


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True)
class NLL(Loss):
    """sum_i w[t_i] (-p[i, t_i]) / sum_i w[t_i] on log-probabilities p  (torch.nn.NLLLoss).

    i runs over the targets that are not ``ignore_index`` (default -100, as
    torch).  One NegativeLogLikelihoodLoss node with reduction "mean", whose
    weighted mean is the same as torch's.  ``class_axis``: 1 (scores
    [N, C, d...]), -1 (scores [B, T, C], flattened to rows) or "auto", as
    for ``CrossEntropy`` (a LogSoftmax producing the prediction tells its axis)."""

    weight: Any = None
    class_axis: Any = "auto"
    ignore_index: int | None = -100
    task = CLASSIFICATION

    def __post_init__(self) -> None:
        _check_ignore_index("NLL", self.ignore_index)

    def for_model(self, graph: onnx.GraphProto, prediction: str, shape: Shape) -> Loss:
        axis = resolve_class_axis("NLL", self.class_axis, self.weight, graph, prediction, shape)
        check_classes("nll", prediction, shape, axis)
        return replace(self, class_axis=axis)

    def target_type(self, elem_type: int, shape: Shape) -> tuple[int, Shape]:
        return _class_target(elem_type, shape, self.class_axis)

    def emit(self, e: Emitter, prediction: str, target: str) -> str:
        _check_decided("NLL", self.class_axis)
        w = _weight_const(e, self.weight, prediction)
        if self.class_axis == -1:
            prediction, target = _classes_last_flat(e, prediction, target)
        return e.NegativeLogLikelihoodLoss(
            prediction, target, w, reduction="mean", ignore_index=_int_or_none(self.ignore_index))


@dataclass(frozen=True)
class CrossEntropy(Loss):
    """Softmax cross-entropy on logits with class-index targets  (torch.nn.CrossEntropyLoss).

    With logp = log_softmax(p, class axis), w the class weights (ones
    without), eps = label_smoothing, C classes, and i running over the
    targets t_i that are not ``ignore_index`` (default -100, as torch and
    Hugging Face):

        nll    = sum_i w[t_i] (-logp[i, t_i]) / sum_i w[t_i]
        smooth = sum_i sum_c w[c] (-logp[i, c]) / sum_i w[t_i]
        loss   = (1 - eps) nll + eps / C * smooth

    (i runs over samples and sequence / spatial positions).  This is torch's
    weighted mean, label smoothing included; ignored positions contribute
    nothing to either sum (all of them ignored gives 0 / 0).  nll is a
    SoftmaxCrossEntropyLoss node; its log_prob output feeds the smoothing term.

    ``class_axis``: 1 for scores [N, C, d...] (torch's layout), -1 for
    scores [B, T, C] with targets [B, T] (language models), or "auto": axis 1
    for rank 2, else decided from the model (see ``resolve_class_axis``), a
    ValueError when the model does not tell.  Classes last are handled by
    flattening the scores to rows [B*T, C] and the targets to [B*T]."""

    label_smoothing: float = 0.0
    weight: Any = None
    class_axis: Any = "auto"
    ignore_index: int | None = -100
    task = CLASSIFICATION

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(
                f"CrossEntropy: label_smoothing must be in [0, 1], got {self.label_smoothing!r}"
            )
        _check_ignore_index("CrossEntropy", self.ignore_index)

    def for_model(self, graph: onnx.GraphProto, prediction: str, shape: Shape) -> Loss:
        axis = resolve_class_axis("CrossEntropy", self.class_axis, self.weight, graph, prediction,
                                  shape)
        check_classes("cross_entropy", prediction, shape, axis)
        return replace(self, class_axis=axis)

    def target_type(self, elem_type: int, shape: Shape) -> tuple[int, Shape]:
        return _class_target(elem_type, shape, self.class_axis)

    def emit(self, e: Emitter, prediction: str, target: str) -> str:
        _check_decided("CrossEntropy", self.class_axis)
        w = _weight_const(e, self.weight, prediction)
        if self.class_axis == -1:
            prediction, target = _classes_last_flat(e, prediction, target)
        ignore = _int_or_none(self.ignore_index)
        if self.label_smoothing == 0.0:
            return e.SoftmaxCrossEntropyLoss(prediction, target, w, reduction="mean",
                                             ignore_index=ignore)
        nll, logp = e.op(
            "SoftmaxCrossEntropyLoss", [prediction, target, w], outputs=2, reduction="mean",
            ignore_index=ignore,
        )
        e.dtypes[logp] = e.dtype(prediction)
        eps = self.label_smoothing
        kept, safe_target = self._kept(e, target, ignore, prediction)
        total = self._total_weight(e, safe_target, kept, w, prediction)
        smooth = e.Div(self._weighted_sum(e, logp, kept, w), total)
        per_class = e.Div(e.const(eps, like=prediction), self._num_classes(e, prediction))
        return e.Add(e.Mul(e.const(1.0 - eps, like=prediction), nll), e.Mul(per_class, smooth))

    @staticmethod
    def _kept(e: Emitter, target: str, ignore: int | None, like: str) -> tuple[str | None, str]:
        """(1.0 where t_i != ignore_index else 0.0, or None without ignore_index;
        the target with ignored entries replaced by class 0, safe to Gather with)."""
        if ignore is None:
            return None, target
        is_kept = e.Not(e.Equal(target, e.const(np.asarray(ignore, dtype=np.int64))))
        safe = e.Where(is_kept, target, e.const(np.asarray(0, dtype=np.int64)))
        return e.Cast(is_kept, to=e.dtype(like)), safe

    @staticmethod
    def _weighted_sum(e: Emitter, logp: str, kept: str | None, w: str | None) -> str:
        """sum_i kept_i sum_c w[c] (-logp[i, c]).

        kept gets a unit class axis; w is reshaped to [C, 1, ..., 1] (rank(logp) - 2 ones, computed at run
        time) so that it broadcasts along the class axis of [N, C, d...]."""
        if w is not None:
            rank = e.Size(e.Shape(logp))
            spatial = e.unsqueeze(e.Sub(rank, e.scalar_int(2)), [0])
            ones = e.op("ConstantOfShape", [spatial], value=_int64_one())
            w = e.Reshape(w, e.Concat(e.ints([-1]), ones, axis=0))
            logp = e.Mul(logp, w)
        if kept is not None:  # [N, d...] -> [N, 1, d...]: broadcast along the class axis
            logp = e.Mul(logp, e.unsqueeze(kept, [1]))
        return e.Neg(e.reduce_sum(logp, None, keepdims=False))

    @staticmethod
    def _total_weight(e: Emitter, target: str, kept: str | None, w: str | None, like: str) -> str:
        """sum_i w[t_i] over the kept targets (their number without weights)."""
        if w is None:
            if kept is None:
                return e.Cast(e.Size(target), to=e.dtype(like))
            return e.reduce_sum(kept, None, keepdims=False)
        weights = e.Gather(w, target, axis=0)
        if kept is not None:
            weights = e.Mul(weights, kept)
        return e.reduce_sum(weights, None, keepdims=False)

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
    "LOSSES", "resolve", "resolve_class_axis",
]
