"""The bundle's programs as another runtime meets them (issue 32): standard
ops only, IR version 10 at most, model-local functions inlined, constants
stored once in constants.bin, inference.onnx a plain model on state.bin."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from bundle_runner import ManifestRunner
from models import F32, PREVIEW, tensor, training_info, vi
from onnx import helper, numpy_helper

from onnxtrain import TrainingSession, build, bundle

RNG = np.random.default_rng(11)
X = RNG.standard_normal((6, 8)).astype(np.float32)
LABEL = (np.arange(6) % 3).astype(np.int64)


def programs_of(folder: Path) -> dict[str, onnx.ModelProto]:
    return {p.name: onnx.load(p, load_external_data=False) for p in sorted(folder.glob("*.onnx"))}


def regression_with(main_nodes, inits, opset=17, functions=(), ir_version=None, extra_inputs=()):
    """A hand-written SGD regression on W: Y = main(X), loss = mean((Y - T)^2)."""
    algo = [helper.make_node("Sub", ["Y", "T"], ["d"]), helper.make_node("Mul", ["d", "d"], ["sq"]),
            helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0),
            helper.make_node("Gradient", ["W", "X", "T"], ["dW"], domain=PREVIEW, xs=["W"], zs=["X", "T"],
                             y="loss"),
            helper.make_node("Mul", ["lr", "dW"], ["dWlr"]), helper.make_node("Sub", ["W", "dWlr"], ["W_new"])]
    w = next(t for t in inits if t.name == "W")
    ti = training_info(algo, [tensor("lr", np.float32(0.05))], [vi("T", F32, ["N", 2])],
                       [vi("loss", F32, []), vi("W_new", F32, list(w.dims))], [("W", "W_new")])
    graph = helper.make_graph(main_nodes, "main", [vi("X", F32, ["N", 8]), *extra_inputs],
                              [vi("Y", F32, ["N", 2])], inits)
    imports = [helper.make_opsetid("", opset), helper.make_opsetid(PREVIEW, 1)]
    imports += [helper.make_opsetid(f.domain, 1) for f in functions]
    m = helper.make_model(graph, opset_imports=imports, functions=list(functions))
    if ir_version is not None:
        m.ir_version = ir_version
    m.training_info.extend([ti])
    return m


def weights(shape=(8, 2), seed=0):
    return numpy_helper.from_array(np.random.default_rng(seed).normal(0, 0.3, shape).astype(np.float32), "W")


def test_an_op_outside_the_standard_domains_is_refused_naming_it(tmp_path):
    nodes = [helper.make_node("MatMul", ["X", "W"], ["Y0"]),
             helper.make_node("Gelu", ["Y0"], ["Y"], domain="com.microsoft", name="gelu")]
    m = regression_with(nodes, [weights()])
    m.opset_import.extend([helper.make_opsetid("com.microsoft", 1)])
    TrainingSession(m).run({"X": X})  # onnxruntime runs it ...
    with pytest.raises(bundle.BundleError, match=r"inference: node 1 \('gelu'\) is the op com\.microsoft\.Gelu"):
        bundle.save(m, tmp_path / "b")  # ... JavaScript's would not
    assert list(tmp_path.iterdir()) == []


def test_ir_version_is_capped_and_the_opset_recorded(tmp_path):
    m = regression_with([helper.make_node("MatMul", ["X", "W"], ["Y"])], [weights()], opset=19, ir_version=13)
    python = TrainingSession(m)
    bundle.save(python, tmp_path / "b")
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["ir_version"] == 10 and manifest["opset"] == 19
    for name, program in programs_of(tmp_path / "b").items():
        if name != "training_model.onnx":
            assert program.ir_version <= 10, name
            assert {o.domain for o in program.opset_import} <= {"", "ai.onnx"}, name
            onnx.checker.check_model(str(tmp_path / "b" / name))
            assert {n.domain for n in program.graph.node} <= {"", "ai.onnx"}, name
    js = ManifestRunner(tmp_path / "b")
    t = RNG.standard_normal((6, 2)).astype(np.float32)
    np.testing.assert_array_equal(js.train_step({"X": X, "T": t})["loss"], python.train_step({"X": X, "T": t})["loss"])


def test_model_local_functions_are_inlined(tmp_path):
    affine = helper.make_function(
        "custom", "Affine", ["x", "w", "b"], ["y"],
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])],
        [helper.make_opsetid("", 17)])
    nodes = [helper.make_node("Affine", ["X", "W", "B"], ["Y"], domain="custom")]
    m = regression_with(nodes, [weights(), tensor("B", np.ones(2, np.float32))], functions=[affine])
    python = TrainingSession(m)
    bundle.save(python, tmp_path / "b")
    for name, program in programs_of(tmp_path / "b").items():
        if name != "training_model.onnx":
            assert not program.functions and {n.domain for n in program.graph.node} <= {""}, name
    assert programs_of(tmp_path / "b")["training_model.onnx"].functions  # Python's copy is the model
    js = ManifestRunner(tmp_path / "b")
    t = RNG.standard_normal((6, 2)).astype(np.float32)
    for _ in range(2):
        np.testing.assert_array_equal(js.train_step({"X": X, "T": t})["loss"],
                                      python.train_step({"X": X, "T": t})["loss"])
    np.testing.assert_array_equal(js.state["W"], python.state["W"])


def test_constants_are_stored_once_in_constants_bin(tmp_path):
    """A frozen 8 KiB projection P, read by the inference program, the
    algorithm program and the training model, is stored once."""
    p = np.random.default_rng(1).normal(size=(8, 256)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["X", "P"], ["XP"]), helper.make_node("MatMul", ["XP", "W"], ["Y"])]
    m = regression_with(nodes, [weights((256, 2)), numpy_helper.from_array(p, "P")])
    python = TrainingSession(m)
    bundle.save(python, tmp_path / "b")
    folder = tmp_path / "b"
    size = (folder / "constants.bin").stat().st_size
    assert p.nbytes <= size < 2 * p.nbytes
    places = set()
    for name, program in programs_of(folder).items():
        graphs = [program.graph] + [ti.algorithm for ti in program.training_info]
        for t in (t for g in graphs for t in g.initializer if t.name == "P"):
            info = {e.key: e.value for e in t.external_data}
            assert t.data_location == onnx.TensorProto.EXTERNAL and info["location"] == "constants.bin", name
            places.add((info["offset"], info["length"]))
    assert places == {("0", str(p.nbytes))}
    out = ort.InferenceSession(str(folder / "inference.onnx")).run(None, {"X": X})[0]
    np.testing.assert_allclose(out, python.run({"X": X})["Y"], rtol=1e-6)
    loaded = bundle.load(folder)
    np.testing.assert_array_equal(loaded.run({"X": X})["Y"], python.run({"X": X})["Y"])


def wide_mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, (8, 64)).astype(np.float32), "W1"),
             numpy_helper.from_array(np.zeros(64, np.float32), "b1"),
             numpy_helper.from_array(rng.normal(0, 0.3, (64, 3)).astype(np.float32), "W2")]
    nodes = [helper.make_node("Gemm", ["X", "W1", "b1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["logits"])]
    graph = helper.make_graph(nodes, "mlp", [vi("X", F32, ["N", 8])], [vi("logits", F32, ["N", 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_initial_values_of_initialization_graphs_go_to_constants_bin(tmp_path):
    """The builder's initialization graph holds the initial weights as
    Constant nodes; the program reads them from constants.bin."""
    m = build.training_model(wide_mlp(), target="label", optimizer=build.Adam(lr=0.01))
    python = TrainingSession(m)
    python.train_step({"X": X, "label": LABEL})
    bundle.save(python, tmp_path / "b")
    init = programs_of(tmp_path / "b")["program_initialization_0.onnx"]
    stored = [t.name for t in init.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert stored, "the 2 KiB initial W1 should be external data"
    js = ManifestRunner(tmp_path / "b")
    js.initialize()
    python.initialize()
    for name, value in python.state.items():
        np.testing.assert_array_equal(js.state[name], value, err_msg=name)


def test_inference_onnx_is_a_plain_model_on_state_bin(tmp_path):
    m = build.training_model(wide_mlp(), target="label", optimizer=build.SGD(lr=0.1), accumulate=2)
    python = TrainingSession(m)
    for _ in range(2):
        python.train_step({"X": X, "label": LABEL})
    bundle.save(python, tmp_path / "b")
    folder = tmp_path / "b"
    model = onnx.load(folder / "inference.onnx", load_external_data=False)
    assert [i.name for i in model.graph.input] == ["X"]
    stored = {t.name: {e.key: e.value for e in t.external_data}["location"] for t in model.graph.initializer
              if t.data_location == onnx.TensorProto.EXTERNAL}
    assert stored == {"W1": "state.bin", "b1": "state.bin", "W2": "state.bin"}  # no gradient sums
    sess = ort.InferenceSession(str(folder / "inference.onnx"))
    assert [i.name for i in sess.get_inputs()] == ["X"]
    np.testing.assert_allclose(sess.run(None, {"X": X})[0], python.run({"X": X})["logits"], rtol=1e-6, atol=1e-6)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["inference"]["state_inputs"] == ["W1", "b1", "W2"]
    assert manifest["inference"]["feeds"] == [{"name": "X", "dtype": "float32", "shape": ["N", 8]}]


def test_an_overridable_input_is_an_optional_feed(tmp_path):
    nodes = [helper.make_node("MatMul", ["X", "W"], ["Y0"]), helper.make_node("Mul", ["Y0", "scale"], ["Y"])]
    m = regression_with(nodes, [weights(), tensor("scale", np.float32(2.0))],
                        extra_inputs=[vi("scale", F32, [])])
    python = TrainingSession(m)
    bundle.save(python, tmp_path / "b")
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["inference"]["optional_feeds"] == [{"name": "scale", "dtype": "float32", "shape": []}]
    assert manifest["algorithms"][0]["optional_feeds"] == [{"name": "scale", "dtype": "float32", "shape": []}]
    js = ManifestRunner(tmp_path / "b")
    np.testing.assert_array_equal(js.run({"X": X})["Y"], python.run({"X": X})["Y"])
    half = js.run({"X": X, "scale": np.array(0.5, np.float32)})["Y"]
    np.testing.assert_allclose(half, 0.25 * python.run({"X": X})["Y"], rtol=1e-6)
