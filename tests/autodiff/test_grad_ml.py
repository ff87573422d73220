"""Gradient rules of the ai.onnx.ml domain (onnxtrain/autodiff/rules/ml.py).

onnxruntime runs most ml ops in float32 only, so each check

1. runs the op on onnxruntime and compares it with a float64 numpy oracle of
   the op (written here from the op's definition and onnxruntime's observed
   conventions);
2. takes Gradient(loss = sum_k sum(R_k * out_k)) w.r.t. X through onnxtrain
   (float32 on onnxruntime) and compares it, entry by entry, with float64
   central differences of the oracle;
3. compares <grad, d> with float32 central differences of the op itself on
   onnxruntime along random directions d: with a step of 1 for ops linear in
   X (exact up to rounding), else a small step and a loose tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import pytest
from models import trainable_model, vi
from onnx import TensorProto, helper

from onnxtrain import TrainingSession
from onnxtrain.autodiff import expand_gradients
from onnxtrain.autodiff.registry import REGISTRY
from onnxtrain.core.graph import PREVIEW_DOMAIN
from onnxtrain.core.names import NameGen
from onnxtrain.errors import GradientError
from onnxtrain.runtime.executor import Executor

ML = "ai.onnx.ml"
F32, F64, I64 = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64
RNG = np.random.default_rng(1234)


# ------------------------------------------------------------------ harness


def _value_info(name: str, arr: np.ndarray, symbolic: bool) -> onnx.ValueInfoProto:
    dims = [f"{name}_d{i}" for i in range(arr.ndim)] if symbolic else list(arr.shape)
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), dims)


def _model(nodes, feeds, outputs, opset, ml_opset, symbolic=()):
    graph = helper.make_graph(
        list(nodes),
        "ml_check",
        [_value_info(k, v, k in symbolic) for k, v in feeds.items()],
        [helper.make_tensor_value_info(o[0], o[1], o[2] if len(o) > 2 else None) for o in outputs],
    )
    imports = [
        helper.make_opsetid("", opset),
        helper.make_opsetid(ML, ml_opset),
        helper.make_opsetid(PREVIEW_DOMAIN, 1),
    ]
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = 8 if ml_opset <= 3 else 10
    return model


def _declare_outputs(model: onnx.ModelProto, outputs: Sequence[str], probe) -> None:
    """Give out_k and R_k the same symbolic dims in the model.

    onnx has no shape inference for most ml ops (Scaler, Normalizer,
    LinearRegressor, SVMRegressor, ...), so nothing downstream of them has a
    known rank, and before opset 13 the loss's own rules (Sum, Mul) cannot
    unbroadcast without ranks.  skl2onnx models declare their outputs; so do
    the checks at those opsets."""
    weights = {v.name: v for v in model.graph.input}
    for k, (o, p) in enumerate(zip(outputs, probe)):
        dims = [f"{o}_d{i}" for i in range(p.ndim)]
        et = helper.np_dtype_to_tensor_dtype(p.dtype)
        model.graph.value_info.append(helper.make_tensor_value_info(o, et, dims))
        weights[f"R{k}"].CopyFrom(helper.make_tensor_value_info(f"R{k}", et, dims))


def check_graph(
    nodes: Sequence[onnx.NodeProto],
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str],
    oracle: Callable[..., Sequence[np.ndarray]] | None = None,
    *,
    wrt: Sequence[str] = ("X",),
    out_types: Mapping[str, int] | None = None,
    opset: int = 17,
    ml_opset: int = 3,
    symbolic: bool = False,
    linear: bool = False,
    rtol: float = 2e-4,
    forward_rtol: float = 1e-5,
    ort_eps: float = 1e-2,
    ort_rtol: float = 1e-2,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Check d/dX of sum_k sum(R_k * outputs_k) (see the module docstring).

    ``oracle(**inputs_in_float64)`` returns the outputs in float64, or is None
    to skip steps 1-2.  ``linear`` marks the outputs as linear in ``wrt``: the
    onnxruntime differences then use a step of 1 and a tight tolerance.
    ``symbolic`` declares every input with symbolic dimensions."""
    rng = np.random.default_rng(seed)
    out_types = dict(out_types or {})
    typed_outs = [(o, out_types.get(o, F32)) for o in outputs]
    forward = Executor(_model(nodes, inputs, typed_outs, opset, ml_opset))
    probe = forward.run(dict(inputs), list(outputs))
    weights = {f"R{k}": rng.standard_normal(p.shape).astype(p.dtype) for k, p in enumerate(probe)}
    r64 = [w.astype(np.float64) for w in weights.values()]

    def ort_loss(feeds: Mapping[str, np.ndarray]) -> float:
        outs = forward.run(dict(feeds), list(outputs))
        return float(sum(np.sum(r * o.astype(np.float64)) for r, o in zip(r64, outs)))

    x64 = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in inputs.items()}
    if oracle is not None:
        expected = oracle(**x64)
        for o, got, want in zip(outputs, probe, expected):
            np.testing.assert_allclose(
                got, want, rtol=forward_rtol, atol=forward_rtol, err_msg=f"forward {o} vs oracle"
            )

    # loss = sum_k ReduceSum(out_k * R_k), then its Gradient w.r.t. wrt.
    loss_nodes, sums = [], []
    for k, o in enumerate(outputs):
        loss_nodes.append(helper.make_node("Mul", [o, f"R{k}"], [f"w{k}"]))
        loss_nodes.append(helper.make_node("ReduceSum", [f"w{k}"], [f"s{k}"], keepdims=0))
        sums.append(f"s{k}")
    loss_nodes.append(helper.make_node("Sum", sums, ["loss"]))
    grads = [f"grad_{x}" for x in wrt]
    gnode = helper.make_node(
        "Gradient", list(wrt), grads, domain=PREVIEW_DOMAIN, xs=list(wrt), y="loss", name="G"
    )
    feeds = {**inputs, **weights}
    loss_type = helper.np_dtype_to_tensor_dtype(probe[0].dtype)
    grad_types = [
        (g, helper.np_dtype_to_tensor_dtype(inputs[x].dtype), list(inputs[x].shape))
        for g, x in zip(grads, wrt)
    ]
    model = _model(
        list(nodes) + loss_nodes + [gnode],
        feeds,
        [("loss", loss_type, [])] + grad_types,
        opset,
        ml_opset,
        symbolic=set(inputs) if symbolic else (),
    )
    if opset < 13:
        _declare_outputs(model, outputs, probe)
    expand_gradients(model.graph, model.opset_import, NameGen.from_graph(model.graph), list(feeds))
    onnx.checker.check_model(model)
    analytic = Executor(model).run(feeds, grads)
    for g, x in zip(analytic, wrt):
        assert g.shape == inputs[x].shape, f"grad of {x}: shape {g.shape} != {inputs[x].shape}"
        assert g.dtype == inputs[x].dtype, f"grad of {x}: dtype {g.dtype} != {inputs[x].dtype}"
        assert np.all(np.isfinite(g)), f"grad of {x} is not finite: {g}"

    if oracle is not None:
        # float64 central differences of the oracle, entry by entry.
        def oracle_loss(point):
            return float(sum(np.sum(r * o) for r, o in zip(r64, oracle(**point))))

        eps = 1e-6
        for g, x in zip(analytic, wrt):
            numeric = np.zeros(inputs[x].shape)
            for i in np.ndindex(*inputs[x].shape):
                plus, minus = dict(x64), dict(x64)
                plus[x] = x64[x].copy()
                minus[x] = x64[x].copy()
                plus[x][i] += eps
                minus[x][i] -= eps
                numeric[i] = (oracle_loss(plus) - oracle_loss(minus)) / (2 * eps)
            scale = max(1.0, float(np.abs(numeric).max()))
            np.testing.assert_allclose(
                g, numeric, rtol=rtol, atol=rtol * scale, err_msg=f"grad of {x} vs oracle"
            )

    # The op itself on onnxruntime, along random directions.
    step, tol = (1.0, 1e-5) if linear else (ort_eps, ort_rtol)
    for _ in range(2):
        d = {x: rng.standard_normal(inputs[x].shape) for x in wrt}
        plus, minus = dict(inputs), dict(inputs)
        for x in wrt:
            plus[x] = (x64[x] + step * d[x]).astype(inputs[x].dtype)
            minus[x] = (x64[x] - step * d[x]).astype(inputs[x].dtype)
        numeric = (ort_loss(plus) - ort_loss(minus)) / (2 * step)
        predicted = sum(float(np.sum(g.astype(np.float64) * d[x])) for g, x in zip(analytic, wrt))
        scale = max(1.0, sum(float(np.abs(g).sum()) for g in analytic))
        np.testing.assert_allclose(
            predicted, numeric, rtol=tol, atol=tol * scale, err_msg="directional derivative on ORT"
        )
    return dict(zip(wrt, analytic))


def check_ml(
    op: str,
    inputs: Mapping[str, np.ndarray],
    attrs: Mapping,
    oracle=None,
    *,
    n_outputs: int = 1,
    diff_outputs: Sequence[int] = (0,),
    **kw,
) -> dict[str, np.ndarray]:
    """check_graph for one ai.onnx.ml node; ``oracle`` returns the diff outputs."""
    outs = [f"out{i}" for i in range(n_outputs)]
    node = helper.make_node(op, list(inputs), outs, domain=ML, name="op", **attrs)
    return check_graph([node], inputs, [outs[k] for k in diff_outputs], oracle, **kw)


def expand(nodes, inputs: Mapping[str, np.ndarray], y: str, opset: int = 17, ml_opset: int = 3):
    """Expand Gradient(y w.r.t. X) and return the graph (no run)."""
    g = helper.make_node("Gradient", ["X"], ["dX"], domain=PREVIEW_DOMAIN, xs=["X"], y=y, name="G")
    model = _model(list(nodes) + [g], inputs, [("dX", F32)], opset, ml_opset)
    expand_gradients(model.graph, model.opset_import, NameGen.from_graph(model.graph), list(inputs))
    return model


def weighted_gradient(nodes, x: np.ndarray, r: np.ndarray, opset: int = 17) -> np.ndarray:
    """dX of loss = sum(R * Y) for ``nodes`` (one node or a list) computing Y
    from X, so that dY = R.

    Y is declared (type and shape) as an exporter would: onnx infers neither
    for most ml ops."""
    nodes = [nodes] if isinstance(nodes, onnx.NodeProto) else list(nodes)
    nodes += [helper.make_node("Mul", ["Y", "R"], ["w"]),
              helper.make_node("ReduceSum", ["w"], ["loss"], keepdims=0)]
    g = helper.make_node("Gradient", ["X"], ["dX"], domain=PREVIEW_DOMAIN, xs=["X"], y="loss")
    model = _model(nodes + [g], {"X": x, "R": r}, [("dX", F32, list(x.shape))], opset, 3)
    model.graph.value_info.append(helper.make_tensor_value_info("Y", F32, list(r.shape)))
    expand_gradients(model.graph, model.opset_import, NameGen.from_graph(model.graph), ["X", "R"])
    onnx.checker.check_model(model)
    (dx,) = Executor(model).run({"X": x, "R": r}, ["dX"])
    return dx


# ------------------------------------------------------------------ oracles


def rows(x: np.ndarray) -> np.ndarray:
    """X as the ml ops read it: [N, C] (a 1-D X is one row)."""
    return x.reshape(1, -1) if x.ndim == 1 else x


def sigmoid(s):
    return 1.0 / (1.0 + np.exp(-s))


def softmax(s, zero=False):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    if zero:
        e = np.where(np.abs(s) > 1e-7, e, 0.0)
    return e / e.sum(axis=-1, keepdims=True)


def probit(p):
    """sqrt(2) erfinv(2p - 1), by Newton's method on the normal CDF."""
    z = np.zeros_like(p)
    for _ in range(50):
        cdf = 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
        pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
        z = z - (cdf - p) / pdf
    return z


def post_transform(s, transform):
    return {
        "NONE": lambda: s,
        "LOGISTIC": lambda: sigmoid(s),
        "SOFTMAX": lambda: softmax(s),
        "SOFTMAX_ZERO": lambda: softmax(s, zero=True),
        "PROBIT": lambda: probit(s),
    }[transform]()


def kernel(x, sv, kind, gamma, coef0, degree):
    g = rows(x) @ sv.T
    if kind == "LINEAR":
        return g
    if kind == "POLY":
        return (gamma * g + coef0) ** degree
    if kind == "SIGMOID":
        return np.tanh(gamma * g + coef0)
    d = ((rows(x)[:, None, :] - sv[None]) ** 2).sum(-1)
    return np.exp(-gamma * d)


def pairwise_decisions(k, coefs, per_class):
    """One-vs-one decision values (without rho), one column per class pair."""
    starts = np.concatenate([[0], np.cumsum(per_class)])
    cols = []
    n = len(per_class)
    for i in range(n):
        for j in range(i + 1, n):
            si, sj = slice(starts[i], starts[i + 1]), slice(starts[j], starts[j + 1])
            cols.append(k[:, si] @ coefs[j - 1, si] + k[:, sj] @ coefs[i, sj])
    return np.stack(cols, axis=1)


# ------------------------------------------------------------------- Scaler


def scaler_oracle(offset, scale):
    off, sc = np.asarray(offset, np.float64), np.asarray(scale, np.float64)

    def f(X):
        flat = X.reshape(-1)
        i = np.arange(flat.size)
        return [((flat - off[i % off.size]) * sc[i % sc.size]).reshape(X.shape)]

    return f


SCALER_CASES = {
    "per_feature": (RNG.standard_normal((4, 3)), [0.5, -1.0, 2.0], [2.0, 0.5, -3.0]),
    "one_value": (RNG.standard_normal((4, 3)), [0.5], [1.5]),
    "one_row": (RNG.standard_normal(3), [0.5, -1.0, 2.0], [2.0, 0.5, -3.0]),
    # onnxruntime pairs flattened element i with scale[i mod len] for rank 3.
    "rank3": (RNG.standard_normal((2, 2, 3)), [0.1, 0.2], [2.0, -1.0]),
}


@pytest.mark.parametrize("case", SCALER_CASES)
@pytest.mark.parametrize("opset", [11, 17])
def test_scaler(case, opset):
    x, offset, scale = SCALER_CASES[case]
    g = check_ml(
        "Scaler",
        {"X": x.astype(np.float32)},
        dict(offset=offset, scale=scale),
        scaler_oracle(offset, scale),
        opset=opset,
        linear=True,
    )
    assert g["X"].shape == x.shape


@pytest.mark.parametrize("symbolic", [False, True])
def test_scaler_double_input_gets_a_double_gradient(symbolic):
    x = RNG.standard_normal((5, 3))
    check_ml(
        "Scaler",
        {"X": x},
        dict(offset=[1.0, 0.0, -1.0], scale=[0.5, 2.0, 4.0]),
        scaler_oracle([1.0, 0.0, -1.0], [0.5, 2.0, 4.0]),
        symbolic=symbolic,
        linear=True,
        forward_rtol=1e-6,
    )


# --------------------------------------------------------------- Normalizer


def normalizer_oracle(norm):
    def f(X):
        x = rows(X)
        if norm == "MAX":
            n = x.max(axis=1, keepdims=True)
        elif norm == "L1":
            n = np.abs(x).sum(axis=1, keepdims=True)
        else:
            n = np.sqrt((x * x).sum(axis=1, keepdims=True))
        y = np.where(n == 0, x, x / np.where(n == 0, 1.0, n))
        return [y.reshape(X.shape) if X.ndim == 1 else y]

    return f


def _normalizer_input():
    x = RNG.uniform(0.5, 2.0, (4, 3)) * RNG.choice([-1.0, 1.0], (4, 3))
    x[0] = [-1.0, -2.0, -0.5]  # all negative: the signed max is -0.5
    x[:, 0] = np.abs(x[:, 0]) + 2.5  # a positive, unique max in other rows
    x[0, 0] = -3.0
    return x.astype(np.float32)


NORMALIZER_X = _normalizer_input()


@pytest.mark.parametrize("norm", ["MAX", "L1", "L2"])
@pytest.mark.parametrize("opset", [11, 13, 18])
def test_normalizer(norm, opset):
    check_ml(
        "Normalizer", {"X": NORMALIZER_X}, dict(norm=norm), normalizer_oracle(norm), opset=opset
    )


@pytest.mark.parametrize("norm", ["MAX", "L1", "L2"])
def test_normalizer_one_row_double_and_symbolic(norm):
    check_ml(
        "Normalizer", {"X": NORMALIZER_X[1]}, dict(norm=norm), normalizer_oracle(norm),
        symbolic=True,
    )
    check_ml(
        "Normalizer",
        {"X": NORMALIZER_X.astype(np.float64)},
        dict(norm=norm),
        normalizer_oracle(norm),
        forward_rtol=1e-6,
    )


@pytest.mark.parametrize("norm", ["MAX", "L1", "L2"])
def test_normalizer_zero_row_passes_the_gradient_through(norm):
    """onnxruntime copies a row whose norm is 0 (y = x), so there dx = dy."""
    x = NORMALIZER_X.copy()
    x[2] = 0.0
    node = helper.make_node("Normalizer", ["X"], ["Y"], domain=ML, norm=norm)
    r = RNG.standard_normal(x.shape).astype(np.float32)
    dx = weighted_gradient(node, x, r)
    np.testing.assert_allclose(dx[2], r[2])
    assert np.all(np.isfinite(dx))


def test_normalizer_max_ties_share_the_gradient():
    """Two entries reach the row max: the max's sensitivity is split evenly
    (the average of the one-sided derivatives)."""
    x = np.array([[2.0, 1.0, 2.0]], np.float32)
    r = np.array([[0.3, -0.7, 1.1]], np.float32)
    node = helper.make_node("Normalizer", ["X"], ["Y"], domain=ML, norm="MAX")
    dx = weighted_gradient(node, x, r)
    y = x / 2.0
    corr = float((r * y).sum()) / 2.0
    np.testing.assert_allclose(dx, r / 2.0 - np.array([[0.5, 0.0, 0.5]]) * corr, rtol=1e-6)


# --------------------------------------------------------------- Imputer


@pytest.mark.parametrize("replaced", [0.0, float("nan"), 7.5])
def test_imputer_replaced_entries_get_zero(replaced):
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    x[0, 1] = x[2, 3] = replaced
    attrs = dict(imputed_value_floats=[9.0, 8.0, 7.0, 6.0], replaced_value_float=replaced)
    kept = ~np.isnan(x) if math.isnan(replaced) else x != replaced
    node = helper.make_node("Imputer", ["X"], ["Y"], domain=ML, **attrs)
    r = RNG.standard_normal(x.shape).astype(np.float32)
    for opset in (11, 17):
        dx = weighted_gradient(node, x, r, opset)
        np.testing.assert_array_equal(dx, np.where(kept, r, 0.0).astype(np.float32))


def test_imputer_kept_entries_match_differences():
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    x[1, 2] = np.nan  # replaced; the directions move the finite entries only
    attrs = dict(imputed_value_floats=[0.5], replaced_value_float=float("nan"))

    def oracle(X):
        return [np.where(np.isnan(X), 0.5, X)]

    check_ml("Imputer", {"X": x}, attrs, oracle, linear=True, symbolic=True)


# --------------------------------------------------------- FeatureVectorizer


def feature_vectorizer_oracle(dims):
    def f(**xs):
        parts = []
        for x, d in zip(xs.values(), dims):
            v = x.reshape(1, -1) if x.ndim == 1 else x.reshape(x.shape[0], -1)
            v = v[:, :d]
            if v.shape[1] < d:
                v = np.concatenate([v, np.zeros((v.shape[0], d - v.shape[1]))], axis=1)
            parts.append(v)
        return [np.concatenate(parts, axis=1)]

    return f


FV_CASES = {
    "exact": ({"A": (4, 3), "B": (4, 2)}, [3, 2]),
    "cut_and_pad": ({"A": (4, 3), "B": (4, 2)}, [2, 4]),
    "one_row": ({"A": (3,), "B": (2,)}, [3, 1]),
    "rank3_flattened": ({"A": (2, 2, 3), "B": (2, 2)}, [5, 2]),
}


@pytest.mark.parametrize("case", FV_CASES)
@pytest.mark.parametrize("symbolic", [False, True])
def test_feature_vectorizer(case, symbolic):
    shapes, dims = FV_CASES[case]
    inputs = {k: RNG.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    check_ml(
        "FeatureVectorizer",
        inputs,
        dict(inputdimensions=dims),
        feature_vectorizer_oracle(dims),
        wrt=list(inputs),
        symbolic=symbolic,
        linear=True,
    )


def test_feature_vectorizer_double_inputs_one_wanted():
    inputs = {"A": RNG.standard_normal((3, 2)), "B": RNG.standard_normal((3, 3))}
    g = check_ml(
        "FeatureVectorizer",
        inputs,
        dict(inputdimensions=[2, 3]),
        feature_vectorizer_oracle([2, 3]),
        wrt=["B"],
        linear=True,
        forward_rtol=1e-6,
    )
    assert g["B"].dtype == np.float64


# ----------------------------------------------------- ArrayFeatureExtractor


AFE_CASES = {
    "repeated": ((3, 5), [4, 0, 4, 2]),
    "one_row": ((5,), [1, 3, 1]),
    "rank3": ((2, 2, 4), [3, 0]),
    "index_matrix": ((3, 5), [[0, 2], [2, 4]]),
}


@pytest.mark.parametrize("case", AFE_CASES)
@pytest.mark.parametrize("opset", [11, 17])
def test_array_feature_extractor(case, opset):
    shape, idx = AFE_CASES[case]
    x = RNG.standard_normal(shape).astype(np.float32)
    idx = np.asarray(idx, np.int64)

    def oracle(X, Y):
        out = X[..., Y.reshape(-1)]
        return [out.reshape(1, -1) if X.ndim == 1 else out]

    check_ml("ArrayFeatureExtractor", {"X": x, "Y": idx}, {}, oracle, opset=opset, linear=True,
             symbolic=opset == 17)


def test_array_feature_extractor_double():
    x = RNG.standard_normal((3, 4))
    idx = np.array([3, 3, 1], np.int64)
    g = check_ml(
        "ArrayFeatureExtractor",
        {"X": x, "Y": idx},
        {},
        lambda X, Y: [X[:, Y]],
        out_types={"out0": F64},
        linear=True,
    )
    assert g["X"].dtype == np.float64


# ----------------------------------------------------------- linear models

W2 = np.array([[0.4, -0.3, 0.8], [-0.6, 0.2, 0.5]])
B2 = np.array([0.1, -0.2])
X43 = RNG.standard_normal((4, 3)).astype(np.float32)


def linear_regressor_oracle(w, b, transform, targets):
    def f(X):
        s = rows(X) @ w.T + b
        if targets == 1 and transform != "PROBIT":
            return [s]
        return [post_transform(s, transform)]

    return f


@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
@pytest.mark.parametrize("opset", [11, 17])
def test_linear_regressor_two_targets(transform, opset):
    check_ml(
        "LinearRegressor",
        {"X": X43},
        dict(coefficients=W2.ravel().tolist(), intercepts=B2.tolist(), targets=2,
             post_transform=transform),
        linear_regressor_oracle(W2, B2, transform, 2),
        opset=opset,
        linear=transform == "NONE",
    )


@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC"])
@pytest.mark.parametrize("shape", [(4, 3), (3,)])
@pytest.mark.parametrize("symbolic", [False, True])
def test_linear_regressor_one_target(transform, shape, symbolic):
    """One target: onnxruntime applies no LOGISTIC/SOFTMAX, y = x w + b.  The
    coefficient list is longer than C: onnxruntime reads its first C entries
    (with symbolic shapes the rule slices them at run time)."""
    x = RNG.standard_normal(shape).astype(np.float32)
    check_ml(
        "LinearRegressor",
        {"X": x},
        dict(coefficients=W2.ravel().tolist(), intercepts=[0.3], post_transform=transform),
        linear_regressor_oracle(W2[:1], np.array([0.3]), transform, 1),
        symbolic=symbolic,
        linear=True,
    )


def test_linear_regressor_probit():
    """PROBIT maps scores in (0, 1); onnxruntime approximates erfinv, so the
    oracle's exact probit matches to about 1e-4."""
    x = (RNG.uniform(-1.0, 1.0, (4, 3))).astype(np.float32)
    w = np.array([[0.1, -0.05, 0.08], [0.05, 0.1, -0.1]])
    b = np.array([0.5, 0.45])
    for targets in (1, 2):
        check_ml(
            "LinearRegressor",
            {"X": x},
            dict(coefficients=w[:targets].ravel().tolist(), intercepts=b[:targets].tolist(),
                 targets=targets, post_transform="PROBIT"),
            linear_regressor_oracle(w[:targets], b[:targets], "PROBIT", targets),
            forward_rtol=1e-3,
            rtol=5e-3,
        )


def linear_classifier_oracle(w, b, transform):
    def f(X):
        s = rows(X) @ w.T + b
        if w.shape[0] == 1:
            t = sigmoid(s) if transform == "LOGISTIC" else s
            return [np.concatenate([1.0 - t, t], axis=1)]
        return [post_transform(s, transform)]

    return f


W3 = np.array([[0.4, -0.3, 0.8], [-0.6, 0.2, 0.5], [0.0, 0.0, 0.0]])
B3 = np.array([0.1, -0.2, 0.0])  # class 2 scores exactly 0: SOFTMAX_ZERO drops it


@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
@pytest.mark.parametrize("classes", [3, 1])
def test_linear_classifier_scores(transform, classes):
    w, b = W3[:classes], B3[:classes]
    labels = [0, 1, 2] if classes == 3 else [0, 1]
    check_ml(
        "LinearClassifier",
        {"X": X43},
        dict(coefficients=w.ravel().tolist(), intercepts=b.tolist(), classlabels_ints=labels,
             post_transform=transform),
        linear_classifier_oracle(w, b, transform),
        n_outputs=2,
        diff_outputs=[1],
        linear=transform in ("NONE",) or (classes == 1 and transform != "LOGISTIC"),
    )


@pytest.mark.parametrize("opset", [9, 13])
def test_linear_classifier_string_labels_one_row_symbolic(opset):
    x = X43[0]
    check_ml(
        "LinearClassifier",
        {"X": x},
        dict(coefficients=W3.ravel().tolist(), intercepts=B3.tolist(),
             classlabels_strings=["a", "b", "c"], post_transform="SOFTMAX"),
        linear_classifier_oracle(W3, B3, "SOFTMAX"),
        n_outputs=2,
        diff_outputs=[1],
        opset=opset,
        symbolic=opset >= 10,
    )


def test_linear_classifier_double_input():
    g = check_ml(
        "LinearClassifier",
        {"X": X43.astype(np.float64)},
        dict(coefficients=W3.ravel().tolist(), intercepts=B3.tolist(), classlabels_ints=[4, 5, 6],
             post_transform="LOGISTIC"),
        linear_classifier_oracle(W3, B3, "LOGISTIC"),
        n_outputs=2,
        diff_outputs=[1],
        forward_rtol=1e-6,
    )
    assert g["X"].dtype == np.float64


def test_linear_classifier_probit_multiclass():
    x = RNG.uniform(-1.0, 1.0, (4, 3)).astype(np.float32)
    w = np.array([[0.1, -0.05, 0.08], [0.05, 0.1, -0.1]])
    b = np.array([0.5, 0.45])
    check_ml(
        "LinearClassifier",
        {"X": x},
        dict(coefficients=w.ravel().tolist(), intercepts=b.tolist(), classlabels_ints=[0, 1],
             post_transform="PROBIT"),
        linear_classifier_oracle(w, b, "PROBIT"),
        n_outputs=2,
        diff_outputs=[1],
        forward_rtol=1e-3,
        rtol=5e-3,
    )


# --------------------------------------------------------------------- SVMs

SV = RNG.standard_normal((6, 4)) * 0.7
X34 = (RNG.standard_normal((3, 4)) * 0.7).astype(np.float32)
KERNEL_PARAMS = {"LINEAR": [0.3, 0.5, 3.0], "POLY": [0.3, 0.5, 3.0], "RBF": [0.3, 0.0, 0.0],
                 "SIGMOID": [0.3, 0.5, 0.0]}


@pytest.mark.parametrize("kind", ["LINEAR", "POLY", "RBF", "SIGMOID"])
@pytest.mark.parametrize("shape", [(3, 4), (4,)])
def test_svm_regressor(kind, shape):
    c = RNG.standard_normal(6)
    params = KERNEL_PARAMS[kind]
    x = X34 if shape == (3, 4) else X34[0]

    def oracle(X):
        y = kernel(X, SV, kind, *params) @ c + 0.1
        return [y.reshape(-1, 1)]

    check_ml(
        "SVMRegressor",
        {"X": x},
        dict(coefficients=c.tolist(), kernel_params=params, kernel_type=kind, n_supports=6,
             rho=[0.1], support_vectors=SV.ravel().tolist()),
        oracle,
        linear=kind == "LINEAR",
        forward_rtol=1e-5,
    )


def test_svm_regressor_poly_non_integer_degree():
    c = RNG.standard_normal(6)
    params = [0.2, 2.0, 2.5]  # gamma <x, v> + 2 > 0 here, so the power is real

    def oracle(X):
        return [(kernel(X, SV, "POLY", *params) @ c + 0.1).reshape(-1, 1)]

    check_ml(
        "SVMRegressor",
        {"X": X34},
        dict(coefficients=c.tolist(), kernel_params=params, kernel_type="POLY", n_supports=6,
             rho=[0.1], support_vectors=SV.ravel().tolist()),
        oracle,
    )


def test_svm_regressor_linear_mode_and_one_class():
    c = np.array([0.5, -1.0, 0.25, 2.0])
    check_ml(
        "SVMRegressor",
        {"X": X34},
        dict(coefficients=c.tolist(), kernel_params=[0.3, 0.5, 3.0], kernel_type="RBF",
             n_supports=0, rho=[0.1]),
        lambda X: [(X @ c + 0.1).reshape(-1, 1)],
        linear=True,
        symbolic=True,
    )
    # one_class outputs +-1: piecewise constant, the gradient is 0.
    g = check_ml(
        "SVMRegressor",
        {"X": X34},
        dict(coefficients=RNG.standard_normal(6).tolist(), kernel_params=[0.3, 0.0, 0.0],
             kernel_type="RBF", n_supports=6, rho=[-0.5], one_class=1,
             support_vectors=SV.ravel().tolist()),
        ort_eps=1e-3,
    )
    np.testing.assert_array_equal(g["X"], 0.0)


PER_CLASS = [2, 3, 1]
COEFS3 = RNG.standard_normal((2, 6))
RHO3 = [0.1, -0.2, 0.3]


def svc_oracle(kind, params, coefs, per_class, rho, transform):
    def f(X):
        s = pairwise_decisions(kernel(X, SV, kind, *params), coefs, per_class) + np.asarray(rho)
        if s.shape[1] == 1:
            if transform == "NONE":
                return [np.concatenate([-s, s], axis=1)]
            t = sigmoid(s) if transform == "LOGISTIC" else s
            return [np.concatenate([1.0 - t, t], axis=1)]
        return [post_transform(s, transform)]

    return f


@pytest.mark.parametrize("kind", ["LINEAR", "POLY", "RBF", "SIGMOID"])
def test_svm_classifier_three_classes(kind):
    params = KERNEL_PARAMS[kind]
    check_ml(
        "SVMClassifier",
        {"X": X34},
        dict(classlabels_ints=[0, 1, 2], coefficients=COEFS3.ravel().tolist(),
             kernel_params=params, kernel_type=kind, rho=RHO3,
             support_vectors=SV.ravel().tolist(), vectors_per_class=PER_CLASS),
        svc_oracle(kind, params, COEFS3, PER_CLASS, RHO3, "NONE"),
        n_outputs=2,
        diff_outputs=[1],
        linear=kind == "LINEAR",
    )


@pytest.mark.parametrize("transform", ["LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
def test_svm_classifier_three_classes_post_transform(transform):
    params = KERNEL_PARAMS["RBF"]
    check_ml(
        "SVMClassifier",
        {"X": X34},
        dict(classlabels_strings=["x", "y", "z"], coefficients=COEFS3.ravel().tolist(),
             kernel_params=params, kernel_type="RBF", rho=RHO3,
             support_vectors=SV.ravel().tolist(), vectors_per_class=PER_CLASS,
             post_transform=transform),
        svc_oracle("RBF", params, COEFS3, PER_CLASS, RHO3, transform),
        n_outputs=2,
        diff_outputs=[1],
    )


@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC", "SOFTMAX"])
@pytest.mark.parametrize("kind", ["RBF", "POLY"])
def test_svm_classifier_two_classes(transform, kind):
    params = KERNEL_PARAMS[kind]
    coefs = RNG.standard_normal((1, 6))
    check_ml(
        "SVMClassifier",
        {"X": X34},
        dict(classlabels_ints=[0, 1], coefficients=coefs.ravel().tolist(),
             kernel_params=params, kernel_type=kind, rho=[0.1],
             support_vectors=SV.ravel().tolist(), vectors_per_class=[2, 4],
             post_transform=transform),
        svc_oracle(kind, params, coefs, [2, 4], [0.1], transform),
        n_outputs=2,
        diff_outputs=[1],
        symbolic=True,
    )


@pytest.mark.parametrize("transform", ["NONE", "SOFTMAX"])
def test_svm_classifier_linear_mode(transform):
    """No support vectors: s = x W^T + rho (onnxruntime adds rho[0] to every class)."""
    w = RNG.standard_normal((3, 4))

    def oracle(X):
        return [post_transform(rows(X) @ w.T + RHO3[0], transform)]

    check_ml(
        "SVMClassifier",
        {"X": X34},
        dict(classlabels_ints=[0, 1, 2], coefficients=w.ravel().tolist(),
             kernel_params=[0.3, 0.5, 3.0], kernel_type="LINEAR", rho=RHO3,
             post_transform=transform),
        oracle,
        n_outputs=2,
        diff_outputs=[1],
        linear=transform == "NONE",
    )


# ---------------------------------------------------- refusals and no_grad


def _scores_loss(node):
    return [node, helper.make_node("ReduceSum", ["Z"], ["loss"], keepdims=0)]


@pytest.mark.parametrize(
    "op, attrs, match",
    [
        ("SVMClassifier",
         dict(classlabels_ints=[0, 1, 2], coefficients=COEFS3.ravel().tolist(),
              kernel_params=[0.3, 0.0, 0.0], kernel_type="RBF", rho=RHO3,
              support_vectors=SV.ravel().tolist(), vectors_per_class=PER_CLASS,
              prob_a=[-1.0, -2.0, -1.5], prob_b=[0.1, 0.2, 0.0]),
         "Platt scaling"),
        ("SVMClassifier",
         dict(classlabels_ints=[0, 1], coefficients=COEFS3[0].tolist(),
              kernel_params=[0.3, 0.0, 0.0], kernel_type="RBF", rho=[0.1],
              support_vectors=SV.ravel().tolist(), vectors_per_class=[2, 4],
              post_transform="PROBIT"),
         "PROBIT"),
        ("LinearClassifier",
         dict(coefficients=[0.1, 0.2, 0.3, 0.4], intercepts=[0.5], classlabels_ints=[0, 1],
              post_transform="PROBIT"),
         "PROBIT"),
    ],
)
def test_refused_configurations_name_the_reason(op, attrs, match):
    node = helper.make_node(op, ["X"], ["L", "Z"], domain=ML, name="clf", **attrs)
    with pytest.raises(GradientError, match=match):
        expand(_scores_loss(node), {"X": X34}, "loss")


def test_zipmap_on_the_path_is_refused():
    node = helper.make_node(
        "LinearClassifier", ["X"], ["L", "Z"], domain=ML,
        coefficients=W3[:2].ravel().tolist(), intercepts=[0.1, 0.2],
        classlabels_ints=[0, 1],
    )
    zipmap = helper.make_node("ZipMap", ["Z"], ["maps"], domain=ML, classlabels_int64s=[0, 1],
                              name="zm")
    with pytest.raises(GradientError, match="sequence of maps"):
        expand([node, zipmap], {"X": X43}, "maps")


@pytest.mark.parametrize(
    "op, kind",
    [("ZipMap", "refused"), ("DictVectorizer", "refused"), ("CastMap", "refused"),
     ("TreeEnsembleRegressor", "zero"), ("TreeEnsembleClassifier", "zero"),
     ("TreeEnsemble", "zero"), ("Binarizer", "zero"), ("OneHotEncoder", "zero"),
     ("LabelEncoder", "zero"), ("CategoryMapper", "zero"),
     ("Scaler", "vjp"), ("Normalizer", "vjp"), ("LinearRegressor", "vjp"),
     ("LinearClassifier", "vjp"), ("FeatureVectorizer", "vjp"),
     ("ArrayFeatureExtractor", "vjp"), ("Imputer", "vjp"), ("SVMRegressor", "vjp"),
     ("SVMClassifier", "vjp")],
)
def test_registration(op, kind):
    rule = REGISTRY.get(ML, op)
    assert rule is not None and rule.kind == kind
    if kind == "refused":
        assert rule.reason
    assert REGISTRY.get("", op) is None  # ml rules live in their own domain


TREE_ATTRS = dict(
    n_targets=1,
    nodes_treeids=[0, 0, 0],
    nodes_nodeids=[0, 1, 2],
    nodes_featureids=[1, 0, 0],
    nodes_values=[0.2, 0.0, 0.0],
    nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF"],
    nodes_truenodeids=[1, 0, 0],
    nodes_falsenodeids=[2, 0, 0],
    target_treeids=[0, 0],
    target_nodeids=[1, 2],
    target_ids=[0, 0],
    target_weights=[-1.5, 2.5],
)


def _tree_ensemble_v5():
    from onnx import numpy_helper

    return dict(
        n_targets=1,
        aggregate_function=1,  # SUM
        post_transform=0,
        tree_roots=[0],
        nodes_featureids=[1],
        nodes_splits=numpy_helper.from_array(np.array([0.2], np.float32)),
        nodes_modes=numpy_helper.from_array(np.array([0], np.uint8)),  # BRANCH_LEQ
        nodes_truenodeids=[0],
        nodes_trueleafs=[1],
        nodes_falsenodeids=[1],
        nodes_falseleafs=[1],
        leaf_targetids=[0, 0],
        leaf_weights=numpy_helper.from_array(np.array([-1.5, 2.5], np.float32)),
    )


def _tree(x):
    return np.where(x[:, 1:2] <= 0.2, -1.5, 2.5)


PIECEWISE = {
    # name: (node producing F from X, ml opset, F(X) in numpy)
    "Binarizer": (dict(op_type="Binarizer", threshold=0.1), 3, lambda x: (x > 0.1) * 1.0),
    "TreeEnsembleRegressor": (dict(op_type="TreeEnsembleRegressor", **TREE_ATTRS), 3, _tree),
    "TreeEnsemble": (dict(op_type="TreeEnsemble", **_tree_ensemble_v5()), 5, _tree),
    "LabelEncoder": (
        dict(op_type="LabelEncoder", keys_floats=[0.5, -1.0], values_floats=[3.0, 4.0],
             default_float=-2.0),
        3,
        lambda x: np.where(x == 0.5, 3.0, np.where(x == -1.0, 4.0, -2.0)),
    ),
}


@pytest.mark.parametrize("name", PIECEWISE)
def test_piecewise_constant_branch_gives_nothing(name):
    """Y = X * F(X) with F piecewise constant: dY/dX = F(X) exactly, F's branch
    adds nothing (also at LabelEncoder's keys, where F jumps)."""
    spec, ml_opset, f = PIECEWISE[name]
    spec = dict(spec)
    op = spec.pop("op_type")
    x = RNG.standard_normal((4, 3)).astype(np.float32)
    x[0, 0], x[1, 2] = 0.5, -1.0
    r = RNG.standard_normal(x.shape).astype(np.float32)
    nodes = [helper.make_node(op, ["X"], ["F"], domain=ML, **spec),
             helper.make_node("Mul", ["X", "F"], ["Y"])]
    if ml_opset != 3:
        g = helper.make_node("Gradient", ["X"], ["dX"], domain=PREVIEW_DOMAIN, xs=["X"],
                             y="loss")
        loss = [helper.make_node("Mul", ["Y", "R"], ["w"]),
                helper.make_node("ReduceSum", ["w"], ["loss"], keepdims=0)]
        model = _model(nodes + loss + [g], {"X": x, "R": r}, [("dX", F32, [4, 3]), ("F", F32)],
                       17, ml_opset)
        expand_gradients(model.graph, model.opset_import, NameGen.from_graph(model.graph), ["X", "R"])
        dx, fx = Executor(model).run({"X": x, "R": r}, ["dX", "F"])
    else:
        dx = weighted_gradient(nodes, x, r)
        fx = f(x.astype(np.float64))
    np.testing.assert_allclose(fx, f(x.astype(np.float64)))
    np.testing.assert_allclose(dx, r * fx, rtol=1e-6)


def test_tree_classifier_and_one_hot_encoder_give_nothing():
    """loss = sum(X * R) + sum(scores) + sum(onehot): only the first term counts."""
    x = RNG.standard_normal((4, 3)).astype(np.float32)
    r = RNG.standard_normal((4, 3)).astype(np.float32)
    attrs = {k: v for k, v in TREE_ATTRS.items() if not k.startswith("target") and k != "n_targets"}
    clf = helper.make_node(
        "TreeEnsembleClassifier", ["X"], ["lab", "S"], domain=ML, classlabels_int64s=[0, 1],
        class_treeids=[0, 0], class_nodeids=[1, 2], class_ids=[0, 1], class_weights=[0.3, 0.7],
        **attrs,
    )
    ohe = helper.make_node("OneHotEncoder", ["X"], ["O"], domain=ML, cats_int64s=[0, 1],
                           zeros=1)
    nodes = [
        clf,
        ohe,
        helper.make_node("Mul", ["X", "R"], ["xr"]),
        helper.make_node("ReduceSum", ["xr"], ["a"], keepdims=0),
        helper.make_node("ReduceSum", ["S"], ["b"], keepdims=0),
        helper.make_node("ReduceSum", ["O"], ["c"], keepdims=0),
        helper.make_node("Sum", ["a", "b", "c"], ["loss"]),
    ]
    model = expand(nodes, {"X": x, "R": r}, "loss")
    (dx,) = Executor(model).run({"X": x, "R": r}, ["dX"])
    np.testing.assert_array_equal(dx, r)


# --------------------------------------------------------------- end to end


def test_standard_scaler_linear_regression_pipeline_trains():
    """skl2onnx's StandardScaler + LinearRegression (Scaler -> LinearRegressor)
    behind a trainable elementwise layer u = X * A + B.  The ml coefficients
    are attributes; A and B train, and their gradient flows through both ml
    ops.  SGD on onnxtrain matches SGD in numpy step by step."""
    rng = np.random.default_rng(7)
    offset, scale = np.array([0.5, -1.0, 2.0]), np.array([2.0, 0.5, 1.5])
    coef, intercept = np.array([0.7, -1.2, 0.4]), 0.3
    params = {"A": np.ones(3, np.float32), "B": np.zeros(3, np.float32)}
    main = [
        helper.make_node("Mul", ["X", "A"], ["xa"]),
        helper.make_node("Add", ["xa", "B"], ["u"]),
        helper.make_node("Scaler", ["u"], ["v"], domain=ML, offset=offset.tolist(),
                         scale=scale.tolist()),
        helper.make_node("LinearRegressor", ["v"], ["Y"], domain=ML,
                         coefficients=coef.tolist(), intercepts=[intercept]),
    ]
    loss = [helper.make_node("Sub", ["Y", "T"], ["diff"]),
            helper.make_node("Mul", ["diff", "diff"], ["sq"]),
            helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    lr = 0.05
    m = trainable_model(main, [vi("X", F32, ["N", 3])], [vi("Y", F32, ["N", 1])], params, loss,
                        vi("T", F32, ["N", 1]), "sgd", lr)
    m.opset_import.append(helper.make_opsetid(ML, 3))
    sess = TrainingSession(m)

    x = rng.standard_normal((16, 3)).astype(np.float32)
    t = (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3).astype(np.float32)
    a, b = params["A"].astype(np.float64), params["B"].astype(np.float64)
    x64, t64 = x.astype(np.float64), t.astype(np.float64)
    losses, expected = [], []
    for _ in range(12):
        u = x64 * a + b
        y = ((u - offset) * scale) @ coef[:, None] + intercept
        diff = y - t64
        expected.append(float(np.mean(diff**2)))
        du = (2 * diff / diff.size) @ coef[None, :] * scale
        a, b = a - lr * (du * x64).sum(axis=0), b - lr * du.sum(axis=0)
        losses.append(float(sess.train_step({"X": x, "T": t})["loss"]))
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    np.testing.assert_allclose(sess.state["A"], a, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(sess.state["B"], b, rtol=1e-4, atol=1e-5)
    assert losses[-1] < 0.5 * losses[0]
    np.testing.assert_allclose(sess.run({"X": x})["Y"], ((x64 * a + b - offset) * scale)
                               @ coef[:, None] + intercept, rtol=1e-4, atol=1e-4)


def test_normalizer_linear_classifier_pipeline_trains():
    """Normalizer(L2) -> LinearClassifier(SOFTMAX) after a trainable scale
    u = X * A, with the negative log-likelihood of the class scores: the loss
    goes down and the first gradient matches float64 central differences."""
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 3, 24)
    centers = np.array([[2.0, 0.2, 0.2], [0.2, 2.0, 0.2], [0.2, 0.2, 2.0]])
    x = (centers[labels] + 0.3 * rng.standard_normal((24, 3))).astype(np.float32)
    w = np.array([[1.0, 0.2, -0.3], [0.1, 0.9, 0.2], [-0.2, 0.3, 1.1]])
    params = {"A": np.array([1.0, 0.5, 2.0], np.float32)}
    main = [
        helper.make_node("Mul", ["X", "A"], ["u"]),
        helper.make_node("Normalizer", ["u"], ["v"], domain=ML, norm="L2"),
        helper.make_node("LinearClassifier", ["v"], ["label", "P"], domain=ML,
                         coefficients=w.ravel().tolist(), intercepts=[0.0, 0.1, -0.1],
                         classlabels_ints=[0, 1, 2], post_transform="SOFTMAX"),
    ]
    loss = [helper.make_node("Log", ["P"], ["logp"]),
            helper.make_node("NegativeLogLikelihoodLoss", ["logp", "T"], ["loss"],
                             reduction="mean")]
    m = trainable_model(main, [vi("X", F32, ["N", 3])], [vi("P", F32, ["N", 3])], params, loss,
                        vi("T", I64, ["N"]), "sgd", 0.5)
    m.opset_import.append(helper.make_opsetid(ML, 3))
    sess = TrainingSession(m)

    def numpy_loss(a):
        u = x.astype(np.float64) * a
        v = u / np.sqrt((u * u).sum(axis=1, keepdims=True))
        p = softmax(v @ w.T + np.array([0.0, 0.1, -0.1]))
        return -np.mean(np.log(p[np.arange(len(labels)), labels]))

    a0 = params["A"].astype(np.float64)
    numeric = np.array([(numpy_loss(a0 + e) - numpy_loss(a0 - e)) / 2e-6
                        for e in np.eye(3) * 1e-6])
    losses = [float(sess.train_step({"X": x, "T": labels})["loss"])]
    np.testing.assert_allclose(losses[0], numpy_loss(a0), rtol=1e-5)
    np.testing.assert_allclose(sess.state["A"], a0 - 0.5 * numeric, rtol=1e-4, atol=1e-5)
    for _ in range(20):
        losses.append(float(sess.train_step({"X": x, "T": labels})["loss"]))
    assert losses[-1] < losses[0]


def test_ml_outputs_without_declared_types_are_inferred_for_old_opsets():
    """onnx infers no type for Scaler's output; the engine seeds it (float, same
    rank), so the rules after it work at opset 11 without value_info."""
    from onnx import TensorProto, helper

    from onnxtrain import TrainingSession

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [3])
    nodes = [
        helper.make_node("Scaler", ["x"], ["s"], domain="ai.onnx.ml", offset=[0.5, 0.0, -1.0],
                         scale=[2.0, 3.0, 0.5]),
        helper.make_node("Mul", ["s", "w"], ["y"]),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
        helper.make_node("Gradient", ["w", "x"], ["dw", "dx"], domain="ai.onnx.preview.training",
                         xs=["w", "x"], y="loss"),
    ]
    graph = helper.make_graph(nodes, "g", [x, w], [
        helper.make_tensor_value_info("dw", TensorProto.FLOAT, [3]),
        helper.make_tensor_value_info("dx", TensorProto.FLOAT, ["N", 3])])
    model = helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 11), helper.make_opsetid("ai.onnx.ml", 3),
        helper.make_opsetid("ai.onnx.preview.training", 1)])
    model.ir_version = 8
    xv = np.arange(6, dtype=np.float32).reshape(2, 3)
    wv = np.array([1.0, -2.0, 0.5], np.float32)
    out = TrainingSession(model).run({"x": xv, "w": wv})
    scaled = (xv - np.array([0.5, 0.0, -1.0], np.float32)) * np.array([2.0, 3.0, 0.5], np.float32)
    np.testing.assert_allclose(out["dw"], scaled.sum(0), rtol=1e-6)
    np.testing.assert_allclose(out["dx"], np.tile(wv * [2.0, 3.0, 0.5], (2, 1)), rtol=1e-6)
