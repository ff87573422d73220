"""Activation recompute (``build.training_model(..., recompute=...)``, ``onnxtrain.lower.recompute``).

Every mode must train exactly like the plain model (same losses, same
weights), while the program onnxruntime runs holds copies of forward nodes
and keeps fewer forward values for the backward pass, and runs those copies
late (after the loss), where they save memory.
"""

from __future__ import annotations

import gc
import glob
import importlib.util
import json
import os

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingModelError, TrainingSession, build
from onnxtrain.io.metadata import model_metadata
from onnxtrain.lower import recompute as rc
from onnxtrain.runtime.executor import default_session_options

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
F32 = TensorProto.FLOAT
ALGORITHM = "training_info[0].algorithm"


def _bench():
    """benchmarks/recompute.py (its transformer stack is the one measured there)."""
    spec = importlib.util.spec_from_file_location("bench_recompute", os.path.join(ROOT, "benchmarks", "recompute.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------ models
def mlp(seed=0, sizes=(12, 32, 32, 32, 5), batch=8, activation="Tanh", dtype=np.float32):
    """X -> [Gemm -> activation] * n -> Gemm -> Y."""
    rng = np.random.default_rng(seed)
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes, inits, x = [], [], "X"
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        inits += [numpy_helper.from_array((rng.standard_normal((a, b)) / np.sqrt(a)).astype(dtype), f"W{i}"),
                  numpy_helper.from_array((rng.standard_normal(b) * 0.1).astype(dtype), f"b{i}")]
        nodes.append(helper.make_node("Gemm", [x, f"W{i}", f"b{i}"], [f"z{i}"]))
        x = f"z{i}"
        if i < len(sizes) - 2:
            nodes.append(helper.make_node(activation, [x], [f"h{i}"]))
            x = f"h{i}"
    nodes.append(helper.make_node("Identity", [x], ["Y"]))
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", et, [batch, sizes[0]])],
                          [helper.make_tensor_value_info("Y", et, [batch, sizes[-1]])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"X": rng.standard_normal((batch, sizes[0])).astype(dtype),
             "target": rng.standard_normal((batch, sizes[-1])).astype(dtype)}
    return m, feeds


def cnn(seed=0, batch=4):
    """Conv-Relu-Conv-Relu-MaxPool-Conv-Relu-MaxPool-Flatten-Gemm, cross-entropy
    over 5 classes.  (The backward of Relu-MaxPool reads only the pooled
    values, so the second Conv gives recompute an activation to drop: r1.)"""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.2).astype(np.float32), n) for n, s in [
        ("c1.w", (6, 2, 3, 3)), ("c1.b", (6,)), ("c1b.w", (6, 6, 3, 3)), ("c1b.b", (6,)),
        ("c2.w", (8, 6, 3, 3)), ("c2.b", (8,)), ("fc.w", (8 * 4 * 4, 5)), ("fc.b", (5,))]]
    nodes = [
        helper.make_node("Conv", ["X", "c1.w", "c1.b"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "c1b.w", "c1b.b"], ["c1b"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1b"], ["r1b"]),
        helper.make_node("MaxPool", ["r1b"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "c2.w", "c2.b"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p2"], ["f"]),
        helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["logits"]),
    ]
    g = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("X", F32, [batch, 2, 16, 16])],
                          [helper.make_tensor_value_info("logits", F32, [batch, 5])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"X": rng.standard_normal((batch, 2, 16, 16)).astype(np.float32),
             "target": rng.integers(0, 5, batch).astype(np.int64)}
    return m, feeds


def transformer(seed=0, activation="gelu"):
    m, feeds = _bench().transformer_stack(blocks=3, d_model=16, heads=2, ffn=32, seq=8, batch=2,
                                          seed=seed, activation=activation)
    return m, feeds


MODELS = {
    "mlp": (mlp, "mse", "Y"),
    "cnn": (cnn, "cross_entropy", "logits"),
    "transformer": (transformer, "mse", "Y"),
}


def session(model, loss, output, recompute, optimizer=None, level=None, **kw):
    tm = build.training_model(model, loss=loss, output=output,
                              optimizer=optimizer or build.AdamW(lr=1e-2), recompute=recompute, **kw)
    so = None
    if level is not None:
        so = default_session_options()
        so.graph_optimization_level = level
    sess = TrainingSession(tm, session_options=so)
    sess.initialize()
    return tm, sess


def trajectory(sess, feeds, steps=3):
    losses = []
    for _ in range(steps):
        out = sess.train_step(feeds)
        losses.append(np.asarray(next(v for v in out.values() if np.ndim(v) == 0)))
    return losses, dict(sess.state)


def copies(sess, label=ALGORITHM):
    """Forward nodes copied for recompute in the program onnxruntime runs."""
    program = sess.programs(executed=True)[label]
    return [n for n in program.graph.node if n.name.endswith("/copy") or "/copy_" in n.name]


def kept_bytes(tm, sess, label=ALGORITHM):
    """Bytes of forward values the backward of the executed program reads."""
    meta = model_metadata(tm)
    program = sess.programs(executed=True)[label]
    return sum(rc.saved_activations(program.graph, [meta["loss"]], program.opset_import,
                                    data_inputs=meta["inputs"] + [meta["target"]]).values())


# ------------------------------------------------------------------ same training
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("mode", ["elementwise", "blocks", 2])
def test_same_losses_and_weights(name, mode):
    """Recompute changes the schedule, not the numbers: bit for bit where
    onnxruntime fuses nothing (ORT_ENABLE_BASIC), within 1e-6 relative with
    every optimization on (fusions may then differ between a node and its copy)."""
    build_model, loss, output = MODELS[name]
    model, feeds = build_model()
    for level, exact in ((ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, True),
                         (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, False)):
        _, plain = session(model, loss, output, None, level=level)
        tm, sess = session(model, loss, output, mode, level=level)
        l0, w0 = trajectory(plain, feeds)
        l1, w1 = trajectory(sess, feeds)
        for a, b in zip(l0, l1):
            if exact:
                assert a.tobytes() == b.tobytes(), (name, mode, l0, l1)
            else:
                np.testing.assert_allclose(b, a, rtol=1e-6)
        for k in w0:
            if exact:
                assert np.array_equal(w0[k], w1[k]), k
            else:
                np.testing.assert_allclose(w1[k], w0[k], rtol=1e-6, atol=1e-7, err_msg=k)
    if mode != "elementwise" or name == "transformer":
        assert copies(sess), "nothing was recomputed"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_blocks_copies_forward_nodes_and_keeps_less(name):
    build_model, loss, output = MODELS[name]
    model, feeds = build_model()
    tm0, plain = session(model, loss, output, None)
    tm1, sess = session(model, loss, output, "blocks")
    plain.train_step(feeds)
    sess.train_step(feeds)
    assert not copies(plain)
    copied = copies(sess)
    assert copied and all(n.domain in ("", "ai.onnx") for n in copied)
    assert kept_bytes(tm1, sess) < 0.75 * kept_bytes(tm0, plain)


def test_transformer_blocks_checkpoints_the_residual_stream():
    model, feeds = transformer()
    tm, sess = session(model, "mse", "Y", "blocks")
    sess.train_step(feeds)
    program = sess.programs()[ALGORITHM]
    gated = {n.input[0] for n in program.graph.node
             if n.op_type == "Reshape" and n.name.startswith("recompute/")}
    # recomputed segments start from the residual stream (block0's is the
    # input X itself: there the narrowest point is block0.ctx), never from
    # a wide attention value
    assert {"block0.res2", "block1.res1", "block1.res2"} <= gated, gated
    assert not any("attn" in v or "scores" in v or "qkv" in v for v in gated), gated
    # the attention probabilities of every block but the last are recomputed
    outs = {o for n in copies(sess) for o in n.output}
    for i in range(2):
        assert f"block{i}.attn/recompute" in outs


def test_elementwise_recomputes_activation_outputs_only():
    """Gelu and LayerNormalization outputs come back from inputs the backward
    keeps anyway; MatMul outputs are never recomputed."""
    model, feeds = transformer()
    tm0, plain = session(model, "mse", "Y", None)
    tm1, sess = session(model, "mse", "Y", "elementwise")
    sess.train_step(feeds)
    plain.train_step(feeds)
    ops = {n.op_type for n in copies(sess)}
    assert "Gelu" in ops and "LayerNormalization" in ops
    assert not ops & {"MatMul", "Gemm", "Softmax"}
    assert kept_bytes(tm1, sess) < kept_bytes(tm0, plain)


def test_segments_and_checkpoint_names():
    model, feeds = transformer()
    _, plain = session(model, "mse", "Y", None, level=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
    l0, w0 = trajectory(plain, feeds, 2)
    _, one = session(model, "mse", "Y", 1)
    assert not copies(one)  # one segment: nothing to recompute
    tm, named = session(model, "mse", "Y", ["block0.res2", "block1.res1"],
                        level=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
    assert model_metadata(tm)["recompute"] == {"checkpoints": ["block0.res2", "block1.res1"]}
    l1, w1 = trajectory(named, feeds, 2)
    assert [a.tobytes() for a in l0] == [b.tobytes() for b in l1]
    assert all(np.array_equal(w0[k], w1[k]) for k in w0)
    program = named.programs()[ALGORITHM]
    gated = {n.input[0] for n in program.graph.node
             if n.op_type == "Reshape" and n.name.startswith("recompute/")}
    assert gated <= {"block0.res2", "block1.res1", "X"}, gated


def test_copies_run_after_the_forward(tmp_path):
    """onnxruntime's own order: no copy runs before the backward, and every
    segment's copies run as a group (barrier), not all at the start of the backward."""
    model, feeds = transformer()
    tm = build.training_model(model, loss="mse", output="Y", recompute="blocks")
    so = default_session_options()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    sess = TrainingSession(tm, session_options=so)
    sess.initialize()
    sess.train_step(feeds)
    del sess  # onnxruntime writes a session's profile when the session goes
    gc.collect()
    order = []
    for path in glob.glob(str(tmp_path / "prof*.json")):
        with open(path) as f:
            events = json.load(f)
        names = [e["name"][: -len("_kernel_time")] for e in events
                 if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
        if any(n.endswith("/copy") for n in names):
            order = names
    assert order, "no profile of the algorithm program"
    backward = min(i for i, n in enumerate(order) if n.startswith("gradient/"))
    first_copy = min(i for i, n in enumerate(order) if n.endswith("/copy"))
    assert first_copy > backward
    # block0's attention is recomputed after block1's backward is well under way
    b0 = min(i for i, n in enumerate(order) if n.endswith("/copy") and "block0" in n)
    b1 = min(i for i, n in enumerate(order) if n.endswith("/copy") and "block1" in n)
    assert b1 < b0


def skip_norm_stack(blocks=3, d=16, ffn=32, seed=0):
    """Residual MLP blocks around com.microsoft SkipSimplifiedLayerNormalization,
    as onnxruntime-genai builds a decoder: the norm hands on two values (the
    normalized one and the residual sum), so every cut between blocks holds
    two.  The batch and sequence dimensions are symbolic: the gradient reads
    shapes at run time (``Shape`` of forward values)."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []
    h, res = "X", None
    for i in range(blocks):
        inits += [numpy_helper.from_array((1 + 0.1 * rng.standard_normal(d)).astype(np.float32), f"g{i}"),
                  numpy_helper.from_array((rng.standard_normal((d, ffn)) / 4).astype(np.float32), f"up{i}"),
                  numpy_helper.from_array((rng.standard_normal((ffn, d)) / 6).astype(np.float32), f"down{i}")]
        if res is None:
            nodes.append(helper.make_node("SimplifiedLayerNormalization", [h, f"g{i}"], [f"n{i}"], axis=-1))
            res = h
        else:
            nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [h, res, f"g{i}"],
                                          [f"n{i}", "", "", f"sum{i}"], domain="com.microsoft"))
            res = f"sum{i}"
        nodes += [helper.make_node("MatMul", [f"n{i}", f"up{i}"], [f"u{i}"]),
                  helper.make_node("Tanh", [f"u{i}"], [f"t{i}"]),
                  helper.make_node("MatMul", [f"t{i}", f"down{i}"], [f"h{i}"])]
        h = f"h{i}"
    nodes.append(helper.make_node("Add", [h, res], ["Y"]))
    dims = ["B", "S", d]
    g = helper.make_graph(nodes, "skip_norm_stack", [helper.make_tensor_value_info("X", F32, dims)],
                          [helper.make_tensor_value_info("Y", F32, dims)], inits)
    # (what onnx's shape inference cannot say of contrib ops, as the genai builder writes it)
    g.value_info.extend(helper.make_tensor_value_info(v, F32, dims) for i in range(blocks)
                        for v in (f"n{i}", f"sum{i}") if v != "sum0")
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    feeds = {"X": rng.standard_normal((2, 5, d)).astype(np.float32),
             "target": rng.standard_normal((2, 5, d)).astype(np.float32)}
    return m, feeds


def test_blocks_cut_and_copy_contrib_decoders():
    """A decoder built of contrib ops is cut at its two-valued norms, its
    contrib nodes are copied, it trains bit for bit as without recompute, and
    no backward ``Shape``/``Size`` reads a forward value that has a copy (the
    original would live until that reader: the whole forward, for L3)."""
    model, feeds = skip_norm_stack()
    level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    _, plain = session(model, "mse", "Y", None, level=level)
    _, sess = session(model, "mse", "Y", "blocks", level=level)
    l0, w0 = trajectory(plain, feeds)
    l1, w1 = trajectory(sess, feeds)
    assert [a.tobytes() for a in l0] == [b.tobytes() for b in l1]
    assert all(np.array_equal(w0[k], w1[k]) for k in w0)
    copied = copies(sess)
    assert ("com.microsoft", "SkipSimplifiedLayerNormalization") in {(n.domain, n.op_type) for n in copied}
    program = sess.programs(executed=True)[ALGORITHM]
    recomputed = {o[: -len("/recompute")] for n in copied for o in n.output if o.endswith("/recompute")}
    shape_reads = [n.input[0] for n in program.graph.node if n.op_type in rc.SHAPE_READERS]
    assert any(v.endswith("/recompute") for v in shape_reads)
    assert not recomputed & set(shape_reads), recomputed & set(shape_reads)


def test_gradient_check_with_recompute():
    """float64 MLP, SGD with lr = 1: the update is the gradient; it matches
    central differences of the loss along random directions."""
    model, feeds = mlp(sizes=(5, 7, 7, 3), batch=4, dtype=np.float64)
    tm, sess = session(model, "mse", "Y", "blocks", optimizer=build.SGD(lr=1.0))
    before = dict(sess.state)
    sess.train_step(feeds)
    grads = {k: before[k] - sess.state[k] for k in ("W0", "W1", "b1")}
    assert copies(sess)
    rng = np.random.default_rng(1)

    def loss_at(state):
        sess.load_state(state)
        y = sess.run({"X": feeds["X"]})["Y"]
        return float(np.mean((y - feeds["target"]) ** 2))

    for k, g in grads.items():
        d = rng.standard_normal(g.shape)
        eps = 1e-6
        plus = loss_at({**before, k: before[k] + eps * d})
        minus = loss_at({**before, k: before[k] - eps * d})
        np.testing.assert_allclose((plus - minus) / (2 * eps), np.sum(g * d), rtol=1e-6)


def test_dropout_is_kept_not_copied():
    """A copy of Dropout would draw another mask: its outputs are kept."""
    model, feeds = mlp()
    nodes = list(model.graph.node)
    at = next(i for i, n in enumerate(nodes) if n.output[0] == "h0")
    drop = helper.make_node("Dropout", ["h0", "ratio"], ["h0_drop"])
    for n in nodes[at + 1:]:
        n.input[:] = ["h0_drop" if i == "h0" else i for i in n.input]
    nodes.insert(at + 1, drop)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.append(numpy_helper.from_array(np.array(0.25, np.float32), "ratio"))
    tm, sess = session(model, "mse", "Y", "blocks")
    out = sess.train_step(feeds)
    assert np.isfinite(out[model_metadata(tm)["loss"]])
    assert copies(sess) and not any(n.op_type == "Dropout" for n in copies(sess))


def test_accumulate_and_metadata():
    model, feeds = mlp()
    tm, sess = session(model, "mse", "Y", "blocks", accumulate=2,
                       level=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
    assert model_metadata(tm)["recompute"] == "blocks"
    _, plain = session(model, "mse", "Y", None, accumulate=2,
                       level=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
    l0, w0 = trajectory(plain, feeds, 4)
    l1, w1 = trajectory(sess, feeds, 4)
    assert [a.tobytes() for a in l0] == [b.tobytes() for b in l1]
    assert all(np.array_equal(w0[k], w1[k]) for k in w0)
    for label in ("training_info[0].algorithm", "training_info[1].algorithm"):
        assert copies(sess, label)
    off = build.training_model(model, loss="mse", output="Y", recompute=False)
    assert "recompute" not in model_metadata(off)


# ------------------------------------------------------------------ bad values
@pytest.mark.parametrize("value", ["sometimes", "Blocks", 0, -2, 1.5, [], [""], ["h0", "h0"],
                                   {"segments": 2}, ("h0", 3)])
def test_bad_option_values(value):
    model, _ = mlp()
    with pytest.raises(ValueError, match="recompute"):
        build.training_model(model, loss="mse", output="Y", recompute=value)


def test_bad_checkpoint_names():
    model, _ = mlp()
    with pytest.raises(ValueError, match="recompute: checkpoint 'nope' is not a value"):
        build.training_model(model, loss="mse", output="Y", recompute=["nope"])
    with pytest.raises(ValueError, match="recompute: checkpoint 'X' is not a value computed"):
        build.training_model(model, loss="mse", output="Y", recompute=["X"])
    extra = helper.make_node("Neg", ["h0"], ["side"])
    model.graph.node.append(extra)
    model.graph.output.append(helper.make_tensor_value_info("side", F32, None))
    with pytest.raises(ValueError, match="not on the path to the output 'Y'"):
        build.training_model(model, loss="mse", output="Y", recompute=["side"])


def test_bad_metadata_is_a_training_model_error():
    model, feeds = mlp()
    tm = build.training_model(model, loss="mse", output="Y")
    tm.metadata_props.add(key="onnxtrain.recompute", value='"often"')
    with pytest.raises(TrainingModelError, match="onnxtrain.recompute"):
        sess = TrainingSession(tm)
        sess.initialize()
        sess.train_step(feeds)


def test_doctest():
    import doctest

    assert doctest.testmod(rc).failed == 0
