"""Gradient transforms every optimizer front-end shares: global-norm
clipping and the L2 weight-decay penalty.

Each takes the gradients (and what else it needs) and returns new ones; a
front-end chains them before an update rule (``builder.transforms``, and
``ort_training/standard_model.py``).

>>> from onnxtrain.core.emitter import Emitter
>>> from onnxtrain.core.names import NameGen
>>> e = Emitter(17, NameGen(["g1", "g2", "c"]), {"g1": 1, "g2": 1, "c": 11})
>>> clipped = clip_by_global_norm(e, ["g1", "g2"], "c", 11)
>>> [n.op_type for n in e.nodes if n.op_type != "Constant"][:6]
['ReduceSumSquare', 'Cast', 'ReduceSumSquare', 'Cast', 'Add', 'Sqrt']
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.emitter import Emitter
from .rules import apply

#: Added to the norm before dividing (torch.nn.utils.clip_grad_norm_'s 1e-6).
CLIP_EPS = 1e-6


def clip_by_global_norm(e: Emitter, grads: Sequence[str], max_norm: str, dtype: int) -> list[str]:
    """g *= min(1, c / (||g||_2 + 1e-6)), the norm over all gradients
    (torch.nn.utils.clip_grad_norm_), with c the 0-D tensor ``max_norm``.

    The squares are summed, and the coefficient computed, in element type
    ``dtype`` (the builder: float64; ONNX Runtime training: the parameters'),
    then cast to each gradient's type."""
    squares = [e.cast_to(e.reduce("ReduceSumSquare", g, None, keepdims=False), dtype) for g in grads]
    norm = e.Sqrt(e.sum_all(squares))
    coef = e.Div(max_norm, e.Add(norm, e.const(CLIP_EPS, dtype=dtype)))
    coef = e.Min(coef, e.const(1.0, dtype=dtype))
    return [e.Mul(g, e.cast_to(coef, e.dtype(g))) for g in grads]


def add_decayed_weights(e: Emitter, params: Sequence[str], grads: Sequence[str],
                        weight_decay: float) -> list[str]:
    """g' = g + wd p for every parameter (an L2 penalty wd/2 ||p||^2 folded
    into the gradient, as torch's ``weight_decay`` of SGD, Adagrad and Adam
    does): one ``WeightDecay`` call each, none where wd = 0."""
    if not weight_decay:
        return list(grads)
    coefficients: dict[int, str] = {}  # one Constant per element type
    out = []
    for p, g in zip(params, grads):
        et = e.dtype(p)
        if et not in coefficients:
            coefficients[et] = e.const(weight_decay, dtype=et)
        out.append(apply(e, "WeightDecay", {"nc": coefficients[et], "x": p, "g": g})["g_new"])
    return out
