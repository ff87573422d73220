"""Numpy references of the ``ai.onnx.preview.training`` optimizers: the test oracle.

Each function follows the pseudo-code of the ONNX spec line by line (the
comments quote it) for n tensors at once, and returns the new state
explicitly, like optax's ``update``.

Arithmetic happens in the element type of X.  The attributes, R and T are
converted to that type first: R may be float while X is double, and T (int64)
only enters through powers and products, where it counts iterations.  The
condition ``T > 0`` is decided on the integer T itself.

>>> import numpy as np
>>> xs, hs = adagrad(np.float32(0.1), np.int64(0), [np.ones(2, np.float32)],
...                  [np.ones(2, np.float32)], [np.zeros(2, np.float32)])
>>> xs[0].dtype, bool(np.allclose(xs[0], 0.9))
(dtype('float32'), True)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MOMENTUM_MODES = ("standard", "nesterov")


def adam(
    r,
    t,
    xs: Sequence[np.ndarray],
    gs: Sequence[np.ndarray],
    vs: Sequence[np.ndarray],
    hs: Sequence[np.ndarray],
    *,
    alpha: float = 0.9,
    beta: float = 0.999,
    epsilon: float = 1e-6,
    norm_coefficient: float = 0.0,
    norm_coefficient_post: float = 0.0,
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """One Adam step for every tensor: returns (xs_new, vs_new, hs_new)."""
    _check_lengths("adam", xs=xs, gs=gs, vs=vs, hs=hs)
    xs_new, vs_new, hs_new = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs):
        x, g, v, h = _as_arrays(x, g, v, h)
        c = x.dtype.type  # every constant in X's element type
        R, T = _step_inputs(r, t, x.dtype)

        # G_regularized = norm_coefficient * X + G
        g_regularized = c(norm_coefficient) * x + g
        # V_new = alpha * V + (1 - alpha) * G_regularized
        v_new = c(alpha) * v + (c(1) - c(alpha)) * g_regularized
        # H_new = beta * H + (1 - beta) * G_regularized * G_regularized
        h_new = c(beta) * h + (c(1) - c(beta)) * g_regularized * g_regularized
        # H_sqrt = Sqrt(H_new) + epsilon
        h_sqrt = np.sqrt(h_new) + c(epsilon)
        # R_adjusted = T > 0 ? R * Sqrt(1 - beta**T) / (1 - alpha**T) : R
        if np.asarray(t) > 0:
            r_adjusted = R * np.sqrt(c(1) - c(beta) ** T) / (c(1) - c(alpha) ** T)
        else:
            r_adjusted = R
        # X_new = X - R_adjusted * V_new / H_sqrt
        x_new = x - r_adjusted * v_new / h_sqrt
        # X_final = (1 - norm_coefficient_post) * X_new
        x_final = (c(1) - c(norm_coefficient_post)) * x_new

        xs_new.append(_like(x_final, x))
        vs_new.append(_like(v_new, x))
        hs_new.append(_like(h_new, x))
    return xs_new, vs_new, hs_new


def momentum(
    r,
    t,
    xs: Sequence[np.ndarray],
    gs: Sequence[np.ndarray],
    vs: Sequence[np.ndarray],
    *,
    alpha: float,
    beta: float,
    mode: str,
    norm_coefficient: float,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One step of SGD with standard or Nesterov momentum: returns (xs_new, vs_new)."""
    _check_lengths("momentum", xs=xs, gs=gs, vs=vs)
    if mode not in MOMENTUM_MODES:
        raise ValueError(f"momentum: mode must be 'standard' or 'nesterov', got {mode!r}")
    xs_new, vs_new = [], []
    for x, g, v in zip(xs, gs, vs):
        x, g, v = _as_arrays(x, g, v)
        c = x.dtype.type
        R, _ = _step_inputs(r, t, x.dtype)

        # G_regularized = norm_coefficient * X + G
        g_regularized = c(norm_coefficient) * x + g
        # beta_adjusted = T > 0 ? beta : 1
        beta_adjusted = c(beta) if np.asarray(t) > 0 else c(1)
        # V_new = alpha * V + beta_adjusted * G_regularized
        v_new = c(alpha) * v + beta_adjusted * g_regularized
        if mode == "standard":
            # X_new = X - R * V_new
            x_new = x - R * v_new
        else:
            # X_new = X - R * (G_regularized + alpha * V_new)
            x_new = x - R * (g_regularized + c(alpha) * v_new)

        xs_new.append(_like(x_new, x))
        vs_new.append(_like(v_new, x))
    return xs_new, vs_new


def adagrad(
    r,
    t,
    xs: Sequence[np.ndarray],
    gs: Sequence[np.ndarray],
    hs: Sequence[np.ndarray],
    *,
    decay_factor: float = 0.0,
    epsilon: float = 1e-6,
    norm_coefficient: float = 0.0,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One Adagrad step for every tensor: returns (xs_new, hs_new)."""
    _check_lengths("adagrad", xs=xs, gs=gs, hs=hs)
    xs_new, hs_new = [], []
    for x, g, h in zip(xs, gs, hs):
        x, g, h = _as_arrays(x, g, h)
        c = x.dtype.type
        R, T = _step_inputs(r, t, x.dtype)

        # r = R / (1 + T * decay_factor)
        r_decayed = R / (c(1) + T * c(decay_factor))
        # G_regularized = norm_coefficient * X + G
        g_regularized = c(norm_coefficient) * x + g
        # H_new = H + G_regularized * G_regularized
        h_new = h + g_regularized * g_regularized
        # H_adaptive = Sqrt(H_new) + epsilon
        h_adaptive = np.sqrt(h_new) + c(epsilon)
        # X_new = X - r * G_regularized / H_adaptive
        x_new = x - r_decayed * g_regularized / h_adaptive

        xs_new.append(_like(x_new, x))
        hs_new.append(_like(h_new, x))
    return xs_new, hs_new


# ----------------------------------------------------------------- helpers
def _check_lengths(op: str, **lists: Sequence[np.ndarray]) -> None:
    lengths = {name: len(items) for name, items in lists.items()}
    if len(set(lengths.values())) != 1 or 0 in lengths.values():
        raise ValueError(f"{op}: expected equally long, non-empty lists, got lengths {lengths}")


def _as_arrays(x, *state) -> tuple[np.ndarray, ...]:
    """X fixes the element type; the other per-tensor inputs must share it."""
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float64):
        raise ValueError(f"X must be float32 or float64, got {x.dtype}")
    return (x, *(np.asarray(s, dtype=x.dtype) for s in state))


def _step_inputs(r, t, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """R and T converted to X's element type (T as a count, for powers and products)."""
    return np.asarray(r).astype(dtype), np.asarray(t).astype(dtype)


def _like(value, x: np.ndarray) -> np.ndarray:
    """The result as an array of X's type (0-D results of 0-D inputs stay 0-D)."""
    return np.asarray(value, dtype=x.dtype)
