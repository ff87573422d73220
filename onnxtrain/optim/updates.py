"""onnxtrain's update rules (``rules.update_rule``) and the scalars they share.

Each body is the per-tensor arithmetic, one standard op per line, in the
order and association the fused kernel (``kernels/optim_kernels.c``)
repeats: the association is part of the rule, since it decides the rounding.
gr is the gradient the rule is given (``WeightDecay``'s output where the
user asked for an L2 penalty).

============  =========================================================  ==================
rule          per tensor                                                  used by
============  =========================================================  ==================
SGD           p' = p - lr g                                              builder SGD, ORT SGD
WeightDecay   g' = nc x + g                                              L2 penalties (all)
Adam          m' = b1 m + c1 g;  v' = b2 v + c2 (g g);                   builder Adam/AdamW,
              p' = [p decay] - step (m' / (sqrt(v') + eps))              ORT AdamW
DecayAfter    p' = p - s p                                               ORT AdamW (s = lr wd)
SpecAdam      v' = alpha v + oma gr;  h' = beta h + (omb gr) gr;         spec Adam
              x' = [post] (x - (r v') / (sqrt(h') + eps))
AdamStepSize  r' = t > zero ? (r sqrt(one_h - beta^T)) / (one_v - alpha^T) : r   spec Adam (scalar)
Momentum      v' = alpha v + beta gr;  x' = x - r v'                     spec Momentum, builder SGD(momentum)
Nesterov      v' = alpha v + beta gr;  x' = x - r (gr + alpha2 v')       the same, nesterov
Adagrad       h' = h + gr gr;  x' = x - (r gr) / (sqrt(h') + eps)        spec Adagrad, builder Adagrad
TorchAdagrad  h' = h + g g;  p' = p - clr (g / (sqrt(h') + eps))         builder Adagrad (float64,
                                                                          attributes float32 cannot hold)
============  =========================================================  ==================

The scalars a rule needs are computed once per step by whoever applies it;
the computations two users share are here too: ``adam_step_size`` (the
bias-corrected step of torch's and ONNX Runtime's Adam).

>>> sorted(RULES)[:4]
['Adagrad', 'Adam', 'AdamStepSize', 'DecayAfter']
"""

from __future__ import annotations

from collections.abc import Mapping

from ..core.emitter import Emitter
from .rules import RULES, FusedKernel, update_rule

__all__ = ["RULES", "adam_step_size"]


@update_rule("SGD", scalars=("lr",), tensors=("p", "g"), outputs=("p_new",))
def sgd(e: Emitter, o: Mapping[str, str]) -> dict[str, str]:
    """p' = p - lr g."""
    return {"p_new": e.Sub(o["p"], e.Mul(o["lr"], o["g"]))}


@update_rule("WeightDecay", scalars=("nc",), tensors=("x", "g"), outputs=("g_new",))
def weight_decay(e: Emitter, o: Mapping[str, str]) -> dict[str, str]:
    """g' = nc x + g: the gradient of loss + nc/2 ||x||^2 (an L2 penalty)."""
    return {"g_new": e.Add(e.Mul(o["nc"], o["x"]), o["g"])}


@update_rule("Adam", scalars=("b1", "c1", "b2", "c2", "eps", "step", "decay"),
             tensors=("p", "g", "m", "v"), outputs=("p_new", "m_new", "v_new"), optional=("decay",),
             kernel=FusedKernel("AdamUpdate", ("b1", "c1", "b2", "c2", "eps", "step", "decay"),
                                defaults={"decay": 1.0}, tensors_first=True))
def adam(e: Emitter, o: Mapping[str, str]) -> dict[str, str]:
    """m' = b1 m + c1 g;  v' = b2 v + c2 (g g);  p' = [p decay] - step (m' / (sqrt(v') + eps)).

    With c1 = 1 - b1, c2 = 1 - b2: torch's Adam with step = lr sqrt(1 - b2^t) / (1 - b1^t)
    and eps = eps sqrt(1 - b2^t) (AdamW: decay = 1 - lr wd), or ONNX Runtime's
    AdamW with eps as given."""
    g = o["g"]
    p = e.Mul(o["p"], o["decay"]) if "decay" in o else o["p"]
    m_new = e.Add(e.Mul(o["b1"], o["m"]), e.Mul(o["c1"], g))
    v_new = e.Add(e.Mul(o["b2"], o["v"]), e.Mul(o["c2"], e.Mul(g, g)))
    denom = e.Add(e.Sqrt(v_new), o["eps"])
    p_new = e.Sub(p, e.Mul(o["step"], e.Div(m_new, denom)))
    return {"p_new": p_new, "m_new": m_new, "v_new": v_new}


@update_rule("DecayAfter", scalars=("s",), tensors=("p",), outputs=("p_new",))
def decay_after(e: Emitter, o: Mapping[str, str]) -> dict[str, str]:
    """p' = p - s p: weight decay after the update (ONNX Runtime's AdamW, s = lr wd)."""
    return {"p_new": e.Sub(o["p"], e.Mul(o["s"], o["p"]))}


#: The spec kernels add nc*x to the gradient themselves (``decay``).
_SPEC = dict(multi_tensor=True, decay="nc")


@update_rule("SpecAdam", scalars=("alpha", "oma", "beta", "omb", "eps", "r", "post"),
             tensors=("x", "g", "v", "h"), outputs=("x_new", "v_new", "h_new"), optional=("post",),
             kernel=FusedKernel("SpecAdam", ("alpha", "oma", "beta", "omb", "eps", "r", "nc", "post"), **_SPEC))
def spec_adam(e: Emitter, o: Mapping[str, str]) -> dict[str, str]:
    """The spec's Adam per tensor (oma = 1 - alpha, omb = 1 - beta, r the
    adjusted rate of ``AdamStepSize``, post = 1 - norm_coefficient_post):
    v' = alpha v + oma gr;  h' = beta h + (omb gr) gr;
    x' = x - (r v') / (sqrt(h') + eps), then x' = post x' where post is given."""
    gr = o["g"]
    v_new = e.Add(e.Mul(o["alpha"], o["v"]), e.Mul(o["oma"], gr))
    h_new = e.Add(e.Mul(o["beta"], o["h"]), e.Mul(e.Mul(o["omb"], gr), gr))
    h_sqrt = e.Add(e.Sqrt(h_new), o["eps"])
    x_new = e.Sub(o["x"], e.Div(e.Mul(o["r"], v_new), h_sqrt))
    if "post" in o:
        x_new = e.Mul(o["post"], x_new)
    return {"x_new": x_new, "v_new": v_new, "h_new": h_new}


@update_rule("AdamStepSize", scalars=("r", "t", "one_h", "beta", "one_v", "alpha", "zero"), tensors=(),
             outputs=("r_new",), integer=("t", "zero"),
             kernel=FusedKernel("AdamStepSize", ("r", "t", "one_h", "beta", "one_v", "alpha", "zero")))
def adam_step_size_rule(e: Emitter, o: Mapping[str, str]) -> dict[str, str]:
    """The spec Adam's rate, T = t as r's type:
    r' = t > zero ? (r sqrt(one_h - beta^T)) / (one_v - alpha^T) : r."""
    t = e.Cast(o["t"], to=e.dtype(o["r"]))
    sqrt_h_correction = e.Sqrt(e.Sub(o["one_h"], e.Pow(o["beta"], t)))
    v_correction = e.Sub(o["one_v"], e.Pow(o["alpha"], t))
    positive = e.Greater(o["t"], o["zero"])
    return {"r_new": e.Where(positive, e.Div(e.Mul(o["r"], sqrt_h_correction), v_correction), o["r"])}


@update_rule("Momentum", scalars=("alpha", "beta", "r"), tensors=("x", "g", "v"), outputs=("x_new", "v_new"),
             kernel=FusedKernel("Momentum", ("alpha", "beta", "r", "nc"), **_SPEC))
def momentum(e: Emitter, o: Mapping[str, str]) -> dict[str, str]:
    """v' = alpha v + beta gr;  x' = x - r v'."""
    v_new = e.Add(e.Mul(o["alpha"], o["v"]), e.Mul(o["beta"], o["g"]))
    return {"x_new": e.Sub(o["x"], e.Mul(o["r"], v_new)), "v_new": v_new}


@update_rule("Nesterov", scalars=("alpha", "beta", "alpha2", "r"), tensors=("x", "g", "v"),
             outputs=("x_new", "v_new"),
             kernel=FusedKernel("Nesterov", ("alpha", "beta", "alpha2", "r", "nc"), **_SPEC))
def nesterov(e: Emitter, o: Mapping[str, str]) -> dict[str, str]:
    """v' = alpha v + beta gr;  x' = x - r (gr + alpha2 v')."""
    gr = o["g"]
    v_new = e.Add(e.Mul(o["alpha"], o["v"]), e.Mul(o["beta"], gr))
    return {"x_new": e.Sub(o["x"], e.Mul(o["r"], e.Add(gr, e.Mul(o["alpha2"], v_new)))), "v_new": v_new}


@update_rule("Adagrad", scalars=("eps", "r"), tensors=("x", "g", "h"), outputs=("x_new", "h_new"),
             kernel=FusedKernel("Adagrad", ("eps", "r", "nc"), **_SPEC))
def adagrad(e: Emitter, o: Mapping[str, str]) -> dict[str, str]:
    """h' = h + gr gr;  x' = x - (r gr) / (sqrt(h') + eps)."""
    gr = o["g"]
    h_new = e.Add(o["h"], e.Mul(gr, gr))
    h_adaptive = e.Add(e.Sqrt(h_new), o["eps"])
    return {"x_new": e.Sub(o["x"], e.Div(e.Mul(o["r"], gr), h_adaptive)), "h_new": h_new}


@update_rule("TorchAdagrad", scalars=("eps", "clr"), tensors=("p", "g", "h"), outputs=("p_new", "h_new"))
def torch_adagrad(e: Emitter, o: Mapping[str, str]) -> dict[str, str]:
    """h' = h + g g;  p' = p - clr (g / (sqrt(h') + eps)): torch.optim.Adagrad's
    association (``Adagrad`` divides r g instead)."""
    g = o["g"]
    h_new = e.Add(o["h"], e.Mul(g, g))
    denom = e.Add(e.Sqrt(h_new), o["eps"])
    return {"p_new": e.Sub(o["p"], e.Mul(o["clr"], e.Div(g, denom))), "h_new": h_new}


# ------------------------------------------------------------------ shared scalars
def adam_step_size(e: Emitter, lr: str, t: str, b1: float, b2: float, et: int) -> tuple[str, str]:
    """(lr sqrt(1 - b2^t) / (1 - b1^t), sqrt(1 - b2^t)) in element type ``et``
    (``lr`` and ``t``, the update's number counted from 1, already of it):
    Adam's bias-corrected step, as torch (in float64) and ONNX Runtime (in the
    parameters' type) compute it."""
    bias1 = e.Sub(e.const(1.0, dtype=et), e.Pow(e.const(b1, dtype=et), t))
    bias2_sqrt = e.Sqrt(e.Sub(e.const(1.0, dtype=et), e.Pow(e.const(b2, dtype=et), t)))
    return e.Div(e.Mul(lr, bias2_sqrt), bias1), bias2_sqrt
