"""Optimizers for the builder, with PyTorch's update rules (torch.optim).

Each optimizer appends the nodes of one update to an algorithm graph.  Its
inputs are the learning rate of this step (a 0-D float64 tensor: the base lr
times the schedule factor), the step counter (0-D int64: updates done so far,
0 at the first one), the parameters, their gradients and their state; it
returns the new parameters and the new state.  Optimizer state lives in
slots: one tensor per parameter and slot, named ``<param>.<slot>``.

Where a spec op of ``ai.onnx.preview.training`` computes exactly torch's
rule it is used (the runtime lowers it to the same update rules); where it
does not, the update rule of ``onnxtrain.optim.updates`` is applied directly:

=============================  ==============================  =========================
optimizer                      torch rule                       emitted as
=============================  ==============================  =========================
SGD(momentum=0)                p -= lr (g + wd p)               rule ``SGD``
SGD(momentum>0[, nesterov])    buf = m buf + g, ...             spec ``Momentum`` (*)
Adagrad                        clr = lr / (1 + (t-1) lr_decay)  spec ``Adagrad`` (*)
Adam / AdamW                   bias-corrected, eps outside      rule ``Adam``
=============================  ==============================  =========================

The L2 penalty ``g + wd p`` of SGD, Adagrad and Adam is the gradient
transform ``optim.transforms.add_decayed_weights`` (rule ``WeightDecay``).

(*) The spec ops hold their hyperparameters as float32 attributes.  That is
exact for float32 parameters (torch rounds them to float32 as well), and for
float64 parameters only when each value is a float32 number; otherwise the
float64 group gets the same rules directly (``spec_is_exact``; Adagrad then
takes torch's own association, rule ``TorchAdagrad``).

Scalar factors (bias corrections, learning rates) are computed in float64 and
cast once to each parameter's element type, as torch computes them in Python
floats.

>>> Adam(lr=1e-3).slots()
(('adam_m', 0.0), ('adam_v', 0.0))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from ..core.emitter import Emitter
from ..core.graph import PREVIEW_DOMAIN
from ..optim.rules import apply
from ..optim.transforms import add_decayed_weights
from ..optim.updates import adam_step_size

F64 = TensorProto.DOUBLE

#: (slot name, initial fill value) pairs.
Slots = tuple[tuple[str, float], ...]


class _ScalarCache:
    """One cast of each float64 scalar per element type (shared by all parameters)."""

    def __init__(self, e: Emitter) -> None:
        self.e = e
        self._cast: dict[tuple[str, int], str] = {}

    def as_type(self, scalar64: str, et: int) -> str:
        key = (scalar64, et)
        if key not in self._cast:
            self._cast[key] = self.e.cast_to(scalar64, et)
        return self._cast[key]


def _check_non_negative(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and value >= 0):
            raise ValueError(f"{owner}: {name} must be a number >= 0, got {value!r}")


class Optimizer:
    """One update of every trainable parameter (subclasses give the rule)."""

    lr: float

    def slots(self) -> Slots:
        """The per-parameter state tensors and their starting values."""
        return ()

    def update(
        self,
        e: Emitter,
        lr: str,
        step: str,
        params: Sequence[str],
        grads: Sequence[str],
        state: dict[str, list[str]],
    ) -> tuple[list[str], dict[str, list[str]]]:
        """Emit one step; return (new params, {slot: new state per param})."""
        raise NotImplementedError


def _by_element_type(e: Emitter, params: Sequence[str]) -> dict[int, list[int]]:
    """Parameter indices grouped by element type (one spec node per group)."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(e.dtype(p), []).append(i)
    return groups


def spec_is_exact(attrs: dict[str, object], et: int) -> bool:
    """Whether a spec optimizer node computes torch's rule exactly for element type ``et``.

    The spec's float attributes are float32.  float32 parameters compute with
    float32 hyperparameters in torch too; float64 ones need every value to be
    a float32 number (0.5 is, 0.9 is not)."""
    if et != TensorProto.DOUBLE:
        return True
    return all(float(np.float32(v)) == v for v in attrs.values() if isinstance(v, float))


#: One parameter group's update as rule calls where the spec op is not exact:
#: (emit, lr, step, params, grads, states, et) -> (new params, new states).
Direct = Callable[[Emitter, str, str, Sequence[str], Sequence[str], Sequence[str], int],
                  tuple[list[str], list[str]]]


def _spec_or_direct(
    e: Emitter,
    op_type: str,
    attrs: dict[str, object],
    direct: Direct,
    lr: str,
    step: str,
    params: Sequence[str],
    grads: Sequence[str],
    states: Sequence[str],
) -> tuple[list[str], list[str]]:
    """Per element type: one multi-tensor spec node
    ``op(R, T, X1..Xn, G1..Gn, S1..Sn) -> X1_new..Xn_new, S1_new..Sn_new``
    where it is exact (``spec_is_exact``), else ``direct``: the update rules
    with the hyperparameters in the parameters' own type."""
    new_params = [""] * len(params)
    new_states = [""] * len(params)
    cache = _ScalarCache(e)
    for et, idx in _by_element_type(e, params).items():
        if not spec_is_exact(attrs, et):
            outs = direct(e, lr, step, [params[i] for i in idx], [grads[i] for i in idx],
                          [states[i] for i in idx], et)
            for k, i in enumerate(idx):
                new_params[i], new_states[i] = outs[0][k], outs[1][k]
            continue
        inputs = [cache.as_type(lr, et), step]
        inputs += [params[i] for i in idx] + [grads[i] for i in idx] + [states[i] for i in idx]
        outs = e.op(op_type, inputs, outputs=2 * len(idx), domain=PREVIEW_DOMAIN, **attrs)
        for o in outs:
            e.dtypes[o] = et
        for k, i in enumerate(idx):
            new_params[i], new_states[i] = outs[k], outs[len(idx) + k]
    return new_params, new_states


@dataclass(frozen=True)
class SGD(Optimizer):
    """torch.optim.SGD (dampening 0).

    g' = g + wd p
    momentum = 0:  p -= lr g'                                   (rule ``SGD``)
    momentum > 0:  buf = g' at the first step, else m buf + g'
                   p -= lr buf            (nesterov: p -= lr (g' + m buf))
    The momentum case is exactly the spec ``Momentum`` op with alpha = m,
    beta = 1, norm_coefficient = wd and T = the step counter (beta is taken
    as 1 at T = 0, and buf starts at zero, so the first buf is g'), except
    for float64 parameters with an m or wd that float32 cannot hold, which
    get the same rules (``Momentum``/``Nesterov`` with beta = 1) directly."""

    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_non_negative("SGD", lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        if self.nesterov and self.momentum == 0:
            raise ValueError("SGD: nesterov=True needs momentum > 0 (as in torch.optim.SGD)")

    def slots(self) -> Slots:
        return (("momentum", 0.0),) if self.momentum else ()

    def update(self, e, lr, step, params, grads, state):
        if self.momentum:
            attrs = dict(alpha=float(self.momentum), beta=1.0, norm_coefficient=float(self.weight_decay),
                         mode="nesterov" if self.nesterov else "standard")
            new, bufs = _spec_or_direct(
                e, "Momentum", attrs, self._momentum_direct, lr, step, params, grads, state["momentum"]
            )
            return new, {"momentum": bufs}
        cache = _ScalarCache(e)
        grads = add_decayed_weights(e, params, grads, self.weight_decay)
        new = [apply(e, "SGD", {"lr": cache.as_type(lr, e.dtype(p)), "p": p, "g": g})["p_new"]
               for p, g in zip(params, grads)]
        return new, {}

    def _momentum_direct(self, e, lr, step, params, grads, bufs, et):
        """buf = m buf + 1 g' (buf starts at 0, so the first buf is g');
        p -= lr buf, or lr (g' + m buf) with nesterov."""
        grads = add_decayed_weights(e, params, grads, self.weight_decay)
        m = e.const(self.momentum, dtype=et)
        scalars = {"alpha": m, "beta": e.const(1.0, dtype=et), "r": e.cast_to(lr, et)}
        if self.nesterov:
            scalars["alpha2"] = m
        rule = "Nesterov" if self.nesterov else "Momentum"
        outs = [apply(e, rule, {**scalars, "x": p, "g": g, "v": buf}) for p, g, buf in zip(params, grads, bufs)]
        return [o["x_new"] for o in outs], [o["v_new"] for o in outs]


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """torch.optim.Adagrad.

    clr = lr / (1 + (t - 1) lr_decay)     (t = 1 at the first step)
    g' = g + wd p;  state_sum += g'^2;  p -= clr g' / (sqrt(state_sum) + eps)
    This is exactly the spec ``Adagrad`` op with T = t - 1 (the step counter),
    decay_factor = lr_decay, norm_coefficient = wd, epsilon = eps, and the
    state starting at initial_accumulator_value.  float64 parameters with
    values float32 cannot hold get torch's own association instead (rule
    ``TorchAdagrad``: clr (g' / (sqrt(state_sum) + eps)), clr in float64)."""

    lr: float
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        _check_non_negative(
            "Adagrad", lr=self.lr, lr_decay=self.lr_decay, weight_decay=self.weight_decay,
            eps=self.eps, initial_accumulator_value=self.initial_accumulator_value,
        )

    def slots(self) -> Slots:
        return (("adagrad_sum", float(self.initial_accumulator_value)),)

    def update(self, e, lr, step, params, grads, state):
        attrs = dict(decay_factor=float(self.lr_decay), epsilon=float(self.eps),
                     norm_coefficient=float(self.weight_decay))
        new, sums = _spec_or_direct(
            e, "Adagrad", attrs, self._direct, lr, step, params, grads, state["adagrad_sum"]
        )
        return new, {"adagrad_sum": sums}

    def _direct(self, e, lr, step, params, grads, sums, et):
        """clr = lr / (1 + step lr_decay) in float64; sum += g'^2; p -= clr (g' / (sqrt(sum) + eps))."""
        decayed = e.Mul(e.Cast(step, to=F64), e.const(self.lr_decay, dtype=F64))
        clr = e.cast_to(e.Div(lr, e.Add(e.const(1.0, dtype=F64), decayed)), et)
        grads = add_decayed_weights(e, params, grads, self.weight_decay)
        eps = e.const(self.eps, dtype=et)
        outs = [apply(e, "TorchAdagrad", {"eps": eps, "clr": clr, "p": p, "g": g, "h": h})
                for p, g, h in zip(params, grads, sums)]
        return [o["p_new"] for o in outs], [o["h_new"] for o in outs]


@dataclass(frozen=True)
class Adam(Optimizer):
    """torch.optim.Adam (amsgrad off), as the rule ``Adam``.

    t = step + 1;  g' = g + wd p
    m = b1 m + (1 - b1) g';  v = b2 v + (1 - b2) g'^2
    p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    emitted as p -= s * m / (sqrt(v) + e) with the scalars
    s = lr sqrt(1 - b2^t) / (1 - b1^t) and e = eps sqrt(1 - b2^t)
    (the same value; one pass over each parameter fewer).

    The spec ``Adam`` op adds eps to sqrt(v) before the bias correction and
    counts T from 0 without correcting the first step, so it differs from
    torch; this rule is emitted directly instead."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    #: Decoupled weight decay (AdamW) instead of L2 added to the gradient.
    decoupled = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check_non_negative(name, lr=self.lr, eps=self.eps, weight_decay=self.weight_decay)
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise ValueError(f"{name}: betas must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))

    def slots(self) -> Slots:
        return (("adam_m", 0.0), ("adam_v", 0.0))

    def update(self, e, lr, step, params, grads, state):
        b1, b2 = self.betas
        # Scalars, once for all parameters, in float64:
        # lr / bias1 * m / (sqrt(v) / bias2_sqrt + eps)
        #   = (lr * bias2_sqrt / bias1) * m / (sqrt(v) + eps * bias2_sqrt):
        # the bias corrections fold into two scalars (no pass over v for them)
        t = e.Cast(e.Add(step, e.scalar_int(1)), to=F64)
        step_size, bias2_sqrt = adam_step_size(e, lr, t, b1, b2, F64)
        eps_hat = e.Mul(e.const(self.eps, dtype=F64), bias2_sqrt)
        decay = None
        if self.decoupled and self.weight_decay:  # p *= 1 - lr wd
            decay = e.Sub(e.const(1.0, dtype=F64), e.Mul(lr, e.const(self.weight_decay, dtype=F64)))
        elif not self.decoupled:
            grads = add_decayed_weights(e, params, grads, self.weight_decay)
        cache = _ScalarCache(e)
        numbers: dict[int, dict[str, str | None]] = {}

        new, ms, vs = [], [], []
        for p, g, m, v in zip(params, grads, state["adam_m"], state["adam_v"]):
            et = e.dtype(p)
            if et not in numbers:
                numbers[et] = {
                    "b1": e.const(b1, dtype=et), "c1": e.const(1.0 - b1, dtype=et),
                    "b2": e.const(b2, dtype=et), "c2": e.const(1.0 - b2, dtype=et),
                    "eps": cache.as_type(eps_hat, et), "step": cache.as_type(step_size, et),
                    "decay": cache.as_type(decay, et) if decay is not None else None,
                }
            out = apply(e, "Adam", {**numbers[et], "p": p, "g": g, "m": m, "v": v})
            new.append(out["p_new"])
            ms.append(out["m_new"])
            vs.append(out["v_new"])
        return new, {"adam_m": ms, "adam_v": vs}


@dataclass(frozen=True)
class AdamW(Adam):
    """torch.optim.AdamW: Adam with decoupled weight decay, as the rule ``Adam``.

    p *= 1 - lr wd (before the update, with this step's lr), then Adam's
    update with the raw gradient."""

    weight_decay: float = 1e-2
    decoupled = True


def resolve(optimizer: Optimizer) -> Optimizer:
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            "optimizer must be build.SGD(...), build.Adagrad(...), build.Adam(...) or "
            f"build.AdamW(...), not {type(optimizer).__name__}"
        )
    return optimizer
