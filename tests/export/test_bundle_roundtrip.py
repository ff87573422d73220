"""onnxtrain.bundle (issue 32): save, train from the manifest alone with plain
onnxruntime (as JavaScript does), write state.bin back, load, continue.

Every model kind the issue names: the builder's, a hand-written
TrainingInfoProto model (initialization graphs, several algorithms), a fit
checkpoint, gradient accumulation, a learning-rate state variable, one output
bound to two variables, a scalar counter."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from bundle_runner import ManifestRunner
from models import F32, PREVIEW, linear_regression, mlp_classifier, model, tensor, training_info, vi
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession, build, bundle

BENCH = str(Path(__file__).resolve().parents[2] / "benchmarks")
RNG = np.random.default_rng(7)
X = RNG.standard_normal((8, 4)).astype(np.float32)
LABEL = RNG.integers(0, 3, 8).astype(np.int64)


def inference_mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.5, (4, 16)).astype(np.float32), "W1"),
             numpy_helper.from_array(np.zeros(16, np.float32), "b1"),
             numpy_helper.from_array(rng.normal(0, 0.5, (16, 3)).astype(np.float32), "W2"),
             numpy_helper.from_array(np.zeros(3, np.float32), "b2")]
    nodes = [helper.make_node("Gemm", ["X", "W1", "b1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "W2", "b2"], ["logits"])]
    graph = helper.make_graph(nodes, "mlp", [vi("X", F32, ["N", 4])], [vi("logits", F32, ["N", 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def builder_model(**options) -> onnx.ModelProto:
    options.setdefault("optimizer", build.AdamW(lr=0.01))
    return build.training_model(inference_mlp(), target="label", **options)


def feeds(i: int = 0) -> dict[str, np.ndarray]:
    return {"X": np.roll(X, i, axis=0), "label": np.roll(LABEL, i)}


def assert_same_state(a, b) -> None:
    sa, sb = dict(a.state), dict(b.state)
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and sa[name].shape == sb[name].shape, name
        np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)


# ---------------------------------------------------------------- round trips
def test_builder_session_round_trip_continues_identically(tmp_path):
    sess = TrainingSession(builder_model())
    for i in range(3):
        sess.train_step(feeds(i))
    assert bundle.save(sess, tmp_path / "b") == tmp_path / "b"
    loaded = bundle.load(tmp_path / "b")
    assert_same_state(sess, loaded)
    assert loaded.fit_position is None
    for i in range(3, 6):
        a, b = sess.train_step(feeds(i)), loaded.train_step(feeds(i))
        assert a.keys() == b.keys()
        np.testing.assert_array_equal(a["loss"], b["loss"])
    assert_same_state(sess, loaded)
    np.testing.assert_array_equal(sess.run({"X": X})["logits"], loaded.run({"X": X})["logits"])
    # ... and it exports: the inference model runs in plain onnxruntime
    path = loaded.export(tmp_path / "trained.onnx")
    got = ort.InferenceSession(str(path)).run(None, {"X": X})[0]
    np.testing.assert_allclose(got, sess.run({"X": X})["logits"], rtol=1e-6, atol=1e-6)


def test_a_model_source_bundles_its_initializers(tmp_path):
    m = builder_model()
    bundle.save(m, tmp_path / "from_proto")
    onnx.save(m, tmp_path / "m.onnx")
    bundle.save(tmp_path / "m.onnx", tmp_path / "from_path")
    bundle.save(m.SerializeToString(), tmp_path / "from_bytes")
    fresh = TrainingSession(m)
    for name in ("from_proto", "from_path", "from_bytes"):
        assert_same_state(fresh, bundle.load(tmp_path / name))


def test_hand_written_model_with_initialization_graphs_and_two_algorithms(tmp_path):
    m = mlp_classifier("adam", groups=[["W1", "b1"], ["W2", "b2"]])
    bundle.save(m, tmp_path / "b")
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert [a["label"] for a in manifest["algorithms"]] == [
        "training_info[0].algorithm", "training_info[1].algorithm"]
    assert [i["file"] for i in manifest["initializations"]] == [
        "program_initialization_0.onnx", "program_initialization_1.onnx"]
    trainable = {e["name"] for e in manifest["state"] if e["trainable"]}
    assert trainable == {"W1", "b1", "W2", "b2"}  # the Gradient nodes' xs (no builder metadata)
    assert manifest["training"]["loss"] == "loss" and manifest["training"]["target"] == "label"

    python, js = TrainingSession(m), ManifestRunner(tmp_path / "b")
    python.initialize()
    js.initialize()
    for i in range(4):
        algorithm = None if i < 2 else i % 2
        a, b = python.train_step(feeds(i), algorithm=algorithm), js.train_step(feeds(i), algorithm=algorithm)
        assert sorted(a) == sorted(b)
        np.testing.assert_array_equal(a["loss"], b["loss"])
    for name, value in python.state.items():
        np.testing.assert_array_equal(js.state[name], value, err_msg=name)

    loaded = bundle.load(tmp_path / "b")
    loaded.initialize()  # the initialization graphs came along
    fresh = TrainingSession(m)
    fresh.initialize()
    assert_same_state(fresh, loaded)


CASES = {
    "builder adamw": lambda: builder_model(),
    "builder sgd momentum, accumulate 3, cosine": lambda: builder_model(
        optimizer=build.SGD(lr=0.1, momentum=0.9), accumulate=3, schedule=build.cosine(20)),
    "hand-written adam, two algorithms": lambda: mlp_classifier("adam", groups=[["W1", "b1"], ["W2", "b2"]]),
    "hand-written momentum": lambda: mlp_classifier("momentum"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_manifest_alone_trains_as_python_does(case, tmp_path):
    """What JavaScript does: the programs and the bindings of the manifest,
    on plain onnxruntime, give Python's losses and state (standard programs:
    bit for bit)."""
    m = CASES[case]()
    python = TrainingSession(m, fused_kernels=False)
    bundle.save(python, tmp_path / "b")
    js = ManifestRunner(tmp_path / "b")
    cycle = json.loads((tmp_path / "b" / "manifest.json").read_text())["training"]["cycle"] or [None]
    for i in range(6):
        algorithm = cycle[i % len(cycle)]
        a, b = python.train_step(feeds(i), algorithm=algorithm), js.train_step(feeds(i), algorithm=algorithm)
        np.testing.assert_array_equal(a["loss"], b["loss"])
    for name, value in python.state.items():
        np.testing.assert_array_equal(js.state[name], value, err_msg=name)
    np.testing.assert_array_equal(js.run({"X": X})[python.inference_outputs[0]],
                                  python.run({"X": X})[python.inference_outputs[0]])


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_state_bin_written_elsewhere_loads_and_trains_on_identically(case, tmp_path):
    """A copy of the bundle with its state.bin replaced by another trainer's
    bytes (the manifest's layout, as JavaScript's stateBytes() writes it)
    loads with that state and continues as the Python session it came from."""
    python = TrainingSession(CASES[case]())
    bundle.save(python, tmp_path / "b")
    js = ManifestRunner(tmp_path / "b")
    for i in range(4):
        python.train_step(feeds(i))
        js.train_step(feeds(i))
    (tmp_path / "b" / "state.bin").write_bytes(js.state_bytes())
    loaded = bundle.load(tmp_path / "b")
    for name, value in python.state.items():
        np.testing.assert_allclose(loaded.state[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
        np.testing.assert_array_equal(loaded.state[name], js.state[name], err_msg=name)
    # from the same state, Python and the loaded session train alike
    python.load_state(loaded.state)
    for i in range(4, 7):
        np.testing.assert_array_equal(python.train_step(feeds(i))["loss"], loaded.train_step(feeds(i))["loss"])
    assert_same_state(python, loaded)
    # the bundle's inference.onnx reads state.bin: the new weights
    out = ort.InferenceSession(str(tmp_path / "b" / "inference.onnx")).run(None, {"X": X})[0]
    np.testing.assert_allclose(out, js.run({"X": X})[python.inference_outputs[0]], rtol=1e-6, atol=1e-6)


def conv_batchnorm() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Conv -> BatchNormalization (running statistics are state) -> Relu -> MatMul."""
    rng = np.random.default_rng(0)
    params = {"c.w": rng.normal(0, 0.3, (8, 1, 3, 3)), "c.b": np.zeros(8), "bn.s": np.ones(8),
              "bn.b": np.zeros(8), "bn.m": np.zeros(8), "bn.v": np.ones(8), "fc.w": rng.normal(0, 0.1, (288, 10))}
    nodes = [helper.make_node("Conv", ["X", "c.w", "c.b"], ["c"], kernel_shape=[3, 3]),
             helper.make_node("BatchNormalization", ["c", "bn.s", "bn.b", "bn.m", "bn.v"], ["n"]),
             helper.make_node("Relu", ["n"], ["r"]), helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("MatMul", ["f", "fc.w"], ["logits"])]
    graph = helper.make_graph(nodes, "conv_bn", [vi("X", F32, ["N", 1, 8, 8])], [vi("logits", F32, ["N", 10])],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in params.items()])
    batch = {"X": rng.normal(size=(16, 1, 8, 8)).astype(np.float32), "label": rng.integers(0, 10, 16)}
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), batch


def workload(name: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A benchmark workload (benchmarks/workloads.py): the model and one batch."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import workloads

    m, _, batch = getattr(workloads, f"build_{name}")(0)
    return m, batch


LAYERS = {"conv + batchnorm": conv_batchnorm, "lstm": lambda: workload("lstm"),
          "transformer block": lambda: workload("transformer")}


@pytest.mark.parametrize("case", sorted(LAYERS))
def test_layers_train_from_the_manifest_bit_for_bit(case, tmp_path):
    """The issue's JS-against-Python models beyond the MLP: running statistics
    bound as state, recurrences, attention; Python's standard programs (no
    fused kernels, no NCHWc) and the bundle's agree bit for bit."""
    m, batch = LAYERS[case]()
    target = "target" if "target" in batch else "label"
    loss = "mse" if target == "target" else "cross_entropy"
    python = TrainingSession(build.training_model(m, loss=loss, target=target, optimizer=build.AdamW(lr=1e-3)),
                             fused_kernels=False)
    bundle.save(python, tmp_path / "b")
    js = ManifestRunner(tmp_path / "b")
    for _ in range(2):
        np.testing.assert_array_equal(js.train_step(batch)["loss"], python.train_step(batch)["loss"])
    for name, value in python.state.items():
        np.testing.assert_array_equal(js.state[name], value, err_msg=name)
    (tmp_path / "b" / "state.bin").write_bytes(js.state_bytes())
    assert_same_state(python, bundle.load(tmp_path / "b"))


def test_fit_position_survives_and_fit_resumes(tmp_path):
    Xs = RNG.standard_normal((64, 4)).astype(np.float32)
    ys = RNG.integers(0, 3, 64).astype(np.int64)
    straight = TrainingSession(builder_model())
    straight.fit((Xs, ys), epochs=3, batch_size=16, shuffle=False, progress=False)
    first = TrainingSession(builder_model())
    first.fit((Xs, ys), epochs=2, batch_size=16, shuffle=False, progress=False)
    bundle.save(first, tmp_path / "b")
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["fit_position"] == {"epoch": 2, "batch": 0, "step": 8}
    loaded = bundle.load(tmp_path / "b")
    assert loaded.fit_position == {"epoch": 2, "batch": 0, "step": 8, "source": "checkpoint"}
    history = loaded.fit((Xs, ys), epochs=3, batch_size=16, shuffle=False, progress=False)
    assert history.epochs == [2]
    assert_same_state(straight, loaded)


def test_a_checkpoint_file_keeps_its_fit_position(tmp_path):
    sess = TrainingSession(builder_model())
    sess.fit((np.tile(X, (4, 1)), np.tile(LABEL, 4)), epochs=1, batch_size=8, progress=False)
    sess.export(tmp_path / "ckpt.onnx", training=True)
    bundle.save(tmp_path / "ckpt.onnx", tmp_path / "b")
    loaded = bundle.load(tmp_path / "b")
    assert loaded.fit_position == {"epoch": 1, "batch": 0, "step": 4, "source": "checkpoint"}
    assert_same_state(sess, loaded)


def test_gradient_accumulation_cycle_and_learning_rate_state(tmp_path):
    m = builder_model(optimizer=build.SGD(lr=0.1, momentum=0.9), accumulate=3, schedule=build.cosine(20))
    sess = TrainingSession(m)
    sess.fit((np.tile(X, (3, 1)), np.tile(LABEL, 3)), epochs=1, batch_size=8, shuffle=False, progress=False)
    bundle.save(sess, tmp_path / "b")
    training = json.loads((tmp_path / "b" / "manifest.json").read_text())["training"]
    assert training["cycle"] == [0, 0, 1]
    assert training["learning_rate"] == {"state": "lr", "base": 0.1}
    assert training["inputs"] == ["X"] and training["target"] == "label"
    assert training["task"] == "classification" and training["metrics"] == ["accuracy"]
    assert training["classes"]["count"] == 3
    loaded = bundle.load(tmp_path / "b")
    assert loaded.learning_rate == sess.learning_rate
    for i in range(3):  # the cycle continues where it stood
        algorithm = training["cycle"][i]
        np.testing.assert_array_equal(sess.train_step(feeds(i), algorithm)["loss"],
                                      loaded.train_step(feeds(i), algorithm)["loss"])
    assert_same_state(sess, loaded)


def twice_bound_model() -> onnx.ModelProto:
    """W is trained; its copy V (read by nothing else) is bound to the same output."""
    nodes = [helper.make_node("MatMul", ["X", "W"], ["Y"])]
    algo = [helper.make_node("ReduceSumSquare", ["Y"], ["loss"], keepdims=0),
            helper.make_node("Gradient", ["W", "X"], ["dW"], domain=PREVIEW, xs=["W"], zs=["X"], y="loss"),
            helper.make_node("Mul", ["lr", "dW"], ["step"]), helper.make_node("Sub", ["W", "step"], ["W_new"]),
            helper.make_node("Add", ["n", "one"], ["n_new"])]
    ti = training_info(algo, [tensor("lr", np.float32(0.01)), tensor("n", np.int64(0)), tensor("one", np.int64(1)),
                              tensor("V", np.zeros((4, 2), np.float32))],
                       [], [vi("loss", F32, []), vi("W_new", F32, [4, 2]), vi("n_new", TensorProto.INT64, [])],
                       [("W", "W_new"), ("V", "W_new"), ("n", "n_new")])
    w = np.arange(8, dtype=np.float32).reshape(4, 2) / 10
    return model(nodes, [vi("X", F32, ["N", 4])], [vi("Y", F32, ["N", 2])], [tensor("W", w)], [ti])


def test_one_output_bound_to_two_variables_and_a_scalar_counter(tmp_path):
    python = TrainingSession(twice_bound_model())
    bundle.save(python, tmp_path / "b")
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["algorithms"][0]["bindings"] == [
        {"key": "W", "value": "W_new"}, {"key": "V", "value": "W_new"}, {"key": "n", "value": "n_new"}]
    n = next(e for e in manifest["state"] if e["name"] == "n")
    assert n["shape"] == [] and n["dtype"] == "int64" and n["length"] == 8
    js = ManifestRunner(tmp_path / "b")
    for i in range(2):
        python.train_step({"X": X})
        js.train_step({"X": X})
    assert js.state["n"].shape == () and int(js.state["n"]) == 2
    np.testing.assert_array_equal(js.state["V"], js.state["W"])
    (tmp_path / "b" / "state.bin").write_bytes(js.state_bytes())
    loaded = bundle.load(tmp_path / "b")
    assert loaded.state["n"].shape == () and int(loaded.state["n"]) == 2
    assert_same_state(python, loaded)
    loaded.train_step({"X": X})
    np.testing.assert_array_equal(loaded.state["V"], loaded.state["W"])
    assert loaded.state["n"].shape == () and int(loaded.state["n"]) == 3


def test_sparse_zero_state_is_stored_dense(tmp_path):
    """The builder keeps large zero-filled moments as empty sparse initializers;
    the bundle stores them dense in state.bin, like any state variable."""
    from test_sparse_zero_state import batches, two_layer

    m = build.training_model(two_layer(), loss="mse", optimizer=build.Adam(lr=0.01))
    assert m.training_info[0].algorithm.sparse_initializer
    python = TrainingSession(m)
    data = batches()
    python.train_step(data[0])
    bundle.save(python, tmp_path / "b")
    js, loaded = ManifestRunner(tmp_path / "b"), bundle.load(tmp_path / "b")
    assert_same_state(python, loaded)
    for batch in data[1:]:
        loss = python.train_step(batch)["loss"]
        np.testing.assert_array_equal(js.train_step(batch)["loss"], loss)
        np.testing.assert_array_equal(loaded.train_step(batch)["loss"], loss)


def test_an_inference_model_is_refused(tmp_path):
    with pytest.raises(bundle.BundleError, match="no training_info"):
        bundle.save(inference_mlp(), tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_float64_linear_regression(tmp_path):
    m = linear_regression("adagrad", dtype=np.float64)
    python = TrainingSession(m)
    bundle.save(python, tmp_path / "b")
    js = ManifestRunner(tmp_path / "b")
    x = RNG.standard_normal((5, 3))
    t = RNG.standard_normal((5, 1))
    for _ in range(3):
        np.testing.assert_array_equal(python.train_step({"X": x, "T": t})["loss"],
                                      js.train_step({"X": x, "T": t})["loss"])
    assert js.state["W"].dtype == np.float64
    np.testing.assert_array_equal(js.state["W"], python.state["W"])
