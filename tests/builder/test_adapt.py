"""skl2onnx default conversions train as converted (onnxtrain.builder.adapt).

The models are skl2onnx 1.20 conversions committed in tests/data/exporters/
(scripts/make_exporter_corpus.py writes them; scikit-learn is not needed
here): LogisticRegression on the digits (10 classes) and binary, and
LinearRegression, each as converted by default (LinearClassifier /
LinearRegressor with coefficients in attributes, ZipMap), with
``zipmap=False``, with ``black_op`` (standard ops) and at ``target_opset=9``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain import build
from onnxtrain.builder import adapt
from onnxtrain.datasets import load_digits

DATA = Path(__file__).resolve().parents[1] / "data" / "exporters"
CLASSIFIERS = [f"logreg_{kind}__skl2onnx{variant}" for kind in ("digits", "binary")
               for variant in ("", "_opset9", "_black_op", "_nozipmap")]
REGRESSORS = [f"linreg__skl2onnx{variant}" for variant in ("", "_opset9", "_black_op")]


def load(stem: str) -> onnx.ModelProto:
    return onnx.load(str(DATA / f"{stem}.onnx"))


def digits(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    x, y = load_digits()
    x = x.astype(np.float32).reshape(len(x), -1)
    return x[:n] / x.max(), y[:n].astype(np.int64)


def run(model: onnx.ModelProto, x: np.ndarray) -> dict:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"X": x})))


def random_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """A random value of every data input (symbolic dimensions set to 2)."""
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for i in model.graph.input:
        if i.name in inits:
            continue
        tt = i.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 2 for d in tt.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if np.issubdtype(dtype, np.floating):
            feeds[i.name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[i.name] = rng.integers(0, 3, shape).astype(dtype)
    return feeds


def same_outputs(original: onnx.ModelProto, adapted: onnx.ModelProto) -> None:
    """``adapt``'s checker: the adapted model gives the original's outputs on a
    random input in onnxruntime (ValueError naming the first that differs)."""
    feeds = random_feeds(original)

    def outputs(model: onnx.ModelProto) -> list:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run([o.name for o in original.graph.output], feeds)

    for out, want, got in zip(original.graph.output, outputs(original), outputs(adapted)):
        want, got = as_array(want), as_array(got)
        same = want.shape == got.shape and (
            np.array_equal(want, got) if want.dtype.kind in "iuOSUb"
            else np.allclose(want, got, rtol=1e-4, atol=1e-5))
        if not same:
            raise ValueError(f"the adapted model differs from the original on output {out.name!r} "
                             f"(random input check): expected {want.ravel()[:6]}, got {got.ravel()[:6]}")


def as_array(value) -> np.ndarray:
    """A ZipMap output (list of {class: probability}) as [N, C]."""
    if isinstance(value, list):
        return np.array([[row[k] for k in sorted(row)] for row in value], np.float32)
    return np.asarray(value)


@pytest.mark.parametrize("stem", CLASSIFIERS + REGRESSORS)
def test_adapted_model_computes_the_original(stem):
    """Same labels and probabilities (or predictions) as the original in onnxruntime,
    standard ops only for the linear models, opset >= 13, valid ONNX."""
    original = load(stem)
    adapted = adapt.adapt(original, check=same_outputs)
    onnx.checker.check_model(adapted, full_check=True)
    assert not [n.op_type for n in adapted.graph.node
                if n.domain == "ai.onnx.ml" and n.op_type in ("LinearClassifier", "LinearRegressor", "ZipMap")]
    assert max(o.version for o in adapted.opset_import if o.domain in ("", "ai.onnx")) >= 13
    assert [o.name for o in adapted.graph.output][: len(original.graph.output)] == [
        o.name for o in original.graph.output]
    x, _ = digits()
    want, got = run(original, x), run(adapted, x)
    for name, value in want.items():
        if np.asarray(as_array(value)).dtype.kind == "f":
            np.testing.assert_allclose(got[name], as_array(value), rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(got[name], value)
    # The linear models' coefficients are now trainable initializers.
    floats = [t for t in adapted.graph.initializer if t.data_type == TensorProto.FLOAT]
    assert sum(int(np.prod(t.dims)) for t in floats) >= 64


@pytest.mark.parametrize("stem", CLASSIFIERS)
def test_classifier_logits_give_the_probabilities(stem):
    """softmax(<p>_logits) = p: cross-entropy on the logits is -log p[target]."""
    adapted = adapt.adapt(load(stem))
    pairs = adapt.logits_of(adapted)
    (prob, logits), = pairs.items()
    out = run(adapted, digits()[0])
    z = out[logits].astype(np.float64)
    softmax = np.exp(z - z.max(1, keepdims=True))
    softmax /= softmax.sum(1, keepdims=True)
    np.testing.assert_allclose(softmax, out[prob], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stem", CLASSIFIERS + REGRESSORS)
def test_default_training(stem):
    """build.training_model with defaults (cross_entropy on the classifiers, mse on
    the regressor) trains the converted model: the loss falls and the exported
    model still loads in onnxruntime with the original's outputs."""
    regression = stem.startswith("linreg")
    x, y = digits(128)
    if regression:
        target = x[:, 20:30].sum(axis=1, keepdims=True) + 0.5
    else:
        target = (y > 4).astype(np.int64) if "binary" in stem else y
    original = load(stem)
    tm = build.training_model(original, loss="mse" if regression else "cross_entropy",
                              optimizer=build.Adam(lr=0.05))
    meta = {p.key: json.loads(p.value) for p in tm.metadata_props if p.key.startswith("onnxtrain.")}
    if not regression:
        assert meta["onnxtrain.prediction"].endswith("_logits")
    sess = onnxtrain.TrainingSession(tm)
    sess.initialize()
    losses = [float(sess.train_step({"X": x, meta["onnxtrain.target"]: target})[meta["onnxtrain.loss"]])
              for _ in range(20)]
    assert np.isfinite(losses).all() and losses[-1] < 0.9 * losses[0], losses
    exported = sess.to_model(False)
    names = [o.name for o in original.graph.output]
    got = run(exported, x)
    assert set(names) <= set(got)


def test_binary_logistic_one_row_follows_onnxruntime():
    """LinearClassifier with one coefficient row and two labels (the spec's binary
    case): onnxruntime writes [1 - sigmoid(s), sigmoid(s)]; the rewrite too, and
    its logits are [0, s]."""
    w = [0.5, -1.0, 2.0]
    node = helper.make_node("LinearClassifier", ["X"], ["label", "prob"], domain="ai.onnx.ml",
                            coefficients=w, intercepts=[0.25], classlabels_ints=[3, 7],
                            post_transform="LOGISTIC")
    graph = helper.make_graph([node], "binary",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("label", TensorProto.INT64, ["N"]),
                               helper.make_tensor_value_info("prob", TensorProto.FLOAT, ["N", 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.onnx.ml", 1)])
    model.ir_version = 8
    adapted = adapt.adapt(model)
    x = np.random.default_rng(0).standard_normal((16, 3)).astype(np.float32)
    want, got = run(model, x), run(adapted, x)
    np.testing.assert_array_equal(got["label"], want["label"])
    np.testing.assert_allclose(got["prob"], want["prob"], rtol=1e-6, atol=1e-6)
    s = x.astype(np.float64) @ np.array(w) + 0.25
    np.testing.assert_allclose(got[adapt.logits_of(adapted)["prob"]], np.stack([0 * s, s], 1),
                               rtol=1e-5, atol=1e-6)


def test_string_labels_and_refused_transform():
    """String class labels come out of a Gather; PROBIT is refused naming the node."""
    def model(transform: str) -> onnx.ModelProto:
        node = helper.make_node("LinearClassifier", ["X"], ["label", "prob"], domain="ai.onnx.ml",
                                name="clf", coefficients=[1.0, -1.0, 0.5, 2.0], intercepts=[0.0, 0.1],
                                classlabels_strings=["cat", "dog"], post_transform=transform)
        g = helper.make_graph([node], "s", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
                              [helper.make_tensor_value_info("label", TensorProto.STRING, ["N"]),
                               helper.make_tensor_value_info("prob", TensorProto.FLOAT, ["N", 2])])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid("ai.onnx.ml", 1)])
        m.ir_version = 8
        return m

    x = np.random.default_rng(1).standard_normal((8, 2)).astype(np.float32)
    original = model("SOFTMAX")
    want, got = run(original, x), run(adapt.adapt(original), x)
    np.testing.assert_array_equal(got["label"], want["label"])
    np.testing.assert_allclose(got["prob"], want["prob"], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="'clf'.*PROBIT"):
        adapt.adapt(model("PROBIT"))


def test_models_without_rewrites_come_back_unchanged():
    g = helper.make_graph([helper.make_node("Relu", ["X"], ["Y"])], "g",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert adapt.adapt(m) is m


def test_old_opset_standard_model_is_upgraded_and_checked():
    """An opset-9 model of standard ops comes back at opset 13 with the same outputs
    (Softmax's axis semantics changed at 13: the converter keeps the result)."""
    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["X", "W"], ["s"]),
             helper.make_node("Softmax", ["s"], ["P"], axis=1)]
    g = helper.make_graph(nodes, "old", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("P", TensorProto.FLOAT, ["N", 3])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 9)])
    m.ir_version = 4
    adapted = adapt.adapt(m)
    assert [o.version for o in adapted.opset_import if o.domain == ""] == [13]
    x = rng.standard_normal((5, 4)).astype(np.float32)
    np.testing.assert_allclose(run(adapted, x)["P"], run(m, x)["P"], rtol=1e-6)
    tm = build.training_model(m, loss="mse")  # the builder no longer refuses opset 9
    assert tm.training_info


CORPUS = sorted(p.stem for p in DATA.glob("*.onnx"))


@pytest.mark.parametrize("stem", CORPUS)
def test_every_rewrite_of_the_corpus_computes_the_original(stem):
    """The check the builder no longer runs: over the exporter corpus, every
    model ``adapt`` rewrites gives the original's outputs in onnxruntime."""
    original = load(stem)
    adapted = adapt.adapt(original, check=same_outputs)
    if adapted is original:
        pytest.skip("nothing to rewrite")


def test_the_builder_runs_no_model(monkeypatch):
    """``adapt`` (and so ``build.training_model``) compiles nothing: with every
    onnxruntime session refused, a rewritten model still comes back."""
    def refused(*args, **kwargs):
        raise AssertionError("the builder started an onnxruntime session")

    monkeypatch.setattr(ort, "InferenceSession", refused)
    original = load("logreg_digits__skl2onnx")
    adapted = adapt.adapt(original)
    assert adapted is not original
    assert build.training_model(original).training_info


def test_failed_check_is_a_value_error(monkeypatch):
    """A rewrite that changed the outputs is refused by the caller's check
    (``adapt(check=...)``) with a ValueError naming the output."""
    original = load("linreg__skl2onnx")
    real = adapt._Rewriter.linear_regressor

    def wrong(self, node):
        real(self, node)  # then shift the intercepts by 1
        arr = onnx.numpy_helper.to_array(self.inits[-1]) + 1.0
        self.inits[-1].CopyFrom(onnx.numpy_helper.from_array(arr, self.inits[-1].name))

    monkeypatch.setattr(adapt._Rewriter, "linear_regressor", wrong)
    with pytest.raises(ValueError, match="differs from the original on output 'variable'"):
        adapt.adapt(original, check=same_outputs)


@pytest.mark.parametrize("opset", [9, 17])
def test_cross_entropy_reads_the_logits_of_a_softmax_output(opset):
    """A plain model whose output is Softmax probabilities (zoo CNNs, exported
    classifiers): cross-entropy reads the scores before the Softmax (at opset
    9 the converter's Reshape(Softmax(Flatten(s))) form), so the loss is
    -mean log p[label] of the model's own probabilities, never
    log_softmax(p)."""
    rng = np.random.default_rng(1)
    w = onnx.numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["X", "W"], ["s"]),
             helper.make_node("Softmax", ["s"], ["P"], axis=1)]
    g = helper.make_graph(nodes, "clf", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("P", TensorProto.FLOAT, ["N", 3])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 7
    tm = build.training_model(m, optimizer=build.SGD(lr=0.0))
    meta = {p.key: json.loads(p.value) for p in tm.metadata_props if p.key.startswith("onnxtrain.")}
    assert meta["onnxtrain.prediction"] == "P_logits"
    assert [o.name for o in tm.graph.output] == ["P", "P_logits"]
    x = rng.standard_normal((6, 4)).astype(np.float32)
    y = rng.integers(0, 3, 6).astype(np.int64)
    loss = float(onnxtrain.TrainingSession(tm).train_step({"X": x, "target": y})["loss"])
    p = run(m, x)["P"]
    np.testing.assert_allclose(loss, -np.mean(np.log(p[np.arange(6), y])), rtol=1e-5)
