"""Gradient rules: the ``ai.onnx.ml`` domain (scikit-learn models via skl2onnx).

The coefficients of these ops are attributes, so the only gradient a rule
gives is the one of the float input X (or of each input, for
FeatureVectorizer).  Every rule emits default-domain ops only.

The rules follow what onnxruntime computes, which the ONNX spec leaves open
in places (checked against onnxruntime 1.31):

- Most ops compute in float32 whatever X's element type (their output is
  tensor(float)); the gradient is cast back to X's type.  Imputer and
  ArrayFeatureExtractor keep X's type.
- ``post_transform`` of a score vector s is applied row by row: LOGISTIC
  z = sigmoid(s), SOFTMAX z = softmax(s), SOFTMAX_ZERO the softmax over the
  entries with s != 0 (the others are 0), PROBIT z = sqrt(2) erfinv(2 s - 1).
  The VJPs read the forward output z (see ``_post_transform_vjp``).
- A binary classifier with a single score column s (LinearClassifier with one
  intercept, SVMClassifier SVC with two classes) writes two columns
  [a(s), t(s)]: LinearClassifier [1 - t, t] with t = sigmoid(s) for LOGISTIC,
  else t = s; SVMClassifier [-s, s] for NONE, [1 - sigmoid(s), sigmoid(s)]
  for LOGISTIC and [1 - s, s] for SOFTMAX(_ZERO).  In every case
  ds = (dz_1 - dz_0) t'(s).  PROBIT there is refused: onnxruntime's output
  does not follow the formula.
- LinearRegressor with one target applies only PROBIT; SVMRegressor ignores
  post_transform.

Ops whose outputs are discrete or piecewise constant in X (trees, Binarizer,
encoders) are registered with ``no_grad``; ops on maps (ZipMap,
DictVectorizer, CastMap) are refused.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, numpy_helper

from ...errors import GradientError
from ..registry import VJPContext, no_grad, refuse, vjp

ML = "ai.onnx.ml"
FLOAT = TensorProto.FLOAT


# ----------------------------------------------------------------- helpers


def _where(ctx: VJPContext) -> str:
    return f"{ctx.node.op_type} node {ctx.node.name!r}"


def _zero_tensor():
    """The ``value`` of a float32 ConstantOfShape of zeros."""
    return numpy_helper.from_array(np.zeros(1, dtype=np.float32))


def _f32(ctx: VJPContext, value) -> str:
    """A float32 Constant (the ml ops compute and output float32)."""
    return ctx.const(np.asarray(value, dtype=np.float32))


def _as_float(ctx: VJPContext, x: str) -> str:
    """X as the op reads it: converted to float32."""
    return ctx.emit.cast_to(x, FLOAT)


def _back_to(ctx: VJPContext, dx: str, x: str) -> str:
    """Give the float32 gradient the element type of the input ``x``."""
    et = ctx.emit.dtypes.get(x)
    if et is not None:
        return ctx.emit.cast_to(dx, et)
    if ctx.opset >= 15:
        return ctx.emit.CastLike(dx, x)
    return dx


def _reshape_like(ctx: VJPContext, dx: str, x: str) -> str:
    """The [N, C] gradient dx reshaped like x: a 1-D x ([C]) is read as one row."""
    if ctx.rank(x) == 2:
        return dx
    return ctx.emit.Reshape(dx, ctx.emit.Shape(x))


def _last(ctx: VJPContext, x: str, op: str, keepdims: bool = True) -> str:
    """A reduction over the last axis (the features of each row)."""
    return ctx.emit.reduce(op, x, [-1], keepdims)


def _columns(ctx: VJPContext, t: str, start: int, end: int) -> str:
    """t[:, start:end] of a 2-D tensor."""
    return ctx.emit.slice(t, [start], [end], [1])


def _coefficient_matrix(ctx: VJPContext, x: str, flat: list[float], rows: int) -> str:
    """The float32 [rows, C] matrix of a row-major coefficient list.

    onnxruntime reads the first rows * C coefficients, where C is the number
    of features of X.  With C known statically this is a Constant; otherwise
    the slice is taken at run time."""
    coef = np.asarray(flat, dtype=np.float32)
    shape = ctx.shape(x)
    c = shape[-1] if shape else None
    if isinstance(c, int) and c > 0:
        if coef.size < rows * c:
            raise GradientError(
                f"{_where(ctx)}: {coef.size} coefficients for {rows} rows of {c} features"
            )
        return _f32(ctx, coef[: rows * c].reshape(rows, c))
    if coef.size % rows == 0 and ctx.opset < 10:
        return _f32(ctx, coef.reshape(rows, -1))
    e = ctx.emit
    n = e.Mul(e.dim(x, -1), e.ints([rows]))
    return e.reshape(e.slice(_f32(ctx, coef), [0], n, [0]), [rows, -1])


def _post_transform_vjp(ctx: VJPContext, dz: str, z: str, transform: str) -> str:
    """ds for z = T(s) applied row by row, from the forward output z:

    NONE          z = s                      ds = dz
    LOGISTIC      z = 1 / (1 + exp(-s))      ds = dz z (1 - z)
    SOFTMAX       z = exp(s) / sum exp(s)    ds = z (dz - sum_j dz_j z_j)
    SOFTMAX_ZERO  as SOFTMAX over s_j != 0,  ds = z (dz - sum_j dz_j z_j)
                  z_j = 0 elsewhere          (0 there: z_j = 0)
    PROBIT        z = sqrt(2) erfinv(2s - 1) ds = dz sqrt(2 pi) exp(z^2 / 2)
    """
    e = ctx.emit
    if transform == "NONE":
        return dz
    if transform == "LOGISTIC":
        return e.Mul(dz, e.Mul(z, e.Sub(_f32(ctx, 1.0), z)))
    if transform in ("SOFTMAX", "SOFTMAX_ZERO"):
        inner = _last(ctx, e.Mul(dz, z), "ReduceSum")
        return e.Mul(z, e.Sub(dz, inner))
    if transform == "PROBIT":
        half_sq = e.Mul(e.Mul(z, z), _f32(ctx, 0.5))
        return e.Mul(dz, e.Mul(e.Exp(half_sq), _f32(ctx, math.sqrt(2.0 * math.pi))))
    raise GradientError(f"{_where(ctx)}: unknown post_transform {transform!r}")


def _binary_vjp(ctx: VJPContext, dz: str, z: str, logistic: bool) -> str:
    """ds for the two-column scores [a(s), t(s)] of a binary classifier, where
    a(s) = 1 - t(s) or -t(s) and t(s) = sigmoid(s) (LOGISTIC) or s:

        ds = (dz_1 - dz_0) t'(s),   t' = z_1 (1 - z_1) for LOGISTIC, else 1
    """
    e = ctx.emit
    ds = e.Sub(_columns(ctx, dz, 1, 2), _columns(ctx, dz, 0, 1))
    if logistic:
        z1 = _columns(ctx, z, 1, 2)
        ds = e.Mul(ds, e.Mul(z1, e.Sub(_f32(ctx, 1.0), z1)))
    return ds


# ------------------------------------------------------------ preprocessing


@vjp("Scaler", domain=ML)
def scaler_vjp(ctx, dy):
    """y = (x - offset) * scale  ->  dx = dy * scale

    scale has one entry or one per feature.  onnxruntime pairs element i of the
    flattened X with scale[i mod len(scale)], which for 1-D and 2-D X is the
    broadcast along the last axis; other ranks go through a [-1, len] view."""
    (x,) = ctx.inputs[:1]
    if not ctx.needs(0):
        return (None,)
    e = ctx.emit
    scale = np.asarray(ctx.attr("scale", [1.0]), dtype=np.float32)
    if scale.size == 1:
        dx = e.Mul(dy, _f32(ctx, scale.reshape(())))
    elif ctx.rank(x) in (1, 2):
        dx = e.Mul(dy, _f32(ctx, scale))
    else:
        dx = e.Mul(e.reshape(dy, [-1, scale.size]), _f32(ctx, scale))
        dx = e.Reshape(dx, e.Shape(x))
    return (_back_to(ctx, dx, x),)


@vjp("Normalizer", domain=ML)
def normalizer_vjp(ctx, dy):
    """Each row (X is [C] or [N, C]) divided by its norm n, y = x / n:

    MAX  n = max_j x_j (signed)  dx = dy / n - h sum_j(dy_j y_j) / n,
                                 h = [x == n] / #{j : x_j = n}  (ties share)
    L1   n = sum_j |x_j|         dx = (dy - sign(x) sum_j(dy_j y_j)) / n
    L2   n = sqrt(sum_j x_j^2)   dx = (dy - y sum_j(dy_j y_j)) / n

    Where n = 0 onnxruntime copies the row (y = x), so there dx = dy."""
    (x,) = ctx.inputs[:1]
    (y,) = ctx.outputs[:1]
    if not ctx.needs(0):
        return (None,)
    e = ctx.emit
    xf = _as_float(ctx, x)
    norm = ctx.attr("norm", "MAX")
    if norm == "MAX":
        n = _last(ctx, xf, "ReduceMax")
    elif norm == "L1":
        n = _last(ctx, e.Abs(xf), "ReduceSum")
    elif norm == "L2":
        n = e.Sqrt(_last(ctx, e.Mul(xf, xf), "ReduceSum"))
    else:
        raise GradientError(f"{_where(ctx)}: unknown norm {norm!r}")
    zero = ctx.emit.float_equal(n, _f32(ctx, 0.0))
    safe = e.Where(zero, _f32(ctx, 1.0), n)
    dot = _last(ctx, e.Mul(dy, y), "ReduceSum")
    if norm == "MAX":
        hits = e.Cast(ctx.emit.float_equal(xf, n), to=FLOAT)
        share = e.Div(hits, _last(ctx, hits, "ReduceSum"))
        corr = e.Where(zero, _f32(ctx, 0.0), e.Div(dot, safe))
        dx = e.Sub(e.Div(dy, safe), e.Mul(share, corr))
    else:
        # At n = 0 the row is all zeros, so y = 0, dot = 0 and dx = dy.
        direction = e.sign(xf) if norm == "L1" else y
        dx = e.Div(e.Sub(dy, e.Mul(direction, dot)), safe)
    return (_back_to(ctx, dx, x),)


@vjp("Imputer", domain=ML)
def imputer_vjp(ctx, dy):
    """y = x where x != replaced_value (NaN: where x is not NaN), else the
    imputed constant  ->  dx = dy where x was kept, 0 where it was replaced."""
    (x,) = ctx.inputs[:1]
    if not ctx.needs(0):
        return (None,)
    e = ctx.emit
    replaced = float(ctx.attr("replaced_value_float", 0.0))
    if math.isnan(replaced):
        kept = e.Not(e.IsNaN(x))
    else:
        kept = e.Not(ctx.emit.float_equal(x, ctx.const(replaced, like=x)))
    return (e.Where(kept, dy, ctx.const(0.0, like=x)),)


def _flat_width(shape) -> int | None:
    """Columns of x viewed as [N, F] (a 1-D x as [1, F]), when known statically."""
    if not shape:
        return None
    rest = shape[1:] if len(shape) >= 2 else shape
    if all(isinstance(d, int) for d in rest):
        return int(np.prod(rest))
    return None


@vjp("FeatureVectorizer", domain=ML)
def feature_vectorizer_vjp(ctx, dy):
    """y = [x_1' | x_2' | ... ] along axis 1, where x_i' is input i viewed as
    [N, F_i] (a 1-D input as [1, F_i]) cut or zero-padded to inputdimensions[i]
    = d_i columns  ->  dx_i = dy[:, o_i : o_i + d_i] cut or zero-padded back to
    F_i columns, reshaped like x_i  (o_i = d_1 + ... + d_{i-1})."""
    e = ctx.emit
    dims = [int(d) for d in ctx.attr("inputdimensions", [])]
    if len(dims) != len(ctx.inputs):
        raise GradientError(
            f"{_where(ctx)}: inputdimensions has {len(dims)} entries for {len(ctx.inputs)} inputs"
        )
    grads: list[str | None] = []
    offset = 0
    for i, (x, d) in enumerate(zip(ctx.inputs, dims)):
        start, offset = offset, offset + d
        if not ctx.needs(i):
            grads.append(None)
            continue
        piece = _columns(ctx, dy, start, start + d)
        width = _flat_width(ctx.shape(x))
        if width is not None:
            if width <= d:
                piece = _columns(ctx, piece, 0, width)
            else:
                rows = e.dim(dy, 0)
                zeros = e.op(
                    "ConstantOfShape",
                    [e.Concat(rows, e.ints([width - d]), axis=0)],
                    value=_zero_tensor(),
                )
                piece = e.Concat(piece, zeros, axis=1)
        else:
            # F_i = size(x_i) / rows at run time; pad with F_i zero columns
            # (always enough), then keep the first F_i columns.
            rows = e.dim(dy, 0)
            width_t = e.Div(e.reshape(e.Size(x), [1]), rows)
            zeros = e.op(
                "ConstantOfShape", [e.Concat(rows, width_t, axis=0)], value=_zero_tensor()
            )
            piece = e.slice(e.Concat(piece, zeros, axis=1), [0], width_t, [1])
        grads.append(_back_to(ctx, e.Reshape(piece, e.Shape(x)), x))
    return tuple(grads)


@vjp("ArrayFeatureExtractor", domain=ML)
def array_feature_extractor_vjp(ctx, dz):
    """z = x[..., idx] (idx flattened; a 1-D x gives [1, k])  ->
    dx = dz @ onehot(idx, C), reshaped like x: each picked column receives its
    gradient, summed where idx repeats a column."""
    x, idx = ctx.inputs[:2]
    if not ctx.needs(0):
        return None, None
    e = ctx.emit
    flat = e.reshape(idx, [-1])
    onehot = e.OneHot(flat, e.dim(x, -1), e.ints([0, 1]), axis=-1)
    et = e.dtypes.get(x)
    if et is not None:
        onehot = e.Cast(onehot, to=et)
    elif ctx.opset >= 15:
        onehot = e.CastLike(onehot, dz)
    else:
        raise GradientError(f"{_where(ctx)}: the element type of {x!r} is unknown")
    dx = e.MatMul(dz, onehot)
    return e.Reshape(dx, e.Shape(x)), None


# ----------------------------------------------------------- linear models


@vjp("LinearRegressor", domain=ML)
def linear_regressor_vjp(ctx, dy):
    """s = x W^T + intercepts (W: targets x C), y = post_transform(s)  ->
    ds = see ``_post_transform_vjp`` (one target: only PROBIT applies),
    dx = ds W."""
    (x,) = ctx.inputs[:1]
    (y,) = ctx.outputs[:1]
    if not ctx.needs(0):
        return (None,)
    targets = int(ctx.attr("targets", 1))
    transform = ctx.attr("post_transform", "NONE")
    if targets == 1 and transform != "PROBIT":
        transform = "NONE"  # onnxruntime applies nothing else to a single score
    ds = _post_transform_vjp(ctx, dy, y, transform)
    w = _coefficient_matrix(ctx, x, ctx.attr("coefficients", []), targets)
    dx = ctx.emit.MatMul(ds, w)
    return (_back_to(ctx, _reshape_like(ctx, dx, x), x),)


@vjp("LinearClassifier", domain=ML)
def linear_classifier_vjp(ctx, dlabel, dz=None):
    """Scores: s = x W^T + intercepts (W: E x C, E = number of intercepts),
    z = post_transform(s)  ->  dx = ds W, with ds from ``_post_transform_vjp``.

    E = 1 (binary) writes z = [1 - t(s), t(s)] with t = sigmoid for LOGISTIC,
    else t(s) = s: ds from ``_binary_vjp``.  The labels carry no gradient."""
    (x,) = ctx.inputs[:1]
    z = ctx.outputs[1] if len(ctx.outputs) > 1 else ""
    if not ctx.needs(0):
        return (None,)
    if dz is None:  # only the (discrete) labels were reached
        return (ctx.zeros_like(x),)
    transform = ctx.attr("post_transform", "NONE")
    intercepts = ctx.attr("intercepts") or []
    labels = ctx.attr("classlabels_ints") or ctx.attr("classlabels_strings") or []
    rows = len(intercepts) or len(labels)
    if rows == 1:
        if transform == "PROBIT":
            raise GradientError(
                f"{_where(ctx)}: binary scores with post_transform PROBIT are not "
                "differentiable here (onnxruntime's two score columns do not follow "
                "the probit of the single score)"
            )
        ds = _binary_vjp(ctx, dz, z, logistic=transform == "LOGISTIC")
    else:
        ds = _post_transform_vjp(ctx, dz, z, transform)
    w = _coefficient_matrix(ctx, x, ctx.attr("coefficients", []), rows)
    dx = ctx.emit.MatMul(ds, w)
    return (_back_to(ctx, _reshape_like(ctx, dx, x), x),)


# --------------------------------------------------------------------- SVMs


def _kernel_params(ctx: VJPContext) -> tuple[str, float, float, float]:
    params = list(ctx.attr("kernel_params", []) or []) + [0.0, 0.0, 0.0]
    kernel = ctx.attr("kernel_type", "LINEAR")
    if kernel not in ("LINEAR", "POLY", "RBF", "SIGMOID"):
        raise GradientError(f"{_where(ctx)}: unknown kernel_type {kernel!r}")
    return kernel, float(params[0]), float(params[1]), float(params[2])


def _support_vectors(ctx: VJPContext, count: int) -> np.ndarray:
    sv = np.asarray(ctx.attr("support_vectors", []), dtype=np.float32)
    if count <= 0 or sv.size % count:
        raise GradientError(
            f"{_where(ctx)}: {sv.size} support vector entries for {count} support vectors"
        )
    return sv.reshape(count, -1)


def _kernel_vjp(ctx: VJPContext, dk: str, x: str, sv: np.ndarray) -> str:
    """dx (shaped like x) from dK for K_ns = k(x_n, v_s), v = support vectors,
    G = x V^T, D_ns = |x_n - v_s|^2, (gamma, c0, d) = kernel_params:

    LINEAR   K = G                    dx = dK V
    POLY     K = (gamma G + c0)^d     dx = (dK d gamma (gamma G + c0)^(d-1)) V
    SIGMOID  K = tanh(gamma G + c0)   dx = (dK gamma (1 - K^2)) V
    RBF      K = exp(-gamma D)        dx = 2 (rowsum(W) x - W V),  W = -gamma dK K

    K is recomputed from x (the op outputs only the weighted sum)."""
    e = ctx.emit
    kernel, gamma, coef0, degree = _kernel_params(ctx)
    xf = e.reshape(_as_float(ctx, x), [-1, sv.shape[1]])  # a 1-D X is one row
    v = _f32(ctx, sv)
    if kernel == "LINEAR":
        dg = dk
    else:
        g = e.MatMul(xf, _f32(ctx, sv.T))
        if kernel == "RBF":
            sq_x = _last(ctx, e.Mul(xf, xf), "ReduceSum")
            sq_v = _f32(ctx, (sv.astype(np.float64) ** 2).sum(axis=1))
            dist = e.Relu(e.Add(e.Sub(sq_x, e.Mul(g, _f32(ctx, 2.0))), sq_v))
            k = e.Exp(e.Mul(dist, _f32(ctx, -gamma)))
            w = e.Mul(e.Mul(dk, k), _f32(ctx, -gamma))
            dx = e.Sub(e.Mul(_last(ctx, w, "ReduceSum"), xf), e.MatMul(w, v))
            dx = e.Mul(dx, _f32(ctx, 2.0))
            return _back_to(ctx, e.Reshape(dx, e.Shape(x)), x)
        base = e.Add(e.Mul(g, _f32(ctx, gamma)), _f32(ctx, coef0))
        if kernel == "POLY":
            slope = e.Mul(e.Pow(base, _f32(ctx, degree - 1.0)), _f32(ctx, degree * gamma))
        else:  # SIGMOID
            k = e.Tanh(base)
            slope = e.Mul(e.Sub(_f32(ctx, 1.0), e.Mul(k, k)), _f32(ctx, gamma))
        dg = e.Mul(dk, slope)
    dx = e.MatMul(dg, v)
    return _back_to(ctx, e.Reshape(dx, e.Shape(x)), x)


@vjp("SVMRegressor", domain=ML)
def svm_regressor_vjp(ctx, dy):
    """y = sum_s c_s K(x, v_s) + rho  ->  dK_s = dy c_s, dx from ``_kernel_vjp``.

    Without support vectors (n_supports = 0) y = x . c + rho, dx = dy c.
    one_class = 1 outputs sign(y) (+-1): piecewise constant, no gradient.
    onnxruntime ignores post_transform here, and so does the rule."""
    (x,) = ctx.inputs[:1]
    if not ctx.needs(0):
        return (None,)
    if int(ctx.attr("one_class", 0)):
        return (ctx.zeros_like(x),)
    e = ctx.emit
    coef = np.asarray(ctx.attr("coefficients", []), dtype=np.float32)
    count = int(ctx.attr("n_supports", 0))
    dy2 = e.reshape(dy, [-1, 1])
    if count <= 0:
        dx = e.Mul(dy2, _f32(ctx, coef))
        return (_back_to(ctx, e.Reshape(dx, e.Shape(x)), x),)
    sv = _support_vectors(ctx, count)
    dk = e.Mul(dy2, _f32(ctx, coef[:count]))
    return (_kernel_vjp(ctx, dk, x, sv),)


def _pairwise_matrix(ctx: VJPContext, per_class: list[int], n_classes: int) -> np.ndarray:
    """M (support vectors x class pairs) with s = K M + rho for the one-vs-one
    decision values: for the pair (i, j), i < j, support vectors of class i
    weigh coefficients[j - 1], those of class j weigh coefficients[i]."""
    total = sum(per_class)
    coef = np.asarray(ctx.attr("coefficients", []), dtype=np.float64)
    if coef.size != (n_classes - 1) * total:
        raise GradientError(
            f"{_where(ctx)}: expected {(n_classes - 1) * total} coefficients, found {coef.size}"
        )
    coef = coef.reshape(n_classes - 1, total)
    starts = np.concatenate([[0], np.cumsum(per_class)])
    pairs = [(i, j) for i in range(n_classes) for j in range(i + 1, n_classes)]
    m = np.zeros((total, len(pairs)))
    for p, (i, j) in enumerate(pairs):
        si = slice(starts[i], starts[i + 1])
        sj = slice(starts[j], starts[j + 1])
        m[si, p] = coef[j - 1, si]
        m[sj, p] = coef[i, sj]
    return m.astype(np.float32)


@vjp("SVMClassifier", domain=ML)
def svm_classifier_vjp(ctx, dlabel, dz=None):
    """Scores of an SVM classifier; the labels carry no gradient.

    Linear mode (no support vectors): s = x W^T + rho (W: classes x C),
    z = post_transform(s), ds from ``_post_transform_vjp``, dx = ds W.

    SVC mode: the one-vs-one decision values s = K(x, V) M + rho (see
    ``_pairwise_matrix``), z = post_transform(s); two classes (one pair) write
    [-s, s] (NONE), [1 - sigmoid(s), sigmoid(s)] (LOGISTIC) or [1 - s, s]
    (SOFTMAX, SOFTMAX_ZERO), ds from ``_binary_vjp``; then dK = ds M^T and dx
    from ``_kernel_vjp``.

    Refused: probability outputs (prob_a/prob_b), which Platt-scale the
    decision values and couple them by an iterative solver; PROBIT on two
    classes (onnxruntime's output does not follow the formula)."""
    (x,) = ctx.inputs[:1]
    z = ctx.outputs[1] if len(ctx.outputs) > 1 else ""
    if not ctx.needs(0):
        return (None,)
    if dz is None:  # only the (discrete) labels were reached
        return (ctx.zeros_like(x),)
    e = ctx.emit
    if ctx.attr("prob_a"):
        raise GradientError(
            f"{_where(ctx)}: probability scores (prob_a/prob_b) come from Platt scaling and "
            "an iterative pairwise-coupling solver; their gradient is not implemented"
        )
    transform = ctx.attr("post_transform", "NONE")
    labels = ctx.attr("classlabels_ints") or ctx.attr("classlabels_strings") or []
    n_classes = len(labels)
    per_class = [int(v) for v in (ctx.attr("vectors_per_class") or [])]
    if sum(per_class) == 0:
        ds = _post_transform_vjp(ctx, dz, z, transform)
        w = _coefficient_matrix(ctx, x, ctx.attr("coefficients", []), n_classes)
        dx = e.MatMul(ds, w)
        return (_back_to(ctx, _reshape_like(ctx, dx, x), x),)
    if len(per_class) != n_classes:
        raise GradientError(
            f"{_where(ctx)}: vectors_per_class has {len(per_class)} entries for {n_classes} classes"
        )
    m = _pairwise_matrix(ctx, per_class, n_classes)
    if m.shape[1] == 1:
        if transform == "PROBIT":
            raise GradientError(
                f"{_where(ctx)}: two-class scores with post_transform PROBIT are not "
                "differentiable here (onnxruntime's two score columns do not follow "
                "the probit of the decision value)"
            )
        ds = _binary_vjp(ctx, dz, z, logistic=transform == "LOGISTIC")
    else:
        ds = _post_transform_vjp(ctx, dz, z, transform)
    dk = e.MatMul(ds, _f32(ctx, m.T))
    return (_kernel_vjp(ctx, dk, x, _support_vectors(ctx, sum(per_class))),)


# ------------------------------------------------------- no gradient at all

# Tree ensembles are piecewise constant in X (each leaf value is a constant
# on a box of feature space): the derivative is 0 wherever it exists, which is
# everywhere except on the split thresholds, a set of measure zero.
no_grad("TreeEnsembleRegressor", "TreeEnsembleClassifier", "TreeEnsemble", domain=ML)

# Discrete outputs or step functions of X: thresholding, one-hot codes,
# lookups of labels and categories.
no_grad("Binarizer", "OneHotEncoder", "LabelEncoder", "CategoryMapper", domain=ML)

# Maps and sequences of maps carry no tensor gradient.
refuse(
    "ZipMap",
    "its output is a sequence of maps (class label -> probability), which has no "
    "gradient; differentiate the classifier's score tensor, before ZipMap",
    domain=ML,
)
refuse(
    "DictVectorizer",
    "its input is a map, which has no gradient; differentiate the tensor it produces",
    domain=ML,
)
refuse(
    "CastMap",
    "its input is a map, which has no gradient; differentiate the tensor it produces",
    domain=ML,
)
