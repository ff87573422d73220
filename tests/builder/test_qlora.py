"""build.LoRA on quantized weights (QLoRA): MatMulNBits and DequantizeLinear codes.

Oracles: plain onnxruntime on the base model (first forward, bit for bit),
numpy float64 on the dequantized weights (losses and adapter updates over
SGD steps, onnxruntime's MatMulNBits at accuracy_level 0), the codes,
scales and zero points of the export (bit for bit) and the requantization
report against numpy."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession, build
from onnxtrain.build import lora as lora_mod
from onnxtrain.builder import qlora

F32 = TensorProto.FLOAT
K1, N1, N2, BATCH = 40, 24, 6, 8   # K1 not a multiple of the block: padding covered


def _nbits_node(bits, block, level, zp):
    ins = ["X", "W1_q", "W1_scales"] + (["W1_zp"] if zp else [])
    return helper.make_node("MatMulNBits", ins, ["h"], domain="com.microsoft", name="mm1",
                            K=K1, N=N1, bits=bits, block_size=block, accuracy_level=level)


def quantized_model(bits=4, block=16, level=0, zp=False, dq_zp=True, seed=0, dq_block=0):
    """X[N, K1] -> MatMulNBits(W1) -> Relu -> MatMul(DequantizeLinear(W2 int8, per axis)) -> Y
    (``dq_block``: W2 int4 codes with a scale per ``dq_block`` rows of each column).

    Returns (model, float64 W1 [K1, N1], float64 W2 [N1, N2])."""
    rng = np.random.default_rng(seed)
    node = _nbits_node(bits, block, level, zp)
    w1 = rng.standard_normal((K1, N1)) / 4
    like = None
    if zp:
        blocks = (K1 + block - 1) // block
        like = np.zeros((N1, (blocks * bits + 7) // 8), np.uint8)
    q = qlora.quantize_nbits(node, w1, like, np.dtype(np.float32))
    inits = {"W1_q": q[1], "W1_scales": q[2].reshape(-1)}
    if zp:
        inits["W1_zp"] = q[3].reshape(-1)
    w1 = qlora.nbits_weight(node, inits)
    dq_attrs = {"axis": 1}
    if dq_block:
        codes2 = rng.integers(-7, 8, (N1, N2)).astype(ml_dtypes.int4)
        scale2 = (rng.uniform(0.5, 1.5, (N1 // dq_block, N2)) / 20).astype(np.float32)
        dq_attrs = {"axis": 0, "block_size": dq_block}
    else:
        codes2 = rng.integers(-100, 100, (N1, N2)).astype(np.int8)
        scale2 = (rng.uniform(0.5, 1.5, N2) / 200).astype(np.float32)
    inits.update({"W2_q": codes2, "W2_scale": scale2})
    dq_in = ["W2_q", "W2_scale"]
    if dq_zp:
        inits["W2_zp"] = rng.integers(-3, 3, scale2.shape).astype(codes2.dtype)
        dq_in.append("W2_zp")
    nodes = [node, helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("DequantizeLinear", dq_in, ["W2"], name="dq2", **dq_attrs),
             helper.make_node("MatMul", ["r", "W2"], ["Y"], name="mm2")]
    graph = helper.make_graph(nodes, "q", [helper.make_tensor_value_info("X", F32, ["N", K1])],
                              [helper.make_tensor_value_info("Y", F32, ["N", N2])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                helper.make_opsetid("com.microsoft", 1)])
    w2 = qlora.dq_weight(nodes[2], inits)
    return m, w1, w2


def ort_run(model, feeds, optimize=True):
    """Plain onnxruntime; ``optimize=False``: no graph rewrites (onnxruntime
    may fuse DequantizeLinear + MatMul into a product on quantized activations)."""
    opts = ort.SessionOptions()
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return s.run(None, feeds)[0]


def session(model, **kw):
    tm = build.training_model(model, loss="mse", optimizer=build.SGD(lr=0.5),
                              lora=build.LoRA(rank=3, alpha=6, **kw))
    sess = TrainingSession(tm)
    sess.initialize()
    return sess


def reference_steps(x, t, w1, w2, a1, a2, steps, lr=0.5, s=2.0):
    """float64 SGD on (1) with mse: returns losses and the final adapters."""
    b1, b2 = np.zeros((3, N1)), np.zeros((3, N2))
    losses = []
    for _ in range(steps):
        h = x @ w1 + s * (x @ a1) @ b1
        r = np.maximum(h, 0)
        y = r @ w2 + s * (r @ a2) @ b2
        losses.append(np.mean((y - t) ** 2))
        dy = 2 * (y - t) / y.size
        gb2, ga2 = s * (r @ a2).T @ dy, s * r.T @ (dy @ b2.T)
        dr = dy @ w2.T + s * (dy @ b2.T) @ a2.T
        dh = dr * (h > 0)
        gb1, ga1 = s * (x @ a1).T @ dh, s * x.T @ (dh @ b1.T)
        a1, b1, a2, b2 = a1 - lr * ga1, b1 - lr * gb1, a2 - lr * ga2, b2 - lr * gb2
    return losses, {"W1_q.lora_A": a1, "W1_q.lora_B": b1, "W2_q.lora_A": a2, "W2_q.lora_B": b2}


def data(seed=1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((BATCH, K1)).astype(np.float32),
            rng.standard_normal((BATCH, N2)).astype(np.float32))


def test_quantized_targets_are_named_by_their_codes_and_frozen():
    m, _, _ = quantized_model()
    tm = build.training_model(m, loss="mse", optimizer=build.SGD(lr=0.1), lora=build.LoRA(rank=3))
    info = lora_mod.info_of(tm)
    got = {e["weight"]: (e["in"], e["out"], e.get("quantized")) for e in info["targets"]}
    assert got == {"W1_q": (K1, N1, "MatMulNBits"), "W2_q": (N1, N2, "DequantizeLinear")}
    sess = TrainingSession(tm)
    adapters = sorted(f"{w}.lora_{s}" for w in got for s in "AB")
    assert sorted(k for k in sess.state if ".lora_" in k) == adapters
    assert all(sess.state[k].dtype == np.float32 for k in adapters)
    # No float copy of a base weight in the session's state or initializers.
    shapes = {(K1, N1), (N1, K1), (N1, N2)}
    for t in sess.model.graph.initializer:
        assert not (t.data_type == F32 and tuple(t.dims) in shapes), t.name
    with pytest.raises(ValueError, match="'W1_scales' cannot take an adapter"):
        build.training_model(m, loss="mse", lora=build.LoRA(targets=["W1_scales"]))


@pytest.mark.parametrize("bits, block, zp, dq_block", [(4, 16, False, 0), (4, 32, True, 0),
                                                      (8, 16, True, 0), (4, 16, True, 8)])
def test_qlora_steps_match_float64_on_dequantized_weights(bits, block, zp, dq_block):
    m, w1, w2 = quantized_model(bits=bits, block=block, zp=zp, level=0, dq_block=dq_block)
    x, t = data()
    # The decoding of the codes is onnxruntime's (accuracy_level 0: float products).
    probe = np.eye(K1, dtype=np.float32)
    only1 = onnx.ModelProto()
    only1.CopyFrom(m)
    del only1.graph.node[1:]
    only1.graph.output[0].CopyFrom(helper.make_tensor_value_info("h", F32, ["N", N1]))
    np.testing.assert_allclose(ort_run(only1, {"X": probe}), w1, rtol=1e-6, atol=1e-7)
    sess = session(m)
    a1, a2 = (sess.state[f"{w}.lora_A"].astype(np.float64) for w in ("W1_q", "W2_q"))
    np.testing.assert_array_equal(sess.run({"X": x})["Y"], ort_run(m, {"X": x}))
    losses = [float(sess.train_step({"X": x, "target": t})["loss"]) for _ in range(3)]
    ref, adapters = reference_steps(x.astype(np.float64), t.astype(np.float64), w1, w2, a1, a2, 3)
    np.testing.assert_allclose(losses, ref, rtol=2e-5)
    for k, v in adapters.items():
        np.testing.assert_allclose(sess.state[k], v, rtol=1e-4, atol=1e-6)
    assert np.abs(adapters["W1_q.lora_B"]).max() > 1e-3


def test_run_is_onnxruntime_matmulnbits_at_accuracy_level_4():
    m, _, _ = quantized_model(level=4)
    x, t = data()
    sess = session(m)
    np.testing.assert_array_equal(sess.run({"X": x})["Y"], ort_run(m, {"X": x}))
    for _ in range(2):
        sess.train_step({"X": x, "target": t})
    exported = sess.to_model()
    np.testing.assert_array_equal(sess.run({"X": x})["Y"], ort_run(exported, {"X": x}))


def test_export_keeps_codes_and_writes_the_exact_side_branch(tmp_path):
    m, w1, w2 = quantized_model(zp=True, level=0)
    x, t = data()
    sess = session(m, dropout=0.1)
    for _ in range(3):
        sess.train_step({"X": x, "target": t})
    path = sess.export(tmp_path / "q.onnx")
    out = onnx.load(path)
    base = {t.name: t.SerializeToString() for t in m.graph.initializer}
    got = {t.name: t for t in out.graph.initializer}
    for name, blob in base.items():  # codes, scales and zero points bit for bit
        assert got[name].SerializeToString() == blob, name
    kinds = [n.op_type for n in out.graph.node]
    assert kinds.count("MatMulNBits") == 1 and kinds.count("DequantizeLinear") == 1
    assert "Dropout" not in kinds
    assert not any(p.key.startswith("onnxtrain.lora") for p in out.metadata_props)
    # Exactly X·W_q + s·(X·A)·B, run by plain onnxruntime.
    st = {k: v.astype(np.float64) for k, v in sess.state.items()}
    h = x @ w1 + 2.0 * (x @ st["W1_q.lora_A"]) @ st["W1_q.lora_B"]
    r = np.maximum(h, 0)
    y = r @ w2 + 2.0 * (r @ st["W2_q.lora_A"]) @ st["W2_q.lora_B"]
    np.testing.assert_allclose(ort_run(out, {"X": x}, optimize=False), y, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ort_run(out, {"X": x}), sess.run({"X": x})["Y"])


@pytest.mark.parametrize("dq_block", [0, 8])
def test_requantizing_is_explicit_and_reports_its_error(tmp_path, dq_block):
    m, w1, w2 = quantized_model(zp=True, level=0, dq_block=dq_block)
    x, t = data()
    sess = session(m)
    for _ in range(3):
        sess.train_step({"X": x, "target": t})
    with pytest.warns(UserWarning, match="of the LoRA update lost"):
        report = build.export_requantized(sess, tmp_path / "r.onnx")
    out = onnx.load(tmp_path / "r.onnx")
    assert [n.op_type for n in out.graph.node] == ["MatMulNBits", "Relu", "DequantizeLinear", "MatMul"]
    assert sorted(report) == ["W1_q", "W2_q"]
    st = {k: v.astype(np.float64) for k, v in sess.state.items()}
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    for w, base, node in (("W1_q", w1, out.graph.node[0]), ("W2_q", w2, out.graph.node[2])):
        merged = base + 2.0 * st[f"{w}.lora_A"] @ st[f"{w}.lora_B"]
        after = (qlora.nbits_weight(node, inits) if w == "W1_q" else qlora.dq_weight(node, inits))
        delta = np.linalg.norm(merged - base)
        assert report[w]["update_norm"] == pytest.approx(delta, rel=1e-6)
        assert report[w]["update_error"] == pytest.approx(np.linalg.norm(after - merged) / delta, rel=1e-6)
        assert report[w]["max_abs_error"] == pytest.approx(np.abs(after - merged).max(), rel=1e-6)
    # The new codes are the nearest in the new grid: each error is under one step of its block.
    node1 = out.graph.node[0]
    st1 = np.repeat(inits["W1_scales"].astype(np.float64).reshape(N1, -1), 16, axis=1)[:, :K1].T
    merged1 = w1 + 2.0 * st["W1_q.lora_A"] @ st["W1_q.lora_B"]
    assert np.all(np.abs(qlora.nbits_weight(node1, inits) - merged1) <= st1 * (1 + 1e-6))
    merged2 = w2 + 2.0 * st["W2_q.lora_A"] @ st["W2_q.lora_B"]
    step2 = inits["W2_scale"].astype(np.float64)
    step2 = np.repeat(step2, dq_block, axis=0) if dq_block else step2[None, :]
    assert np.all(np.abs(qlora.dq_weight(out.graph.node[2], inits) - merged2) <= step2 * (1 + 1e-6))
    assert not np.array_equal(inits["W1_scales"], numpy_helper.to_array(m.graph.initializer[1]))
    assert report["W1_q"]["update_error"] > 0


def test_pack_and_unpack_are_inverse():
    rng = np.random.default_rng(0)
    for bits in (2, 4, 8):
        codes = rng.integers(0, 1 << bits, (5, 13)).astype(np.uint8)
        row = (13 * bits + 7) // 8
        assert np.array_equal(qlora.unpack_codes(qlora.pack_codes(codes, bits, row), bits, 13), codes)
    # Low bits first, as onnxruntime packs them.
    assert qlora.pack_codes(np.array([[1, 2]], np.uint8), 4, 1)[0, 0] == 0x21


def test_adapter_file_applies_the_side_branch_to_the_base(tmp_path):
    m, _, _ = quantized_model(zp=True, level=0)
    x, t = data()
    sess = session(m)
    for _ in range(2):
        sess.train_step({"X": x, "target": t})
    lora_mod.save_adapters(sess, tmp_path / "a.npz")
    applied = lora_mod.apply_adapters(m, tmp_path / "a.npz")
    assert [n.op_type for n in applied.graph.node] == [n.op_type for n in sess.to_model().graph.node]
    np.testing.assert_array_equal(ort_run(applied, {"X": x}), sess.run({"X": x})["Y"])
    written = lora_mod.apply_adapters(m, tmp_path / "a.npz", tmp_path / "applied.onnx")
    np.testing.assert_array_equal(ort_run(onnx.load(written), {"X": x}), sess.run({"X": x})["Y"])


def test_no_dequantized_weight_is_held_by_the_training_program(tmp_path):
    """The backward of MatMulNBits unpacks codes that are initializers: onnxruntime's
    constant folding would turn each into a float weight held for the session's life."""
    from genai_cases import FOLDERS, phrase_batch

    model = onnx.load(str(FOLDERS["int4"] / "model.onnx"))
    shapes = set()
    for n in model.graph.node:
        if n.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in n.attribute}
            shapes |= {(attrs["K"], attrs["N"]), (attrs["N"], attrs["K"])}
    tm = build.training_model(model, loss="cross_entropy", optimizer=build.SGD(lr=0.1),
                              lora=build.LoRA(rank=2))
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    sess = TrainingSession(tm, session_options=so)
    sess.initialize()
    sess.train_step(phrase_batch())  # the training program's session is the last one made
    optimized = onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False)
    assert any(n.op_type == "MatMulNBits" for n in optimized.graph.node)
    own = {t.name for t in model.graph.initializer}  # the embedding is [vocab, hidden] too
    held = [(t.name, tuple(t.dims)) for t in optimized.graph.initializer
            if t.data_type == F32 and tuple(t.dims) in shapes and t.name not in own]
    assert held == []


def test_qlora_on_the_genai_llama_equals_lora_on_its_dequantized_weights():
    """The int4 genai Llama (accuracy_level 0) against the same graph with each
    MatMulNBits replaced by MatMul on its dequantized weight, adapters equal:
    losses and adapters after SGD steps agree to float32 rounding."""
    from genai_cases import FOLDERS, phrase_batch

    m = onnx.load(str(FOLDERS["int4"] / "model.onnx"))
    for n in m.graph.node:
        for a in n.attribute:
            if a.name == "accuracy_level":
                a.i = 0
    f = onnx.ModelProto()
    f.CopyFrom(m)
    arrays = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    inits = [t for t in f.graph.initializer if not t.name.endswith(("_Q4", "_scales"))]
    for n in f.graph.node:
        if n.op_type == "MatMulNBits":
            inits.append(numpy_helper.from_array(qlora.nbits_weight(n, arrays).astype(np.float32), n.input[1]))
            n.CopyFrom(helper.make_node("MatMul", [n.input[0], n.input[1]], list(n.output), name=n.name))
    del f.graph.initializer[:]
    f.graph.initializer.extend(inits)

    def make(model):
        tm = build.training_model(model, loss="cross_entropy", optimizer=build.SGD(lr=0.5),
                                  lora=build.LoRA(rank=4, alpha=8))
        s = TrainingSession(tm)
        s.initialize()
        return s

    quantized, dense = make(m), make(f)
    assert sorted(quantized.state) == sorted(dense.state)
    dense.load_state(dict(quantized.state))
    batch = phrase_batch()
    for _ in range(3):
        lq, ld = (float(s.train_step(batch)["loss"]) for s in (quantized, dense))
        assert lq == pytest.approx(ld, rel=1e-5)
    for k, v in dense.state.items():
        np.testing.assert_allclose(quantized.state[k], v, rtol=1e-4, atol=1e-5, err_msg=k)
    assert np.abs(dense.state["model.layers.0.attn.o_proj.MatMul.weight_Q4.lora_B"]).max() > 1e-3
