"""Adam, Momentum and Adagrad: the lowering to standard ops, run on onnxruntime,
against the numpy references (which follow the spec's pseudo-code), plus the
ONNX conformance node cases and the error cases."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.core.graph import PREVIEW_DOMAIN
from onnxtrain.core.names import NameGen
from onnxtrain.errors import TrainingModelError
from onnxtrain.optim import SIGNATURES, lower_optimizers, reference
from onnxtrain.runtime.executor import Executor

# Per-tensor state groups after X and G, and the output groups, per op.
STATE = {"Adam": ("V", "H"), "Momentum": ("V",), "Adagrad": ("H",)}

# Attribute sets: "default" leaves out every attribute that has a default
# (Momentum has none, so it gets plain values); "custom" sets all of them.
ATTRS = {
    ("Adam", "default"): {},
    ("Adam", "custom"): {
        "alpha": 0.8,
        "beta": 0.95,
        "epsilon": 1e-3,
        "norm_coefficient": 0.05,
        "norm_coefficient_post": 0.01,
    },
    ("Adagrad", "default"): {},
    ("Adagrad", "custom"): {"decay_factor": 0.3, "epsilon": 1e-2, "norm_coefficient": 0.02},
    ("Momentum", "default"): {"alpha": 0.9, "beta": 0.1, "norm_coefficient": 0.0},
    ("Momentum", "custom"): {"alpha": 0.7, "beta": 0.6, "norm_coefficient": 0.03},
}

# Tolerances against the reference, by X's element type.
TOL = {np.float32: dict(rtol=1e-5, atol=1e-6), np.float64: dict(rtol=1e-12, atol=1e-14)}

ONE_TENSOR = [(3, 4)]
SEVERAL_TENSORS = [(), (5,), (2, 3, 1)]


# ------------------------------------------------------------------ helpers
def _op_type(case: str) -> str:
    return "Momentum" if case.startswith("Momentum") else case


def _attrs(case: str, which: str) -> dict:
    op = _op_type(case)
    attrs = dict(ATTRS[(op, which)])
    if op == "Momentum":
        attrs["mode"] = case.split("-")[1]
    return attrs


def _tensor_names(op: str, n: int) -> dict[str, list[str]]:
    return {g: [f"{g}{i}" for i in range(1, n + 1)] for g in ("X", "G", *STATE[op])}


def make_model(
    op: str,
    shapes: list[tuple],
    x_type: int,
    r_type: int,
    attrs: dict,
    opset: int = 17,
    node_name: str = "opt",
) -> onnx.ModelProto:
    """A one-node model: inputs R, T and the per-tensor groups; outputs the new state."""
    names = _tensor_names(op, len(shapes))
    ins = ["R", "T"] + [v for g in names.values() for v in g]
    outs = [f"{v}_new" for g in ("X", *STATE[op]) for v in names[g]]
    node = helper.make_node(op, ins, outs, name=node_name, domain=PREVIEW_DOMAIN, **attrs)
    vi = helper.make_tensor_value_info
    inputs = [vi("R", r_type, []), vi("T", TensorProto.INT64, [])]
    for group in names.values():
        inputs += [vi(v, x_type, list(s)) for v, s in zip(group, shapes)]
    outputs = [vi(o, x_type, list(shapes[i % len(shapes)])) for i, o in enumerate(outs)]
    graph = helper.make_graph([node], "optimizer", inputs, outputs)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(PREVIEW_DOMAIN, 1)],
    )
    model.ir_version = 8
    return model


def lower(model: onnx.ModelProto) -> onnx.ModelProto:
    """A lowered copy of ``model`` that must pass the full checker."""
    lowered = copy.deepcopy(model)
    lower_optimizers(lowered.graph, lowered.opset_import, NameGen())
    assert not any(n.domain == PREVIEW_DOMAIN for n in lowered.graph.node)
    onnx.checker.check_model(lowered, full_check=True)
    return lowered


def random_state(op: str, shapes: list[tuple], dtype, rng: np.random.Generator) -> dict:
    """X, G and state values (H is an accumulated square, so non-negative)."""
    names = _tensor_names(op, len(shapes))
    feeds = {}
    for group, vs in names.items():
        for v, s in zip(vs, shapes):
            a = rng.standard_normal(s)
            feeds[v] = np.asarray(np.abs(a) if group == "H" else a, dtype=dtype)
    return feeds


def reference_step(op: str, feeds: dict, n: int, attrs: dict) -> list[np.ndarray]:
    """The reference outputs, in the node's output order.  Float attributes go
    in as the 32-bit values the model stores."""
    kw = {k: (v if isinstance(v, str) else float(np.float32(v))) for k, v in attrs.items()}
    names = _tensor_names(op, n)
    groups = {g: [feeds[v] for v in vs] for g, vs in names.items()}
    r, t = feeds["R"], feeds["T"]
    if op == "Adam":
        out = reference.adam(r, t, groups["X"], groups["G"], groups["V"], groups["H"], **kw)
    elif op == "Momentum":
        out = reference.momentum(r, t, groups["X"], groups["G"], groups["V"], **kw)
    else:
        out = reference.adagrad(r, t, groups["X"], groups["G"], groups["H"], **kw)
    return [a for group in out for a in group]


def output_names(model: onnx.ModelProto) -> list[str]:
    return [o.name for o in model.graph.output]


class ErrorLog:
    """Largest errors seen against the reference, printed at the end (-s)."""

    worst: dict[str, float] = {}

    @classmethod
    def record(cls, dtype, got, want) -> None:
        key = np.dtype(dtype).name
        err = float(np.max(np.abs(got - want) / (np.abs(want) + 1e-30), initial=0.0))
        cls.worst[key] = max(cls.worst.get(key, 0.0), err)


def assert_close(got, want, dtype) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.dtype(dtype)
    assert got.shape == want.shape
    ErrorLog.record(dtype, got, want)
    np.testing.assert_allclose(got, want, **TOL[np.dtype(dtype).type])


@pytest.fixture(scope="module", autouse=True)
def _report_errors():
    yield
    print(f"\nmax relative error vs reference: {ErrorLog.worst}")


# ------------------------------------------------- one step against the reference
CASES = ["Adam", "Momentum-standard", "Momentum-nesterov", "Adagrad"]
DTYPES = {
    "f32": (np.float32, TensorProto.FLOAT, np.float32, TensorProto.FLOAT),
    "f64": (np.float64, TensorProto.DOUBLE, np.float64, TensorProto.DOUBLE),
    "f64-R32": (np.float64, TensorProto.DOUBLE, np.float32, TensorProto.FLOAT),
}


@pytest.mark.parametrize("which", ["default", "custom"])
@pytest.mark.parametrize("shapes", [ONE_TENSOR, SEVERAL_TENSORS], ids=["one", "several"])
@pytest.mark.parametrize("types", list(DTYPES))
@pytest.mark.parametrize("case", CASES)
def test_step_matches_reference(case, types, shapes, which):
    op = _op_type(case)
    x_dtype, x_type, r_dtype, r_type = DTYPES[types]
    attrs = _attrs(case, which)
    model = make_model(op, shapes, x_type, r_type, attrs)
    ex = Executor(lower(model))
    rng = np.random.default_rng(len(shapes) * 7 + len(case))
    for t in [0, 1, 2, 3, 4, 5, 1000]:
        feeds = random_state(op, shapes, x_dtype, rng)
        feeds["R"] = np.asarray(0.05 + 0.1 * rng.random(), dtype=r_dtype)
        feeds["T"] = np.asarray(t, dtype=np.int64)
        got = ex.run(feeds, output_names(model))
        want = reference_step(op, feeds, len(shapes), attrs)
        for g, w in zip(got, want):
            assert_close(g, w, x_dtype)


# Opset 9 (Where, the newest op needed) up to 26.
@pytest.mark.parametrize("opset", [9, 11, 13, 21, 26])
@pytest.mark.parametrize("case", CASES)
def test_opsets(case, opset):
    op = _op_type(case)
    attrs = _attrs(case, "custom")
    model = make_model(op, SEVERAL_TENSORS, TensorProto.FLOAT, TensorProto.FLOAT, attrs, opset)
    ex = Executor(lower(model))
    rng = np.random.default_rng(opset)
    for t in (0, 3):
        feeds = random_state(op, SEVERAL_TENSORS, np.float32, rng)
        feeds["R"] = np.asarray(0.1, dtype=np.float32)
        feeds["T"] = np.asarray(t, dtype=np.int64)
        got = ex.run(feeds, output_names(model))
        for g, w in zip(got, reference_step(op, feeds, len(SEVERAL_TENSORS), attrs)):
            assert_close(g, w, np.float32)


def test_newest_onnx_opset_checks():
    """At the newest opset onnx knows, the lowered graph is still valid ONNX."""
    opset = onnx.defs.onnx_opset_version()
    for case in CASES:
        model = make_model(
            _op_type(case), ONE_TENSOR, TensorProto.FLOAT, TensorProto.FLOAT,
            _attrs(case, "custom"), opset,
        )
        lower(model)


# ---------------------------------------------------------- training loops
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_trajectory(case, dtype):
    """Feed the new state back in for 20 steps, T counting up, on a quadratic
    loss 0.5 * ||X - target||^2 (G = X - target)."""
    op = _op_type(case)
    attrs = _attrs(case, "custom")
    x_type = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    shapes = [(4,), (2, 3)]
    model = make_model(op, shapes, x_type, TensorProto.FLOAT, attrs)
    ex = Executor(lower(model))
    names = _tensor_names(op, len(shapes))
    rng = np.random.default_rng(3)
    targets = [rng.standard_normal(s).astype(dtype) for s in shapes]
    state = random_state(op, shapes, dtype, rng)
    for g, vs in names.items():
        if g not in ("X", "G"):  # optimizer state starts at zero
            for v in vs:
                state[v] = np.zeros_like(state[v])
    ours, theirs = dict(state), dict(state)
    start = {x: state[x].copy() for x in names["X"]}
    r = np.asarray(0.1, dtype=np.float32)
    state_groups = ("X", *STATE[op])
    for step in range(20):
        for run in (ours, theirs):
            for x, g, target in zip(names["X"], names["G"], targets):
                run[g] = run[x] - target
            run["R"], run["T"] = r, np.asarray(step, dtype=np.int64)
        got = ex.run(ours, output_names(model))
        want = reference_step(op, theirs, len(shapes), attrs)
        new_names = [v for g in state_groups for v in names[g]]
        for name, a, b in zip(new_names, got, want):
            assert_close(a, b, dtype)
            ours[name], theirs[name] = a, b
    # The loop optimizes: X moved towards the target.
    for x, target in zip(names["X"], targets):
        assert np.linalg.norm(ours[x] - target) < np.linalg.norm(start[x] - target)


# ------------------------------------------------------ ONNX conformance cases
CONFORMANCE = (
    "test_adagrad",
    "test_adagrad_multiple",
    "test_adam",
    "test_adam_multiple",
    "test_momentum",
    "test_nesterov_momentum",
    "test_momentum_multiple",
)


@pytest.fixture(scope="module")
def conformance_cases():
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = {t.name: _loaded(t) for t in load_model_tests(kind="node") if t.name in CONFORMANCE}
    assert sorted(cases) == sorted(CONFORMANCE)
    return cases


def _loaded(case):
    """The case with its model and data sets read: onnx < 1.23 leaves them in
    ``case.model_dir`` (model.onnx, test_data_set_*/{input,output}_*.pb)."""
    if case.model is not None and case.data_sets:
        return case
    import glob
    import os

    from onnx import numpy_helper

    def read(path):
        t = onnx.TensorProto()
        with open(path, "rb") as f:
            t.ParseFromString(f.read())
        return numpy_helper.to_array(t)

    model = onnx.load(os.path.join(case.model_dir, "model.onnx"))
    data_sets = []
    for d in sorted(glob.glob(os.path.join(case.model_dir, "test_data_set_*"))):
        n_in = len(glob.glob(os.path.join(d, "input_*.pb")))
        n_out = len(glob.glob(os.path.join(d, "output_*.pb")))
        data_sets.append((
            [read(os.path.join(d, f"input_{i}.pb")) for i in range(n_in)],
            [read(os.path.join(d, f"output_{i}.pb")) for i in range(n_out)],
        ))
    import dataclasses

    return dataclasses.replace(case, model=model, data_sets=data_sets)


@pytest.mark.parametrize("name", CONFORMANCE)
def test_conformance(conformance_cases, name):
    case = conformance_cases[name]
    model = copy.deepcopy(case.model)
    # The cases import only the preview domain; the lowering needs the default one.
    model.opset_import.append(helper.make_opsetid("", 17))
    model.ir_version = 8
    lowered = lower(model)
    ex = Executor(lowered)
    node = case.model.graph.node[0]
    sig = SIGNATURES[node.op_type]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
    assert case.data_sets
    for inputs, expected in case.data_sets:
        feeds = {vi.name: a for vi, a in zip(case.model.graph.input, inputs)}
        got = ex.run(feeds, [o.name for o in case.model.graph.output])
        n = (len(inputs) - 2) // len(sig.groups)
        groups = [inputs[2 + j * n : 2 + (j + 1) * n] for j in range(len(sig.groups))]
        if node.op_type == "Adam":
            want = reference.adam(inputs[0], inputs[1], *groups, **attrs)
        elif node.op_type == "Momentum":
            want = reference.momentum(inputs[0], inputs[1], *groups, **attrs)
        else:
            want = reference.adagrad(inputs[0], inputs[1], *groups, **attrs)
        want = [a for group in want for a in group]
        assert len(got) == len(want) == len(expected)
        for g, w, e in zip(got, want, expected):
            np.testing.assert_allclose(g, e, rtol=1e-3, atol=1e-7)
            np.testing.assert_allclose(w, e, rtol=1e-3, atol=1e-7)
            assert_close(g, w, e.dtype)


# ------------------------------------------------------------- graph surgery
def test_in_place_within_a_graph():
    """The replacement sits where the node was: upstream and downstream nodes,
    graph outputs and a second optimizer node keep working; unused outputs ('')
    are fine."""
    vi = helper.make_tensor_value_info
    F = TensorProto.FLOAT
    nodes = [
        helper.make_node("Mul", ["X", "X"], ["G"], name="grad"),  # d(x^3/3)/dx
        helper.make_node(
            "Adagrad", ["R", "T", "X", "G", "H"], ["X_new", ""], name="ada",
            domain=PREVIEW_DOMAIN, epsilon=1e-3,
        ),
        helper.make_node(
            "Momentum", ["R", "T", "Y", "G", "V"], ["Y_new", "V_new"], name="mom",
            domain=PREVIEW_DOMAIN, alpha=0.9, beta=0.5, mode="nesterov", norm_coefficient=0.1,
        ),
        helper.make_node("Add", ["X_new", "Y_new"], ["S"], name="after"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [vi("R", F, []), vi("T", TensorProto.INT64, [])] + [vi(v, F, [3]) for v in "XHYV"],
        [vi("S", F, [3]), vi("V_new", F, [3])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(PREVIEW_DOMAIN, 1)]
    )
    model.ir_version = 8
    lowered = lower(model)
    kept = [n.name for n in lowered.graph.node if n.name in ("grad", "after")]
    assert kept == ["grad", "after"]
    assert lowered.graph.node[0].name == "grad" and lowered.graph.node[-1].name == "after"

    rng = np.random.default_rng(0)
    feeds = {v: rng.standard_normal(3).astype(np.float32) for v in "XYV"}
    feeds["H"] = np.abs(rng.standard_normal(3)).astype(np.float32)
    feeds["R"], feeds["T"] = np.asarray(0.1, np.float32), np.asarray(2, np.int64)
    s, v_new = Executor(lowered).run(feeds, ["S", "V_new"])
    g = feeds["X"] * feeds["X"]
    (x_new,), _ = reference.adagrad(
        feeds["R"], feeds["T"], [feeds["X"]], [g], [feeds["H"]], epsilon=float(np.float32(1e-3))
    )
    (y_new,), (v_ref,) = reference.momentum(
        feeds["R"], feeds["T"], [feeds["Y"]], [g], [feeds["V"]],
        alpha=float(np.float32(0.9)), beta=0.5, mode="nesterov",
        norm_coefficient=float(np.float32(0.1)),
    )
    assert_close(s, x_new + y_new, np.float32)
    assert_close(v_new, v_ref, np.float32)


def test_graph_without_optimizers_is_untouched():
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [vi("x", TensorProto.FLOAT, [2])], [vi("y", TensorProto.FLOAT, [2])],
    )
    before = graph.SerializeToString()
    lower_optimizers(graph, [helper.make_opsetid("", 17)], NameGen())
    assert graph.SerializeToString() == before


def test_defaults_match_the_schemas():
    """Signature defaults (Python floats) are the schemas' float32 defaults."""
    for op, sig in SIGNATURES.items():
        schema = onnx.defs.get_schema(op, 1, PREVIEW_DOMAIN)
        assert set(schema.attributes) == set(sig.attrs)
        for name, attr in schema.attributes.items():
            if sig.attrs[name] is None:
                assert attr.required
            else:
                assert not attr.required
                assert np.float32(sig.attrs[name]) == np.float32(attr.default_value.f)


# --------------------------------------------------------------- error cases
def _lower_raises(model: onnx.ModelProto, *fragments: str) -> None:
    with pytest.raises(TrainingModelError) as info:
        lower_optimizers(model.graph, model.opset_import, NameGen())
    for fragment in fragments:
        assert fragment in str(info.value)


def _model_with_node(
    op: str, ins, outs, attrs,
    x_type=TensorProto.FLOAT, t_type=TensorProto.INT64, opset=17, imports=None,
):
    vi = helper.make_tensor_value_info
    node = helper.make_node(op, ins, outs, name="bad_opt", domain=PREVIEW_DOMAIN, **attrs)
    inputs = [vi(ins[0], TensorProto.FLOAT, []), vi(ins[1], t_type, [])] if len(ins) > 1 else []
    inputs += [vi(v, x_type, [2]) for v in ins[2:] if v]
    graph = helper.make_graph([node], "g", inputs, [vi(o, x_type, [2]) for o in outs if o])
    if imports is None:
        imports = [helper.make_opsetid("", opset), helper.make_opsetid(PREVIEW_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=imports)


MOMENTUM_ATTRS = {"alpha": 0.9, "beta": 0.1, "mode": "standard", "norm_coefficient": 0.0}


@pytest.mark.parametrize(
    "op,ins,outs,attrs,fragments",
    [
        ("Adam", ["R", "T", "X", "G", "V"], ["X2", "V2"], {}, ["2 + 4*n inputs", "found 5"]),
        ("Adam", ["R", "T"], [], {}, ["2 + 4*n inputs", "found 2"]),
        ("Adagrad", ["R", "T", "X1", "X2", "G1", "G2", "H1"], ["a"], {}, ["2 + 3*n", "found 7"]),
        ("Momentum", ["R", "T", "X", "G", "V", "X9"], ["X2", "V2"], MOMENTUM_ATTRS, ["2 + 3*n"]),
        ("Adagrad", ["R", "T", "X", "G", "H"], ["X2"], {}, ["need 2 outputs", "found 1"]),
        ("Adam", ["R", "T", "X", "G", "V", "H"], ["X2", "V2", "H2", "Z"], {}, ["need 3 outputs"]),
        ("Adagrad", ["R", "T", "X", "", "H"], ["X2", "H2"], {}, ["input 3 is empty"]),
    ],
)
def test_arity_errors(op, ins, outs, attrs, fragments):
    _lower_raises(_model_with_node(op, ins, outs, attrs), "bad_opt", op, *fragments)


@pytest.mark.parametrize("missing", sorted(MOMENTUM_ATTRS))
def test_momentum_required_attributes(missing):
    attrs = {k: v for k, v in MOMENTUM_ATTRS.items() if k != missing}
    model = _model_with_node("Momentum", ["R", "T", "X", "G", "V"], ["X2", "V2"], attrs)
    _lower_raises(model, "bad_opt", "required attribute", repr(missing))


@pytest.mark.parametrize(
    "op,attrs,fragments",
    [
        ("Momentum", {**MOMENTUM_ATTRS, "mode": "heavy"}, ["'standard' or 'nesterov'", "heavy"]),
        ("Adam", {"alpha": 1}, ["'alpha' must be a FLOAT", "found INT"]),
        ("Adam", {"learning_rate": 0.1}, ["unknown attribute 'learning_rate'"]),
        ("Adagrad", {"mode": "standard"}, ["unknown attribute 'mode'"]),
        ("Momentum", {**MOMENTUM_ATTRS, "mode": 1}, ["'mode' must be a STRING"]),
    ],
)
def test_attribute_errors(op, attrs, fragments):
    groups = ("X", "G", *STATE[op])
    outs = [f"{g}_new" for g in ("X", *STATE[op])]
    model = _model_with_node(op, ["R", "T", *groups], outs, attrs)
    _lower_raises(model, "bad_opt", *fragments)


def test_type_errors():
    ins, outs = ["R", "T", "X", "G", "H"], ["X2", "H2"]
    _lower_raises(
        _model_with_node("Adagrad", ins, outs, {}, x_type=TensorProto.INT32),
        "bad_opt", "FLOAT or DOUBLE", "INT32",
    )
    _lower_raises(
        _model_with_node("Adagrad", ins, outs, {}, t_type=TensorProto.FLOAT),
        "bad_opt", "T 'T' must be INT64",
    )
    mixed = _model_with_node("Adagrad", ins, outs, {})
    mixed.graph.input[3].type.tensor_type.elem_type = TensorProto.DOUBLE  # G
    _lower_raises(mixed, "bad_opt", "share one element type", "G: DOUBLE")


def test_opset_errors():
    ins, outs = ["R", "T", "X", "G", "H"], ["X2", "H2"]
    _lower_raises(_model_with_node("Adagrad", ins, outs, {}, opset=8), "opset >= 9", "opset 8")
    no_default = [helper.make_opsetid(PREVIEW_DOMAIN, 1)]
    _lower_raises(
        _model_with_node("Adagrad", ins, outs, {}, imports=no_default),
        "no import of the default domain",
    )


def test_nested_optimizer_is_refused():
    vi = helper.make_tensor_value_info
    F = TensorProto.FLOAT
    inner = helper.make_node(
        "Adagrad", ["R", "T", "X", "G", "H"], ["X2", "H2"], name="deep", domain=PREVIEW_DOMAIN
    )
    branch = helper.make_graph([inner], "b", [], [vi("X2", F, [2])])
    node = helper.make_node(
        "If", ["c"], ["out"], name="cond", then_branch=branch, else_branch=branch
    )
    graph = helper.make_graph(
        [node], "g", [vi("c", TensorProto.BOOL, [])] + [vi(v, F, [2]) for v in "RTXGH"],
        [vi("out", F, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    _lower_raises(model, "'deep'", "inside a subgraph", "'cond'")


def test_reference_rejects_bad_arguments():
    x = [np.zeros(2, np.float32)]
    with pytest.raises(ValueError, match="nesterov"):
        reference.momentum(0.1, 0, x, x, x, alpha=0.9, beta=0.1, mode="fast", norm_coefficient=0)
    with pytest.raises(ValueError, match="equally long"):
        reference.adagrad(0.1, 0, x, x + x, x)
    with pytest.raises(ValueError, match="float32 or float64"):
        reference.adam(0.1, 0, [np.zeros(2, np.int64)], x, x, x)
