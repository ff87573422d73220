"""build.LoRA: low-rank adapters of frozen MatMul/Gemm weights.

Oracles: plain onnxruntime on the base model (first forward, merged
export), numpy (the merged weight W + (alpha/r)·A·B in each orientation,
the loss) and float64 central finite differences (the adapters' gradients,
read back from one SGD step with lr = 1)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession, build
from onnxtrain.build import lora as lora_mod

F32, F64 = TensorProto.FLOAT, TensorProto.DOUBLE


# ------------------------------------------------------------------ models
def _model(nodes, inputs, outputs, inits, opset=17):
    graph = helper.make_graph(nodes, "m", inputs, outputs,
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def zoo(dtype=np.float64, seed=0):
    """X[N,4] through every kind of weight use:

    W1  MatMul(X, W1) twice (one adapter pair for both)   [in=4, out=5]
    W2  Gemm(h1, W2, b2, transB=1), W2 stored [6, 5]       [in=5, out=6]
    W3  MatMul(W3, h2ᵀ), W3 stored [7, 6]                  [in=6, out=7]
    W4  MatMul(h3ᵀ, Identity(W4))                          [in=7, out=3]
    b2 (1-D), C (2-D, read by Add), P and Q (MatMul of two initializers): not targets."""
    rng = np.random.default_rng(seed)
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = {
        "W1": rng.standard_normal((4, 5)) / 2, "W2": rng.standard_normal((6, 5)) / 2,
        "b2": rng.standard_normal(6) / 4, "W3": rng.standard_normal((7, 6)) / 2,
        "W4": rng.standard_normal((7, 3)) / 2, "C": rng.standard_normal((1, 3)) / 4,
        "P": rng.standard_normal((1, 3)), "Q": rng.standard_normal((3, 3)),
    }
    inits = {k: np.asarray(v, dtype) for k, v in inits.items()}
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["h1a"], name="mm1a"),
        helper.make_node("MatMul", ["X", "W1"], ["h1b"], name="mm1b"),
        helper.make_node("Add", ["h1a", "h1b"], ["h1"], name="add1"),
        helper.make_node("Gemm", ["h1", "W2", "b2"], ["h2"], name="gemm2", transB=1),
        helper.make_node("Tanh", ["h2"], ["h2r"], name="tanh"),
        helper.make_node("Transpose", ["h2r"], ["h2t"], name="t2"),
        helper.make_node("MatMul", ["W3", "h2t"], ["h3"], name="mm3"),
        helper.make_node("Transpose", ["h3"], ["h3t"], name="t3"),
        helper.make_node("Identity", ["W4"], ["W4_id"], name="id4"),
        helper.make_node("MatMul", ["h3t", "W4_id"], ["y0"], name="mm4"),
        helper.make_node("Add", ["y0", "C"], ["y1"], name="addC"),
        helper.make_node("MatMul", ["P", "Q"], ["pq"], name="mmPQ"),
        helper.make_node("Add", ["y1", "pq"], ["Y"], name="addPQ"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("X", et, ["N", 4])],
                  [helper.make_tensor_value_info("Y", et, ["N", 3])], inits)


#: One weight use per case: (op, W's operand index (1: right, 0: left), W's trans flag).
CASES = {
    "matmul_right": ("MatMul", 1, 0),
    "matmul_left": ("MatMul", 0, 0),
    "gemm_b": ("Gemm", 1, 0),
    "gemm_b_t": ("Gemm", 1, 1),
    "gemm_a": ("Gemm", 0, 0),
    "gemm_a_t": ("Gemm", 0, 1),
}
N_IN, N_OUT, BATCH = 3, 4, 5


def single(case, seed=0):
    """One product layer ``Y`` with weight W (in=3 -> out=4) in the orientation of ``case``;
    returns (model, X, numpy forward(X, W_stored))."""
    op, operand, trans = CASES[case]
    rng = np.random.default_rng(seed)
    stored_t = (operand == 1 and trans == 1) or (operand == 0 and trans == 0)
    w = rng.standard_normal((N_OUT, N_IN) if stored_t else (N_IN, N_OUT))
    # The activation is [BATCH, in] (W on the right) or [in, BATCH] (W on the left);
    # in the Gemm cases its own trans flag equals W's, so both flags are covered.
    x_trans = op == "Gemm" and bool(trans)
    attrs = {}
    if op == "Gemm":
        flags = {1: "transB", 0: "transA"}
        attrs = {"alpha": 0.5, flags[operand]: trans, flags[1 - operand]: int(x_trans)}
    x_rows = operand == 1
    x_shape = (BATCH, N_IN) if x_rows else (N_IN, BATCH)
    if x_trans:
        x_shape = x_shape[::-1]
    x = rng.standard_normal(x_shape)
    inputs = ["X", "W"] if operand == 1 else ["W", "X"]
    if op == "Gemm":
        c = rng.standard_normal(N_OUT if operand == 1 else (N_OUT, 1))
        inputs.append("C")
    y_shape = [BATCH, N_OUT] if operand == 1 else [N_OUT, BATCH]
    inits = {"W": w} | ({"C": c} if op == "Gemm" else {})
    model = _model([helper.make_node(op, inputs, ["Y"], name="layer", **attrs)],
                   [helper.make_tensor_value_info("X", F64, list(x_shape))],
                   [helper.make_tensor_value_info("Y", F64, y_shape)], inits)

    def forward(xv, wv):
        xo = xv.T if x_trans else xv
        if op == "MatMul":
            return xo @ wv if operand == 1 else wv @ xo
        wo = wv.T if trans else wv
        return 0.5 * (xo @ wo if operand == 1 else wo @ xo) + c

    return model, x, forward, stored_t


def ort_run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def session(model, lora=None, **kw):
    kw.setdefault("loss", "mse")
    kw.setdefault("optimizer", build.SGD(lr=0.1))
    tm = build.training_model(model, lora=lora or build.LoRA(rank=2, alpha=4), **kw)
    sess = TrainingSession(tm)
    sess.initialize()
    return sess


def meta(model, key):
    return json.loads(next(p.value for p in model.metadata_props if p.key == key))


# ------------------------------------------------------------------ configuration
@pytest.mark.parametrize("kwargs, error", [
    ({"rank": 0}, ValueError), ({"rank": 2.0}, ValueError), ({"alpha": 0}, ValueError),
    ({"alpha": float("nan")}, ValueError), ({"dropout": 1.0}, ValueError),
    ({"dropout": -0.1}, ValueError), ({"targets": "W1"}, TypeError), ({"targets": []}, ValueError),
    ({"targets": 3}, TypeError), ({"seed": "x"}, ValueError),
])
def test_lora_arguments_are_checked(kwargs, error):
    with pytest.raises(error, match="LoRA"):
        build.LoRA(**kwargs)


def test_lora_argument_of_training_model_is_checked():
    with pytest.raises(TypeError, match="build.LoRA"):
        build.training_model(zoo(), loss="mse", lora={"rank": 2})


# ------------------------------------------------------------------ targets and state
def test_default_targets_and_adapter_shapes():
    tm = build.training_model(zoo(), loss="mse", lora=build.LoRA(rank=2, alpha=4))
    info = meta(tm, "onnxtrain.lora")
    got = {e["weight"]: (e["in"], e["out"], e["transposed"]) for e in info["targets"]}
    assert got == {"W1": (4, 5, False), "W2": (5, 6, True), "W3": (6, 7, True), "W4": (7, 3, False)}
    inits = {t.name: list(t.dims) for t in tm.graph.initializer}
    for w, (n_in, n_out, _) in got.items():
        assert inits[f"{w}.lora_A"] == [n_in, 2] and inits[f"{w}.lora_B"] == [2, n_out]
    assert all(e["scale"] == 2.0 for e in info["targets"])
    # A: seeded uniform(-1/sqrt(in), 1/sqrt(in)); B: zeros
    a = numpy_helper.to_array(next(t for t in tm.graph.initializer if t.name == "W3.lora_A"))
    assert np.abs(a).max() <= 1 / np.sqrt(6) and np.abs(a).max() > 0.1
    b = numpy_helper.to_array(next(t for t in tm.graph.initializer if t.name == "W3.lora_B"))
    assert not b.any()
    again = build.training_model(zoo(), loss="mse", lora=build.LoRA(rank=2, alpha=4))
    assert [t.SerializeToString() for t in again.graph.initializer] == [
        t.SerializeToString() for t in tm.graph.initializer]
    other = build.training_model(zoo(), loss="mse", lora=build.LoRA(rank=2, alpha=4, seed=1))
    a1 = numpy_helper.to_array(next(t for t in other.graph.initializer if t.name == "W3.lora_A"))
    assert not np.array_equal(a, a1)


def test_targets_by_name_and_predicate():
    tm = build.training_model(zoo(), loss="mse", lora=build.LoRA(targets=["W4", "W2"]))
    assert [e["weight"] for e in meta(tm, "onnxtrain.lora")["targets"]] == ["W2", "W4"]
    tm = build.training_model(zoo(), loss="mse", lora=build.LoRA(targets=lambda n: n in ("W1", "W3")))
    assert [e["weight"] for e in meta(tm, "onnxtrain.lora")["targets"]] == ["W1", "W3"]
    with pytest.raises(ValueError, match="unknown name 'nope'"):
        build.training_model(zoo(), loss="mse", lora=build.LoRA(targets=["nope"]))
    with pytest.raises(ValueError, match="'C' cannot take an adapter.*Add"):
        build.training_model(zoo(), loss="mse", lora=build.LoRA(targets=["C"]))
    with pytest.raises(ValueError, match="'Q' cannot take an adapter.*initializer 'P'"):
        build.training_model(zoo(), loss="mse", lora=build.LoRA(targets=["Q"]))
    with pytest.raises(ValueError, match="no target selected"):
        build.training_model(zoo(), loss="mse", lora=build.LoRA(targets=lambda n: False))


def test_only_adapters_train_by_default_and_trainable_adds_others():
    tm = build.training_model(zoo(), loss="mse", lora=build.LoRA(rank=2))
    adapters = [f"W{i}.lora_{s}" for i in range(1, 5) for s in "AB"]
    assert meta(tm, "onnxtrain.trainable") == adapters
    sess = TrainingSession(tm)
    assert not {"W1", "W2", "W3", "W4", "b2", "C"} & set(sess.state)  # frozen: not state
    tm = build.training_model(zoo(), loss="mse", lora=build.LoRA(rank=2), trainable=["b2", "C"])
    assert sorted(meta(tm, "onnxtrain.trainable")) == sorted(adapters + ["b2", "C"])
    tm = build.training_model(zoo(), loss="mse", lora=build.LoRA(rank=2),
                              trainable=lambda n: n.startswith(("b", "W")))
    assert sorted(meta(tm, "onnxtrain.trainable")) == sorted(adapters + ["b2"])
    with pytest.raises(ValueError, match="'W2' is a LoRA target"):
        build.training_model(zoo(), loss="mse", lora=build.LoRA(rank=2), trainable=["W2"])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_first_forward_equals_base_model(dtype):
    model = zoo(dtype)
    x = np.random.default_rng(1).standard_normal((6, 4)).astype(dtype)
    sess = session(model)
    np.testing.assert_array_equal(sess.run({"X": x})["Y"], ort_run(model, {"X": x}))
    out = sess.train_step({"X": x, "target": np.zeros((6, 3), dtype)})
    np.testing.assert_array_equal(out["Y"], ort_run(model, {"X": x}))


def test_training_graph_never_forms_the_merged_weight():
    """No node of the main graph or of the lowered algorithm reads both
    adapters (A·B is never formed) and none adds anything to a frozen W."""
    sess = session(zoo())
    programs = sess.programs(executed=True)
    assert programs
    graphs = [sess.model.graph] + [p.graph for p in programs.values()]
    for w in ("W1", "W2", "W3", "W4"):
        for g in graphs:
            derived = {"A": {f"{w}.lora_A"}, "B": {f"{w}.lora_B"}, "W": {w}}
            for n in g.node:  # copies and transposes of the adapters and the weight
                if n.op_type in ("Identity", "Transpose", "Cast"):
                    for key, names in derived.items():
                        if n.input[0] in names:
                            names.update(n.output)
            for n in g.node:
                ins = set(n.input)
                assert not (ins & derived["A"] and ins & derived["B"]), (w, n)
                if n.op_type in ("Add", "Sum", "Sub"):
                    assert not ins & derived["W"], (w, n)


# ------------------------------------------------------------------ orientation and gradients
@pytest.mark.parametrize("case", list(CASES))
def test_orientation_forward_merge_and_gradients(case, tmp_path):
    model, x, forward, stored_t = single(case)
    sess = session(model, build.LoRA(rank=2, alpha=3), optimizer=build.SGD(lr=1.0))
    a_shape, b_shape = sess.state["W.lora_A"].shape, sess.state["W.lora_B"].shape
    assert (a_shape, b_shape) == ((N_IN, 2), (2, N_OUT))
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
    sess.load_state({"W.lora_A": a, "W.lora_B": b})
    w = numpy_helper.to_array(model.graph.initializer[0])
    s = 3 / 2

    def merged(av, bv):
        delta = s * av @ bv
        return w + (delta.T if stored_t else delta)

    np.testing.assert_allclose(sess.run({"X": x})["Y"], forward(x, merged(a, b)), rtol=1e-12, atol=1e-12)
    sess.export(tmp_path / "merged.onnx")
    exported = onnx.load(tmp_path / "merged.onnx")
    np.testing.assert_allclose(numpy_helper.to_array(exported.graph.initializer[0]), merged(a, b),
                               rtol=1e-14, atol=1e-14)
    target = rng.standard_normal(forward(x, w).shape)

    def loss(av, bv):
        return np.mean((forward(x, merged(av, bv)) - target) ** 2)

    out = sess.train_step({"X": x, "target": target})
    assert abs(float(out["loss"]) - loss(a, b)) < 1e-12
    grads = {"A": a - sess.state["W.lora_A"], "B": b - sess.state["W.lora_B"]}  # SGD, lr = 1
    eps = 1e-6
    for key, value in (("A", a), ("B", b)):
        fd = np.zeros_like(value)
        for idx in np.ndindex(value.shape):
            plus, minus = value.copy(), value.copy()
            plus[idx] += eps
            minus[idx] -= eps
            args = (plus, b) if key == "A" else (a, plus)
            args_m = (minus, b) if key == "A" else (a, minus)
            fd[idx] = (loss(*args) - loss(*args_m)) / (2 * eps)
        np.testing.assert_allclose(grads[key], fd, rtol=1e-6, atol=1e-8, err_msg=f"{case} d{key}")


def test_gradients_of_a_shared_weight_sum_over_its_uses():
    """W1 is read by two MatMuls (one adapter pair); every target trains at
    once.  dA, dB of W1 and W4 against finite differences of a numpy forward."""
    model = zoo()
    p = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    sess = session(model, build.LoRA(rank=2, alpha=4), optimizer=build.SGD(lr=1.0))
    rng = np.random.default_rng(5)
    state = {k: rng.standard_normal(v.shape) for k, v in sess.state.items() if ".lora_" in k}
    sess.load_state(state)
    x, target = rng.standard_normal((6, 4)), rng.standard_normal((6, 3))

    def loss(st):
        w = {k: p[k] + 2.0 * st[f"{k}.lora_A"] @ st[f"{k}.lora_B"] for k in ("W1", "W4")}
        w |= {k: p[k] + 2.0 * (st[f"{k}.lora_A"] @ st[f"{k}.lora_B"]).T for k in ("W2", "W3")}
        h2 = np.tanh((2 * x @ w["W1"]) @ w["W2"].T + p["b2"])
        y = (w["W3"] @ h2.T).T @ w["W4"] + p["C"] + p["P"] @ p["Q"]
        return np.mean((y - target) ** 2)

    out = sess.train_step({"X": x, "target": target})
    assert abs(float(out["loss"]) - loss(state)) < 1e-12
    eps = 1e-6
    for name in ("W1.lora_A", "W1.lora_B", "W4.lora_A", "W4.lora_B"):
        grad = state[name] - sess.state[name]  # SGD, lr = 1
        fd = np.zeros_like(grad)
        for idx in np.ndindex(grad.shape):
            plus = {**state, name: state[name].copy()}
            minus = {**state, name: state[name].copy()}
            plus[name][idx] += eps
            minus[name][idx] -= eps
            fd[idx] = (loss(plus) - loss(minus)) / (2 * eps)
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8, err_msg=name)


def test_batched_activation_of_a_transformer_projection(tmp_path):
    """MatMul(X[B, T, in], W) and MatMul(W', X[B, out, T]) with 3-D activations."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("MatMul", ["X", "Wq"], ["q"], name="q_proj"),
             helper.make_node("Transpose", ["q"], ["qt"], name="t", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["Wo", "qt"], ["Y"], name="o_proj")]
    model = _model(nodes, [helper.make_tensor_value_info("X", F64, [2, 3, 4])],
                   [helper.make_tensor_value_info("Y", F64, [2, 6, 3])],
                   {"Wq": rng.standard_normal((4, 5)), "Wo": rng.standard_normal((6, 5))})
    sess = session(model, build.LoRA(rank=3, alpha=6))
    assert sess.state["Wo.lora_A"].shape == (5, 3) and sess.state["Wo.lora_B"].shape == (3, 6)
    sess.load_state({k: rng.standard_normal(v.shape) for k, v in sess.state.items() if ".lora_" in k})
    x = rng.standard_normal((2, 3, 4))
    st = sess.state
    wq = model.graph.initializer[0]
    wq = numpy_helper.to_array(wq) + 2 * st["Wq.lora_A"] @ st["Wq.lora_B"]
    wo = numpy_helper.to_array(model.graph.initializer[1]) + 2 * (st["Wo.lora_A"] @ st["Wo.lora_B"]).T
    expected = wo @ np.transpose(x @ wq, (0, 2, 1))
    np.testing.assert_allclose(sess.run({"X": x})["Y"], expected, rtol=1e-12, atol=1e-12)
    merged = onnx.load(sess.export(tmp_path / "m.onnx"))
    np.testing.assert_allclose(ort_run(merged, {"X": x}), expected, rtol=1e-12, atol=1e-12)


def test_dropout_on_adapter_branch_only_in_training():
    """dropout > 0: a Dropout on the adapter branch's input, active in the
    algorithm (the loss of one batch varies from step to step with lr = 0),
    the identity in inference, gone from the merged model."""
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((8, 4)), np.zeros((8, 3))
    b1 = rng.standard_normal((2, 5))
    losses = {}
    for p in (0.0, 0.5):
        sess = session(zoo(), build.LoRA(rank=2, dropout=p, targets=["W1"]), optimizer=build.SGD(lr=0.0))
        assert any(n.op_type == "Dropout" for n in sess.model.graph.node) == (p > 0)
        sess.load_state({"W1.lora_B": b1})
        first = sess.run({"X": x})["Y"]
        np.testing.assert_array_equal(sess.run({"X": x})["Y"], first)
        losses[p] = {float(sess.train_step({"X": x, "target": y})["loss"]) for _ in range(4)}
        merged = sess.to_model()
        assert not any(n.op_type == "Dropout" for n in merged.graph.node)
        np.testing.assert_allclose(ort_run(merged, {"X": x}), first, rtol=1e-12, atol=1e-12)
    assert len(losses[0.0]) == 1 and len(losses[0.5]) > 1


# ------------------------------------------------------------------ training and export
def _trained(dtype=np.float64, steps=25, **kw):
    model = zoo(dtype)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 4)).astype(dtype)
    teacher = zoo(dtype, seed=1)
    y = ort_run(teacher, {"X": x})
    sess = session(model, build.LoRA(rank=2, alpha=4), optimizer=build.Adam(lr=0.02), **kw)
    losses = [float(sess.train_step({"X": x, "target": y})["loss"]) for _ in range(steps)]
    return model, sess, x, y, losses


def test_adam_steps_reduce_the_loss():
    _, _, _, _, losses = _trained()
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_merged_export_is_the_original_graph_and_predicts_like_the_session(dtype, tol, tmp_path):
    model, sess, x, _, _ = _trained(dtype, steps=5)
    path = sess.export(tmp_path / "merged.onnx")
    merged = onnx.load(path)
    onnx.checker.check_model(merged, full_check=True)
    assert [n.SerializeToString() for n in merged.graph.node] == [
        n.SerializeToString() for n in model.graph.node]
    assert [t.name for t in merged.graph.initializer] == [t.name for t in model.graph.initializer]
    assert not [p.key for p in merged.metadata_props if p.key == "onnxtrain.lora"]
    assert not merged.training_info
    np.testing.assert_allclose(ort_run(merged, {"X": x}), sess.run({"X": x})["Y"], rtol=tol, atol=tol)
    # frozen parts are untouched, targets changed
    orig = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    new = {t.name: numpy_helper.to_array(t) for t in merged.graph.initializer}
    for name in ("b2", "C", "P", "Q"):
        np.testing.assert_array_equal(new[name], orig[name])
    for name in ("W1", "W2", "W3", "W4"):
        assert not np.array_equal(new[name], orig[name])


def test_training_export_resumes(tmp_path):
    _, sess, x, y, _ = _trained(steps=3)
    path = sess.export(tmp_path / "ckpt.onnx", training=True)
    resumed = TrainingSession(path)
    assert set(resumed.state) == set(sess.state)
    for name in sess.state:
        np.testing.assert_array_equal(resumed.state[name], sess.state[name])
    a = sess.train_step({"X": x, "target": y})
    b = resumed.train_step({"X": x, "target": y})
    np.testing.assert_array_equal(a["loss"], b["loss"])
    for name in sess.state:
        np.testing.assert_array_equal(resumed.state[name], sess.state[name])
    assert resumed.to_model().SerializeToString() == sess.to_model().SerializeToString()


def test_accumulate_with_lora_exports_merged(tmp_path):
    model, sess, x, _, losses = _trained(steps=4, accumulate=2)
    merged = onnx.load(sess.export(tmp_path / "m.onnx"))
    assert [n.op_type for n in merged.graph.node] == [n.op_type for n in model.graph.node]
    np.testing.assert_allclose(ort_run(merged, {"X": x}), sess.run({"X": x})["Y"], rtol=1e-12, atol=1e-12)


def test_adapter_file_round_trip_equals_merged_export(tmp_path):
    model, sess, x, _, _ = _trained(steps=5)
    path = lora_mod.save_adapters(sess, tmp_path / "adapters.npz")
    desc, arrays = lora_mod.load_adapters(path)
    assert sorted(arrays) == sorted(f"W{i}.lora_{s}" for i in range(1, 5) for s in "AB")
    assert desc["rank"] == 2 and desc["alpha"] == 4.0
    applied = lora_mod.apply_adapters(model, path)
    exported = onnx.load(sess.export(tmp_path / "merged.onnx"))
    assert [t.SerializeToString() for t in applied.graph.initializer] == [
        t.SerializeToString() for t in exported.graph.initializer]
    np.testing.assert_array_equal(ort_run(applied, {"X": x}), ort_run(exported, {"X": x}))
    # from a training checkpoint file too
    ckpt = sess.export(tmp_path / "ckpt.onnx", training=True)
    again = lora_mod.save_adapters(ckpt, tmp_path / "again.npz")
    assert [t.SerializeToString() for t in lora_mod.apply_adapters(model, again).graph.initializer] == [
        t.SerializeToString() for t in exported.graph.initializer]
    # a base model that does not fit is refused
    bad = zoo()
    bad.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.zeros((5, 4)), "W1"))
    with pytest.raises(ValueError, match="'W1' has shape"):
        lora_mod.apply_adapters(bad, path)
    with pytest.raises(ValueError, match="no onnxtrain.lora metadata"):
        lora_mod.save_adapters(model, tmp_path / "x.npz")


# ------------------------------------------------------------------ LoRA init
def narrowing_model() -> onnx.ModelProto:
    """X[N,64] -> MatMul W1[64,4] (in 64, out 4) -> Relu -> Gemm(transB=1) with
    W2 stored as [out, in] = [2, 4] (in 4, out 2): both targets have out < in."""
    rng = np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("Gemm", ["r", "W2"], ["Y"], transB=1)], "narrowing",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 2])],
        [numpy_helper.from_array(rng.standard_normal((64, 4)).astype(np.float32), "W1"),
         numpy_helper.from_array(rng.standard_normal((2, 4)).astype(np.float32), "W2")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_lora_a_bound_is_one_over_sqrt_of_the_input_features():
    """A of W1 ([in, r] = [64, 16]) within 1/sqrt(64) = 0.125, and filling it
    (its largest |value| above 0.9 of the bound); A of the transposed W2
    ([4, 16]) within 1/sqrt(4) = 0.5.  B is zero.

    Bug caught: ``bound = 1.0 / np.sqrt(n_in)`` written as
    ``bound = 1.0 / np.sqrt(n_out)`` in ``lora.apply``."""
    tm = build.training_model(narrowing_model(), loss="mse",
                              lora=build.LoRA(rank=16, alpha=16, seed=3))
    inits = {t.name: numpy_helper.to_array(t) for t in tm.graph.initializer}
    for weight, n_in, n_out in (("W1", 64, 4), ("W2", 4, 2)):
        a, b = inits[f"{weight}.lora_A"], inits[f"{weight}.lora_B"]
        assert a.shape == (n_in, 16) and b.shape == (16, n_out)
        bound = 1.0 / np.sqrt(n_in)
        largest = float(np.abs(a).max())
        assert 0.9 * bound < largest <= bound, f"{weight}.lora_A: max |A| {largest:.4f}, bound {bound:.4f}"
        assert not b.any()
    # The session starts from the base model's predictions (B = 0).
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    base = TrainingSession(build.training_model(narrowing_model(), loss="mse"))
    np.testing.assert_array_equal(TrainingSession(tm).run({"X": x})["Y"], base.run({"X": x})["Y"])
