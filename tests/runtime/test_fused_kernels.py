"""The fused optimizer kernels (onnxtrain/kernels): the rewrites, the library, the fallbacks.

The calls of the update rules that name a kernel (onnxtrain.optim.rules):
the builder's Adam/AdamW (AdamUpdate), and the lowered spec ops: Adam
(SpecAdam, AdamStepSize), Momentum (Momentum, Nesterov) and Adagrad
(Adagrad).

The fused program must give bit-for-bit the standard program's results, so
each check runs both and compares exactly."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from models import PREVIEW, linear_regression, mlp_classifier
from onnx import TensorProto, helper
from test_build import TorchRule, assert_trajectories_close, blobs, initial_params, mlp, run_oracle, run_session
from test_optim import _attrs, lower, make_model, random_state

from onnxtrain import TrainingSession, build
from onnxtrain.core.emitter import Emitter
from onnxtrain.core.names import NameGen
from onnxtrain.kernels import fuse
from onnxtrain.kernels import library as kernels
from onnxtrain.kernels.fuse import KERNEL_DOMAIN, fuse_rule_calls, with_fused_kernels
from onnxtrain.optim import apply

needs_library = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
ALGORITHM = "training_info[0].algorithm"


def fused_ops(sess: TrainingSession) -> list[str]:
    prog = sess.programs(executed=True)[ALGORITHM]
    return [n.op_type for n in prog.graph.node if n.domain == KERNEL_DOMAIN]


#: The spec Adam's step size, fused beside its updates (rule AdamStepSize).
STEP_SIZE = ("AdamStepSizeF32", "AdamStepSizeF64")


def optimizer_rewrites(model):
    """``with_fused_kernels``, and how many optimizer updates it fused (a spec
    Adam node's step size, one AdamStepSize node, is not one of them)."""
    fused, count = with_fused_kernels(model)
    return fused, count - sum(n.op_type in STEP_SIZE for n in fused.graph.node)


def train(model, x, labels, steps, **kwargs):
    sess = TrainingSession(model, **kwargs)
    losses = [float(sess.train_step({"X": x, "target": labels})["loss"]) for _ in range(steps)]
    return sess, losses


@needs_library
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("optimizer", [
    build.AdamW(0.05, weight_decay=0.1),
    build.Adam(0.05),
    build.Adam(0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01),  # L2: g + wd p feeds the kernel
])
def test_fused_equals_standard_bit_for_bit(dtype, optimizer):
    model = mlp(sizes=(4, 16, 3), dtype=dtype)
    x, labels = blobs(dtype=dtype)
    tm = build.training_model(model, loss="cross_entropy", optimizer=optimizer)
    fused, fused_losses = train(tm, x, labels, 12, fused_kernels=True)
    plain, plain_losses = train(tm, x, labels, 12, fused_kernels=False)
    suffix = "F32" if dtype == np.float32 else "F64"
    assert fused_ops(fused) == [f"AdamUpdate{suffix}"] * 4  # W1, b1, W2, b2
    assert fused_ops(plain) == []
    assert fused_losses == plain_losses
    for name, value in plain.state.items():
        np.testing.assert_array_equal(fused.state[name], value, err_msg=name)
    assert fused_losses[-1] < fused_losses[0]


@needs_library
def test_default_session_fuses_and_follows_the_numpy_adamw_rule():
    """float64, 30 steps (bias corrections with t > 1), against a numpy transcription."""
    model = mlp(sizes=(4, 6, 3), dtype=np.float64)
    x, labels = blobs(dtype=np.float64)
    hp = dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    tm = build.training_model(model, loss="cross_entropy", optimizer=build.AdamW(0.02, **hp))
    expected = run_oracle(initial_params(model), TorchRule("adamw", **hp), 0.02, x, labels, 30)
    sess, got = run_session(tm, x, labels, 30)
    assert len(fused_ops(sess)) == 4  # the default (fused_kernels=None) uses the library
    assert_trajectories_close(got, expected, rtol=1e-10, atol=1e-12)


ADAM_SCALARS = {"b1": 0.9, "c1": 0.1, "b2": 0.999, "c2": 0.001, "eps": 1e-8, "step": 0.01, "decay": 0.99}


def _adam_graph(shape=(3, 4), dtype=TensorProto.FLOAT, extra_reader=None, decay=True):
    """One call of the rule Adam (as build.AdamW applies it) over graph inputs
    p, g, m, v and Constant scalars; ``extra_reader``: the k-th node of the
    call whose output is also a graph output."""
    def vi(name, s):
        return helper.make_tensor_value_info(name, dtype, list(s))
    e = Emitter(17, NameGen(["p", "g", "m", "v"]), {n: dtype for n in "pgmv"})
    scalars = {k: e.const(v, dtype=dtype) for k, v in ADAM_SCALARS.items() if decay or k != "decay"}
    start = len(e.nodes)
    out = apply(e, "Adam", {**scalars, "p": "p", "g": "g", "m": "m", "v": "v"},
                {"p_new": "p_new", "m_new": "m_new", "v_new": "v_new"})
    outputs = [vi(out[k], shape) for k in ("p_new", "m_new", "v_new")]
    if extra_reader is not None:
        outputs.append(vi(e.nodes[start + extra_reader].output[0], shape))
    graph = helper.make_graph(e.nodes, "adam", [vi(n, shape) for n in ("p", "g", "m", "v")], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_rewrite_replaces_a_call_by_name():
    """The call's operands become the kernel's inputs in the kernel's order
    (tensors first for AdamUpdate); nothing of its twelve ops is left."""
    model = _adam_graph()
    fused, count = with_fused_kernels(model)
    assert count == 1
    node = next(n for n in fused.graph.node if n.domain == KERNEL_DOMAIN)
    constant = {n.output[0]: n for n in model.graph.node if n.op_type == "Constant"}
    assert node.op_type == "AdamUpdateF32"
    assert list(node.input[:4]) == ["p", "g", "m", "v"]
    values = [float(onnx.numpy_helper.to_array(constant[i].attribute[0].t)) for i in node.input[4:]]
    assert values == [float(np.float32(v)) for v in ADAM_SCALARS.values()]
    assert list(node.output) == ["p_new", "m_new", "v_new"]
    assert {o.domain for o in fused.opset_import} >= {"", KERNEL_DOMAIN}
    assert [n.op_type for n in fused.graph.node if n.op_type != "Constant"] == ["AdamUpdateF32"]


def test_rewrite_without_decay_adds_a_constant_one():
    model = _adam_graph(decay=False)
    fused, count = optimizer_rewrites(model)
    assert count == 1
    node = next(n for n in fused.graph.node if n.domain == KERNEL_DOMAIN)
    assert node.input[0] == "p"
    one = next(t for t in fused.graph.initializer if t.name == node.input[10])
    assert onnx.numpy_helper.to_array(one) == 1


@pytest.mark.parametrize("reader", [0, 2, 5, 8, 10, 11])  # Mul(p, decay), c1 g, g g, Sqrt, Div, step .
def test_rewrite_leaves_calls_whose_intermediates_are_read(reader):
    """A value inside the call that something else reads must still be computed: no rewrite."""
    model = _adam_graph(extra_reader=reader)
    assert fuse_rule_calls(model.graph, list(model.opset_import)) == 0


@pytest.mark.parametrize("shape,dtype", [((3, 4), TensorProto.FLOAT16), (("N", 4), TensorProto.FLOAT),
                                         ((1, 1, 1, 1, 1, 1, 1, 1, 2), TensorProto.FLOAT)])
def test_rewrite_needs_static_float_shapes_of_rank_at_most_8(shape, dtype):
    model = _adam_graph(shape=shape, dtype=dtype)
    assert fuse_rule_calls(model.graph, list(model.opset_import)) == 0


@pytest.mark.parametrize("shape", [(), (1,), (0, 3)])
def test_rewrite_takes_one_element_and_empty_parameters(shape):
    model = _adam_graph(shape=shape)
    assert fuse_rule_calls(model.graph, list(model.opset_import)) == 1


def _rename_nodes(model):
    for k, n in enumerate(model.graph.node):
        n.name = f"node{k}"


@pytest.mark.parametrize("change", ["names", "op", "missing", "operand"])
def test_rewrite_matches_no_arithmetic_only_intact_calls(change):
    """The rewrite finds a call by its nodes' names and checks it against the
    rule's body: the same arithmetic under other names is not fused, nor is a
    call one of whose ops, nodes or operands a pass changed."""
    model = _adam_graph()
    nodes = [n for n in model.graph.node if n.op_type != "Constant"]
    if change == "names":
        _rename_nodes(model)
    elif change == "op":
        next(n for n in nodes if n.op_type == "Sqrt").op_type = "Abs"
    elif change == "missing":  # Sqrt(v') + eps -> v' + eps: the Sqrt node gone
        sqrt = next(n for n in nodes if n.op_type == "Sqrt")
        for n in nodes:
            n.input[:] = [sqrt.input[0] if i == sqrt.output[0] else i for i in n.input]
        model.graph.node.remove(sqrt)
    else:  # c2*(g*g) reads another tensor than c1*g: not the rule's one gradient
        gg = next(n for n in nodes if n.op_type == "Mul" and n.input[0] == n.input[1] == "g")
        gg.input[:] = ["m", "m"]
    before = model.SerializeToString()
    assert fuse_rule_calls(model.graph, list(model.opset_import)) == 0
    assert model.SerializeToString() == before


@needs_library
def test_kernel_rejects_mismatched_operands_with_an_error():
    """The kernel checks its operands and fails the run (no crash, no garbage)."""
    model = with_fused_kernels(_adam_graph())[0]
    node = next(n for n in model.graph.node if n.domain == KERNEL_DOMAIN)
    # Feed g with fewer elements than p: declare it dynamic so onnxruntime accepts the feed.
    g_in = next(i for i in model.graph.input if i.name == "g")
    g_in.type.tensor_type.shape.dim[0].dim_param = "G"
    model.ir_version = 8
    so = ort.SessionOptions()
    so.register_custom_ops_library(kernels.library())
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    f = np.ones((3, 4), np.float32)
    out = sess.run(None, {"p": f, "g": f, "m": f, "v": f})
    assert all(o.shape == (3, 4) for o in out)
    with pytest.raises(Exception, match="same number of elements"):
        sess.run(None, {"p": f, "g": np.ones((2, 4), np.float32), "m": f, "v": f})
    assert node.op_type == "AdamUpdateF32"


def test_environment_turns_the_library_off(monkeypatch):
    monkeypatch.setenv("ONNXTRAIN_FUSED_KERNELS", "0")
    assert kernels.library() is None
    assert "off" in kernels.status()
    model = mlp()
    x, labels = blobs()
    tm = build.training_model(model, optimizer=build.AdamW(0.01))
    sess = TrainingSession(tm)
    assert fused_ops(sess) == []
    sess.train_step({"X": x, "target": labels})
    with pytest.raises(RuntimeError, match="off"):
        TrainingSession(tm, fused_kernels=True)


def test_no_compiler_falls_back_to_standard_kernels(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ONNXTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    kernels._reset_for_tests()
    try:
        assert kernels.library() is None
        assert "no C compiler" in kernels.status()
        model = mlp()
        x, labels = blobs()
        tm = build.training_model(model, optimizer=build.AdamW(0.01))
        sess = TrainingSession(tm)
        before = sess.state["W1"].copy()
        sess.train_step({"X": x, "target": labels})
        assert not np.array_equal(sess.state["W1"], before)
        assert fused_ops(sess) == []
        assert "no C compiler" in sess.fused_kernels_note
        with pytest.raises(RuntimeError, match="no C compiler"):
            TrainingSession(tm, fused_kernels=True)
    finally:
        monkeypatch.undo()
        kernels._reset_for_tests()


@needs_library
def test_failed_build_reports_the_compiler_error(monkeypatch, tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'broken toolchain' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("ONNXTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    kernels._reset_for_tests()
    try:
        assert kernels.library() is None
        assert "broken toolchain" in kernels.status()
        assert not any((tmp_path / "cache").glob("*.so"))  # no half-written library left
    finally:
        monkeypatch.undo()
        kernels._reset_for_tests()


@needs_library
def test_library_is_cached_by_source_hash(monkeypatch, tmp_path):
    monkeypatch.setenv("ONNXTRAIN_CACHE_DIR", str(tmp_path))
    kernels._reset_for_tests()
    try:
        path = kernels.library()
        assert path is not None and path.startswith(str(tmp_path))
        mtime = (tmp_path / path.rsplit("/", 1)[1]).stat().st_mtime_ns
        kernels._reset_for_tests()
        assert kernels.library() == path  # found, not rebuilt
        assert (tmp_path / path.rsplit("/", 1)[1]).stat().st_mtime_ns == mtime
    finally:
        monkeypatch.undo()
        kernels._reset_for_tests()


@needs_library
def test_fused_kernels_true_is_refused_off_cpu():
    model = mlp()
    tm = build.training_model(model, optimizer=build.AdamW(0.01))
    with pytest.raises(ValueError, match="CPU"):
        TrainingSession(tm, providers=["CUDAExecutionProvider"], fused_kernels=True)
    with pytest.raises(TypeError):
        TrainingSession(tm, fused_kernels="yes")


# ----------------------------------------------- spec ops: Adam, Momentum, Adagrad
#: optimizer of tests/models.py, attributes set on its node, fused op.
SPEC_CASES = {
    "adam": ("adam", {}, "SpecAdam"),
    "adam-nc": ("adam", {"norm_coefficient": 0.01}, "SpecAdam"),
    "adam-post": ("adam", {"norm_coefficient_post": 0.001}, "SpecAdam"),
    "adam-nc-post": ("adam", {"alpha": 0.8, "beta": 0.95, "epsilon": 1e-3, "norm_coefficient": 0.05,
                              "norm_coefficient_post": 0.01}, "SpecAdam"),
    "momentum": ("momentum", {"beta": 0.1}, "Momentum"),
    "momentum-nc": ("momentum", {"alpha": 0.7, "beta": 0.6, "norm_coefficient": 0.03}, "Momentum"),
    "nesterov": ("nesterov", {"norm_coefficient": 0.0}, "Nesterov"),
    "nesterov-nc": ("nesterov", {}, "Nesterov"),  # norm_coefficient 0.001
    "adagrad": ("adagrad", {}, "Adagrad"),  # decay_factor 0.1
    "adagrad-nc": ("adagrad", {"decay_factor": 0.3, "epsilon": 1e-2, "norm_coefficient": 0.02}, "Adagrad"),
}
#: Outputs per optimized tensor of each fused op (the new X and state).
PER_OUT = {"SpecAdam": 3, "Momentum": 2, "Nesterov": 2, "Adagrad": 2}


def spec_model(case: str, net: str, dtype):
    """A hand-written training model (Gradient + the spec op + a step counter
    from T = 0) of tests/models.py, with the case's optimizer attributes."""
    optimizer, attrs, _ = SPEC_CASES[case]
    if net == "linreg":  # W [3, 1] and a one-element bias
        tm = linear_regression(optimizer, dtype=dtype, lr=0.05)
        rng = np.random.default_rng(4)
        x = rng.standard_normal((16, 3)).astype(dtype)
        feeds = {"X": x, "T": (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3).astype(dtype)}
    else:
        tm = mlp_classifier(optimizer, sizes=(4, 16, 3), lr=0.05, dtype=dtype)
        x, labels = blobs(dtype=dtype)
        feeds = {"X": x, "label": labels}
    node = next(n for n in tm.training_info[0].algorithm.node
                if n.domain == PREVIEW and n.op_type != "Gradient")
    for name, value in attrs.items():
        for a in node.attribute:
            if a.name == name:
                node.attribute.remove(a)
                break
        node.attribute.append(helper.make_attribute(name, value))
    return tm, feeds


def spec_ops(sess: TrainingSession) -> list[tuple[str, int]]:
    """The fused nodes of the executed program: (op, number of tensors updated)."""
    prog = sess.programs(executed=True)[ALGORITHM]
    return [(n.op_type, len(n.output) // PER_OUT[n.op_type[:-3]])
            for n in prog.graph.node if n.domain == KERNEL_DOMAIN and n.op_type not in STEP_SIZE]


def run_steps(tm, feeds, steps=12, **kwargs):
    sess = TrainingSession(tm, **kwargs)
    losses = [float(sess.train_step(feeds)["loss"]) for _ in range(steps)]
    return sess, losses


@needs_library
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("net", ["mlp", "mlp-per-tensor", "linreg"])
@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_spec_op_fused_equals_standard_bit_for_bit(case, net, dtype, monkeypatch):
    """12 steps from T = 0 (Adam's uncorrected and corrected steps, Momentum's
    beta_adjusted = 1 then beta): every loss and state bit for bit.  "mlp"
    batches its four tensors into one multi-tensor node per optimizer node;
    "mlp-per-tensor" gives each its own node; "linreg" updates a one-element
    bias."""
    if net == "mlp-per-tensor":
        monkeypatch.setattr(fuse, "BATCH_BELOW", 1)
        # A rewrite made with a patched threshold must not reach the program cache.
        monkeypatch.setenv("ONNXTRAIN_PROGRAM_CACHE", "0")
    tm, feeds = spec_model(case, "linreg" if net == "linreg" else "mlp", dtype)
    fused, fused_losses = run_steps(tm, feeds, fused_kernels=True)
    plain, plain_losses = run_steps(tm, feeds, fused_kernels=False)
    op = SPEC_CASES[case][2] + ("F32" if dtype == np.float32 else "F64")
    found = spec_ops(fused)
    assert {o for o, _ in found} == {op}
    assert sum(k for _, k in found) == (2 if net == "linreg" else 4)  # every parameter fused
    if net == "mlp-per-tensor":
        assert all(k == 1 for _, k in found)
    elif "-nc" in case:
        # Where the Gemm fusion folded nc*W + dW into the weight gradient's
        # Gemm, the weights take the kernel without nc: a second node.
        assert len(found) <= 2
    else:
        assert len(found) == 1  # one multi-tensor node
    assert spec_ops(plain) == []
    # the spec Adam's step size (T = 0 uncorrected, then corrected): one kernel
    assert sum(o in STEP_SIZE for o in fused_ops(fused)) == (SPEC_CASES[case][0] == "adam")
    assert fused_losses == plain_losses
    for name, value in plain.state.items():
        np.testing.assert_array_equal(fused.state[name], value, err_msg=name)
    assert fused_losses[-1] < fused_losses[0]


@needs_library
def test_spec_op_with_gemm_folded_regularization_splits_into_two_nodes():
    """With norm_coefficient the Gemm fusion folds nc*W + dW into the weight
    gradient's Gemm; the weights then take the kernel without nc, the biases
    the one with nc: two multi-tensor nodes, both exact."""
    tm, feeds = spec_model("nesterov-nc", "mlp", np.float32)
    sess, _ = run_steps(tm, feeds, steps=2, fused_kernels=True)
    prog = sess.programs(executed=True)[ALGORITHM]
    nodes = [n for n in prog.graph.node if n.domain == KERNEL_DOMAIN]
    assert sorted(len(n.output) // 2 for n in nodes) == [2, 2]
    assert sorted(n.input[4] != "" for n in nodes) == [False, True]  # nc: absent, present


def _ort(model, library=None):
    so = ort.SessionOptions()
    if library:
        so.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


SPEC_OPS = {"Adam": "SpecAdam", "Adagrad": "Adagrad", "Momentum-standard": "Momentum",
            "Momentum-nesterov": "Nesterov"}


@needs_library
@pytest.mark.parametrize("which", ["default", "custom"])
@pytest.mark.parametrize("case", list(SPEC_OPS))
@pytest.mark.parametrize("x_type", [TensorProto.FLOAT, TensorProto.DOUBLE])
def test_spec_op_lowering_fuses_every_tensor_shape(case, which, x_type):
    """One optimizer node over a 0-d, a one-element, an empty, a small and a
    large tensor: the large one gets its own node, the others share one; the
    outputs equal the standard program's bit for bit at T = 0, 1 and 7."""
    op = case.split("-")[0]
    shapes = [(), (1,), (0, 3), (2, 3), (300, 300)]
    model = lower(make_model(op, shapes, x_type, TensorProto.FLOAT, _attrs(case, which)))
    fused, count = optimizer_rewrites(model)
    assert count == len(shapes)
    nodes = [n for n in fused.graph.node if n.domain == KERNEL_DOMAIN and n.op_type not in STEP_SIZE]
    assert sum(n.op_type in STEP_SIZE for n in fused.graph.node) == (op == "Adam")
    name = SPEC_OPS[case] + ("F32" if x_type == TensorProto.FLOAT else "F64")
    per_out = PER_OUT[SPEC_OPS[case]]
    assert [(n.op_type, len(n.output) // per_out) for n in nodes] == [(name, 4), (name, 1)]
    dtype = np.float32 if x_type == TensorProto.FLOAT else np.float64
    feeds = random_state(op, shapes, dtype, np.random.default_rng(1))
    feeds["R"] = np.array(0.1, np.float32)
    standard, fast = _ort(model), _ort(fused, kernels.library())
    for t in (0, 1, 7):
        feeds["T"] = np.array(t, np.int64)
        for a, b in zip(standard.run(None, feeds), fast.run(None, feeds)):
            assert a.shape == b.shape
            np.testing.assert_array_equal(a, b)


def _lowered_adam(shapes=((3, 4),), attrs=None):
    return lower(make_model("Adam", list(shapes), TensorProto.FLOAT, TensorProto.FLOAT, attrs or {}))


def _adam_chain(model) -> dict[str, str]:
    """Intermediates of X1's lowered Adam update, by role."""
    producer = {o: n for n in model.graph.node for o in n.output}
    step = producer["X1_new"].input[1]                  # X - step
    den = producer[step].input[1]                       # r*V' / den
    sqrt = producer[den].input[0]                       # Sqrt(H') + eps
    scaled_v = producer[step].input[0]                  # r * V'
    h_terms = producer["H1_new"].input                  # beta*H + ((1-beta)*gr)*gr
    gr_sq = next(t for t in h_terms if producer[t].input[1] == "G1")
    return {"step": step, "den": den, "sqrt": sqrt, "scaled_v": scaled_v, "gr_sq": gr_sq,
            "gr_scaled": producer[gr_sq].input[0]}


@pytest.mark.parametrize("reader", ["step", "den", "sqrt", "scaled_v", "gr_sq", "gr_scaled"])
def test_spec_rewrite_leaves_updates_whose_intermediates_are_read(reader):
    """An intermediate that something else reads (here: a graph output) must
    still be computed: that tensor's update stays standard ops, the other
    tensor's is fused."""
    model = _lowered_adam(shapes=[(3, 4), (5,)])
    name = _adam_chain(model)[reader]
    model.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [3, 4]))
    fused, count = optimizer_rewrites(model)
    assert count == 1
    node = next(n for n in fused.graph.node if n.domain == KERNEL_DOMAIN and n.op_type not in STEP_SIZE)
    assert node.input[8] == "X2"
    assert name in {o for n in fused.graph.node if n.domain != KERNEL_DOMAIN for o in n.output}
    if kernels.library():
        feeds = random_state("Adam", [(3, 4), (5,)], np.float32, np.random.default_rng(0))
        feeds.update(R=np.array(0.1, np.float32), T=np.array(3, np.int64))
        for a, b in zip(_ort(model).run(None, feeds), _ort(fused, kernels.library()).run(None, feeds)):
            np.testing.assert_array_equal(a, b)


def test_spec_rewrite_leaves_a_call_whose_pre_decay_value_is_read():
    """X - step read elsewhere: a value inside the SpecAdam call (before its
    post factor), so that call keeps its standard ops; the step size is fused."""
    model = _lowered_adam(attrs={"norm_coefficient_post": 0.01})
    final = next(n for n in model.graph.node if "X1_new" in n.output)
    assert final.op_type == "Mul"
    pre = final.input[1]
    model.graph.output.append(helper.make_tensor_value_info(pre, TensorProto.FLOAT, [3, 4]))
    fused, count = optimizer_rewrites(model)
    assert count == 0
    assert [n.op_type for n in fused.graph.node if n.domain == KERNEL_DOMAIN] == ["AdamStepSizeF32"]
    if kernels.library():
        feeds = random_state("Adam", [(3, 4)], np.float32, np.random.default_rng(0))
        feeds.update(R=np.array(0.1, np.float32), T=np.array(3, np.int64))
        for a, b in zip(_ort(model).run(None, feeds), _ort(fused, kernels.library()).run(None, feeds)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("change", ["none", "dynamic", "broadcast", "unknown-r"])
def test_spec_rewrite_needs_static_shapes_and_true_scalars(change):
    """Dynamic shapes, a broadcast state and a learning rate of unknown shape
    stay standard ops (the kernel is elementwise over X's static shape)."""
    shapes = [(3, 4)]
    model = make_model("Momentum", shapes, TensorProto.FLOAT, TensorProto.FLOAT, _attrs("Momentum-standard", "default"))
    ins = {i.name: i for i in model.graph.input}
    if change == "dynamic":
        for name in ("X1", "G1", "V1"):
            ins[name].type.tensor_type.shape.dim[0].dim_param = "N"
        for o in model.graph.output:
            o.type.tensor_type.shape.dim[0].dim_param = "N"
    elif change == "broadcast":
        del ins["G1"].type.tensor_type.shape.dim[0]  # G [4] broadcast over X [3, 4]
    lowered = lower(model)
    if change == "unknown-r":  # (a model the checker refuses: cleared after lowering)
        next(i for i in lowered.graph.input if i.name == "R").type.tensor_type.ClearField("shape")
    expected = 1 if change == "none" else 0
    assert fuse_rule_calls(lowered.graph, list(lowered.opset_import)) == expected


@needs_library
def test_spec_batch_that_would_feed_itself_falls_back_to_one_node_per_tensor():
    """Tensors sharing scalars where one's gradient reads the other's new
    value cannot share a node (a cycle): each gets its own, still exact."""
    model = lower(make_model("Momentum", [(3,), (3,)], TensorProto.FLOAT, TensorProto.FLOAT,
                             _attrs("Momentum-standard", "default")))
    for n in model.graph.node:
        for k, name in enumerate(n.input):
            if name == "G2":
                n.input[k] = "G2_late"
    model.graph.node.append(helper.make_node("Add", ["G2", "X1_new"], ["G2_late"]))
    from onnxtrain.core.graph import toposort
    ordered = toposort(list(model.graph.node), [i.name for i in model.graph.input])
    del model.graph.node[:]
    model.graph.node.extend(ordered)
    fused, count = optimizer_rewrites(model)
    assert count == 2
    nodes = [n for n in fused.graph.node if n.domain == KERNEL_DOMAIN]
    assert [len(n.output) for n in nodes] == [2, 2]
    feeds = random_state("Momentum", [(3,), (3,)], np.float32, np.random.default_rng(0))
    feeds.update(R=np.array(0.1, np.float32), T=np.array(2, np.int64))
    for a, b in zip(_ort(model).run(None, feeds), _ort(fused, kernels.library()).run(None, feeds)):
        np.testing.assert_array_equal(a, b)


@needs_library
def test_spec_kernel_rejects_bad_operands_with_an_error():
    """The kernel checks its operands and fails the run (no crash, no garbage)."""
    vi = helper.make_tensor_value_info
    scalars = ["alpha", "beta", "r"]
    node = helper.make_node("MomentumF32", scalars + ["", "x", "g", "v"], ["x2", "v2"], domain=KERNEL_DOMAIN)
    graph = helper.make_graph(
        [node], "k", [vi(n, TensorProto.FLOAT, ["S"]) for n in scalars + ["x", "g", "v"]],
        [vi("x2", TensorProto.FLOAT, None), vi("v2", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(KERNEL_DOMAIN, 1)])
    model.ir_version = 8
    sess = _ort(model, kernels.library())
    one, f = np.ones(1, np.float32), np.arange(4, dtype=np.float32)
    x2, v2 = sess.run(None, {"alpha": one * 0.5, "beta": one, "r": one * 0.1, "x": f, "g": f, "v": f})
    np.testing.assert_array_equal(v2, np.float32(0.5) * f + f)
    np.testing.assert_array_equal(x2, f - np.float32(0.1) * v2)
    with pytest.raises(Exception, match="same number of elements"):
        sess.run(None, {"alpha": one, "beta": one, "r": one, "x": f, "g": f[:3], "v": f})
    with pytest.raises(Exception, match="exactly one element"):
        sess.run(None, {"alpha": f, "beta": one, "r": one, "x": f, "g": f, "v": f})


def test_spec_op_without_compiler_runs_the_standard_kernels(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ONNXTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    kernels._reset_for_tests()
    try:
        tm, feeds = spec_model("adam-nc-post", "linreg", np.float32)
        standard = TrainingSession(tm, fused_kernels=False).programs(executed=True)[ALGORITHM]
        assert optimizer_rewrites(standard)[1] == 2  # what a compiler would have fused
        sess, losses = run_steps(tm, feeds, steps=3)
        assert spec_ops(sess) == []
        assert "no C compiler" in sess.fused_kernels_note
        assert losses[-1] < losses[0]
        with pytest.raises(RuntimeError, match="no C compiler"):
            TrainingSession(tm, fused_kernels=True)
    finally:
        monkeypatch.undo()
        kernels._reset_for_tests()


def test_spec_adam_is_not_taken_for_the_builders_adam():
    """The spec's Adam (eps added before the bias correction, post-update
    decay) and the builder's AdamW have different updates: each gets its own
    kernel, never the other's."""
    model = make_model("Adam", [(4,), (2, 3)], TensorProto.FLOAT, TensorProto.FLOAT, _attrs("Adam", "custom"))
    fused, count = optimizer_rewrites(lower(model))
    assert count == 2
    assert {n.op_type for n in fused.graph.node if n.domain == KERNEL_DOMAIN} == {"SpecAdamF32", "AdamStepSizeF32"}
    builder, count = with_fused_kernels(_adam_graph())
    assert count == 1
    assert [n.op_type for n in builder.graph.node if n.domain == KERNEL_DOMAIN] == ["AdamUpdateF32"]


# ----------------------------------------------- large tensors: the update split over two threads
def _large_feeds(dtype, features=1024, rows=8, classes=3):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((rows, features)).astype(dtype)
    return x, (np.arange(rows) % classes).astype(np.int64)


def _assert_fused_trains_as_standard(tm, feeds, ops):
    """Four steps with and without the fused kernels: the same losses and state, bit for bit."""
    fused, fused_losses = run_steps(tm, feeds, steps=4, fused_kernels=True)
    plain, plain_losses = run_steps(tm, feeds, steps=4, fused_kernels=False)
    assert ops(fused) and ops(plain) == []
    assert fused_losses == plain_losses
    for name, value in plain.state.items():
        np.testing.assert_array_equal(fused.state[name], value, err_msg=name)


@needs_library
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["adam-nc-post", "momentum", "nesterov-nc", "adagrad-nc"])
def test_spec_kernels_split_over_threads_equal_standard_bit_for_bit(case, dtype):
    """A 1024x1024 weight is over the optimizer kernels' split threshold (16 MiB
    of traffic): its update runs in two element ranges at once, with the same bits."""
    optimizer, attrs, _ = SPEC_CASES[case]
    tm = mlp_classifier(optimizer, sizes=(1024, 1024, 3), lr=0.05, dtype=dtype)
    node = next(n for n in tm.training_info[0].algorithm.node
                if n.domain == PREVIEW and n.op_type != "Gradient")
    for name, value in attrs.items():
        for a in list(node.attribute):
            if a.name == name:
                node.attribute.remove(a)
        node.attribute.append(helper.make_attribute(name, value))
    x, labels = _large_feeds(dtype)
    _assert_fused_trains_as_standard(tm, {"X": x, "label": labels}, spec_ops)


@needs_library
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_adam_kernel_split_over_threads_equals_standard_bit_for_bit(dtype):
    model = mlp(sizes=(1024, 1024, 3), dtype=dtype)
    tm = build.training_model(model, loss="cross_entropy", optimizer=build.AdamW(0.01, weight_decay=0.1))
    x, labels = _large_feeds(dtype)
    _assert_fused_trains_as_standard(tm, {"X": x, "target": labels}, fused_ops)


# ----------------------------------------------------- the spec Adam's step size
def _step_size_name(model) -> str:
    """The Where that writes the lowered Adam's step size."""
    return next(n.output[0] for n in model.graph.node if n.op_type == "Where")


@needs_library
@pytest.mark.parametrize("x_type", [TensorProto.FLOAT, TensorProto.DOUBLE])
@pytest.mark.parametrize("alpha,beta", [(0.9, 0.999), (0.8, 0.95), (0.5, 0.9999)])
def test_step_size_kernel_equals_the_standard_kernels_bit_for_bit(x_type, alpha, beta):
    """The ten one-element kernels of Adam's bias-corrected step size become one
    AdamStepSize node; its value equals theirs bit for bit at every step count
    tried (T = 0 takes R itself), float and double."""
    model = lower(make_model("Adam", [(3, 4)], x_type, TensorProto.FLOAT, {"alpha": alpha, "beta": beta}))
    name = _step_size_name(model)
    model.graph.output.append(helper.make_tensor_value_info(name, x_type, []))
    fused, count = with_fused_kernels(model)
    steps = [n for n in fused.graph.node if n.op_type in STEP_SIZE]
    assert len(steps) == 1 and steps[0].output[0] == name and count == 2
    assert not any(n.op_type in ("Pow", "Where", "Greater") for n in fused.graph.node)
    standard, fast = _ort(model), _ort(fused, kernels.library())
    dtype = np.float32 if x_type == TensorProto.FLOAT else np.float64
    feeds = random_state("Adam", [(3, 4)], dtype, np.random.default_rng(2))
    for r in (0.1, 3e-4, 1.0):
        feeds["R"] = np.array(r, np.float32)
        for t in (0, 1, 2, 3, 7, 10, 99, 1000, 12345, 10**6, 2**40 + 1):
            feeds["T"] = np.array(t, np.int64)
            for a, b in zip(standard.run(None, feeds), fast.run(None, feeds)):
                np.testing.assert_array_equal(a, b, err_msg=f"T={t} r={r}")


def test_step_size_read_elsewhere_stays_standard():
    """An intermediate of the step size read by something else (a graph output)
    keeps the chain as standard kernels; the updates are still fused."""
    model = _lowered_adam()
    producer = {o: n for n in model.graph.node for o in n.output}
    div = producer[_step_size_name(model)].input[1]
    model.graph.output.append(helper.make_tensor_value_info(div, TensorProto.FLOAT, []))
    fused, count = with_fused_kernels(model)
    assert count == 1
    assert not any(n.op_type in STEP_SIZE for n in fused.graph.node)
    assert any(n.op_type == "Where" for n in fused.graph.node)


@pytest.mark.parametrize("which", ["beta", "alpha"])
def test_step_size_with_two_step_counts_stays_standard(which):
    """Each bias correction's Pow reads Cast(T): when one reads the Cast of
    another count, the call is no longer the AdamStepSize rule's body and
    must stay standard kernels (the kernel would compute both powers from T).

    Bug caught: the call's check against the rule's body no longer comparing
    the operand the body repeats (alpha's Cast reads the step count; "beta"
    covers the first)."""
    model = _lowered_adam()
    producer = {o: n for n in model.graph.node for o in n.output}
    where = producer[_step_size_name(model)]
    div = producer[where.input[1]]
    # Div(Mul(r, Sqrt(Sub(1, Pow(beta, Cast(T))))), Sub(1, Pow(alpha, Cast(T))))
    sub = producer[producer[producer[div.input[0]].input[1]].input[0]] if which == "beta" \
        else producer[div.input[1]]
    power = producer[sub.input[1]]
    cast = producer[power.input[1]]
    assert power.op_type == "Pow" and cast.op_type == "Cast" and cast.input[0] == "T"
    other = helper.make_node("Cast", ["T_other"], ["T_other_cast"], to=cast.attribute[0].i)
    power.input[1] = "T_other_cast"
    nodes = list(model.graph.node)
    nodes.insert(nodes.index(power), other)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.input.append(helper.make_tensor_value_info("T_other", TensorProto.INT64, []))
    fused, _ = with_fused_kernels(model)
    assert not any(n.op_type in STEP_SIZE for n in fused.graph.node)
    # the call's own Cast back in place fuses: the refusal is for the other count
    next(n for n in model.graph.node if n.output[0] == power.output[0]).input[1] = cast.output[0]
    fused, _ = with_fused_kernels(model)
    assert any(n.op_type in STEP_SIZE for n in fused.graph.node)


# ------------------------------------------------------------------ the call check
def adam_update(g_v: str) -> onnx.ModelProto:
    """One call of the rule Adam over p, g1, g2, m, v, with v' then made to
    read ``g_v`` (m' reads g1):

        m' = b1*m + c1*g1;  v' = b2*v + c2*(g_v*g_v);  p' = p - step*(m'/(Sqrt(v') + eps))
    """
    shape = [4, 3]
    scalars = {"b1": 0.9, "c1": 0.1, "b2": 0.999, "c2": 0.001, "eps": 1e-8, "step": 0.01}
    names = ("p", "g1", "g2", "m", "v")
    e = Emitter(17, NameGen(names), dict.fromkeys(names, TensorProto.FLOAT))
    operands = {k: e.const(v, dtype=TensorProto.FLOAT) for k, v in scalars.items()}
    out = apply(e, "Adam", {**operands, "p": "p", "g": "g1", "m": "m", "v": "v"},
                {"p_new": "p_new", "m_new": "m_new", "v_new": "v_new"})
    square = next(n for n in e.nodes if n.op_type == "Mul" and list(n.input) == ["g1", "g1"])
    square.input[:] = [g_v, g_v]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in names]
    outputs = [helper.make_tensor_value_info(out[k], TensorProto.FLOAT, shape) for k in ("p_new", "m_new", "v_new")]
    return helper.make_model(helper.make_graph(e.nodes, "adam", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 17)])


def test_rule_call_refuses_moments_of_different_gradients():
    """Bug caught: the call check binding a formal operand anew at each use
    (``env.setdefault(fi, ai) != ai`` dropped from ``rules._match``), so m' of
    g1 and v' of g2 fuse into one kernel that reads g1 for both."""
    same = adam_update("g1")
    assert fuse_rule_calls(same.graph, same.opset_import) == 1  # the call is recognised
    assert [n.op_type for n in same.graph.node if n.op_type != "Constant"] == ["AdamUpdateF32"]
    different = adam_update("g2")
    before = different.SerializeToString()
    assert fuse_rule_calls(different.graph, different.opset_import) == 0
    assert different.SerializeToString() == before
