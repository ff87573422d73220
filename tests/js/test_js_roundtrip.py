"""Back to Python: a bundle trained by the JavaScript package (js/) loads with
``onnxtrain.bundle.load``, has exactly the state Python's own training gives
(onnxruntime-node runs the same programs on the same kernels; WASM within
float rounding), continues training, exports, and its ``inference.onnx``
runs in plain onnxruntime with the trained weights (issue 32, point 3)."""

from __future__ import annotations

import json
import sys

import numpy as np
import onnxruntime as ort
import pytest
from jsrun import ROOT, Spec

import onnxtrain
from onnxtrain import build, bundle
from onnxtrain.datasets import load_digits

sys.path.insert(0, str(ROOT / "examples"))
import models as hand  # noqa: E402  (tests/models.py)
from inference_models import mlp  # noqa: E402


def digits(n: int, offset: int = 0):
    X, y = load_digits()
    return X[offset:offset + n].astype(np.float32), y[offset:offset + n].astype(np.int64)


def builder_mlp(**kwargs):
    return build.training_model(mlp(n_in=64, hidden=24, seed=3), loss="cross_entropy",
                                target="label", **kwargs)


def assert_same_state(a: onnxtrain.TrainingSession, b: onnxtrain.TrainingSession, exact=True):
    sa, sb = a.state, b.state
    assert set(sa) == set(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and sa[name].shape == sb[name].shape, name
        if exact:
            np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)
        else:
            np.testing.assert_allclose(sa[name], sb[name], rtol=1e-4, atol=1e-5, err_msg=name)


def batches(X, y, size):
    return [{"X": X[i:i + size], "label": y[i:i + size]} for i in range(0, len(X), size)]


@pytest.mark.parametrize("runtime", ["node", "web"])
def test_a_bundle_trained_in_javascript_continues_in_python(tmp_path, runtime):
    exact = runtime == "node"
    python = onnxtrain.TrainingSession(builder_mlp(optimizer=build.Adam(lr=0.01)))
    bundle.save(python, tmp_path / "start")
    X, y = digits(48)
    spec = Spec(tmp_path, tmp_path / "start", tmp_path / "trained", runtime)
    losses = []
    for batch in batches(X, y, 12):
        spec.step(batch)
        losses.append(float(python.train_step(batch)["loss"]))
    result = spec.run()
    if exact:
        assert result["losses"] == losses
    else:
        np.testing.assert_allclose(result["losses"], losses, rtol=1e-4)

    back = bundle.load(tmp_path / "trained")
    assert_same_state(back, python, exact)
    # It trains on in Python, step for step as the session that never left.
    more = batches(*digits(24, offset=100), 12)
    for batch in more:
        got, want = back.train_step(batch), python.train_step(batch)
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=0 if exact else 1e-4)
    assert_same_state(back, python, exact)
    assert int(back.state["step"]) == 6

    # It exports, and the trained bundle's own inference.onnx runs in plain onnxruntime.
    Xt = digits(20, offset=300)[0]
    exported = tmp_path / "exported.onnx"
    back.export(exported)
    plain = ort.InferenceSession(str(exported), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(plain.run(["logits"], {"X": Xt})[0], back.run({"X": Xt})["logits"])
    js_inference = ort.InferenceSession(str(tmp_path / "trained" / "inference.onnx"),
                                        providers=["CPUExecutionProvider"])
    before_more = bundle.load(tmp_path / "trained")
    np.testing.assert_array_equal(js_inference.run(["logits"], {"X": Xt})[0],
                                  before_more.run({"X": Xt})["logits"])
    assert not np.array_equal(js_inference.run(["logits"], {"X": Xt})[0],
                              onnxtrain.TrainingSession(builder_mlp(optimizer=build.Adam(lr=0.01)))
                              .run({"X": Xt})["logits"]), "inference.onnx reads the trained weights"


def test_hand_written_algorithms_and_initialization_come_back(tmp_path):
    """Two TrainingInfoProtos (Adam on each layer) with initialization graphs, written by hand."""
    model = hand.mlp_classifier("adam", sizes=(64, 12, 10), lr=0.02, groups=[["W1", "b1"], ["W2", "b2"]])
    python = onnxtrain.TrainingSession(model)
    bundle.save(model, tmp_path / "start")
    python.initialize()
    spec = Spec(tmp_path, tmp_path / "start", tmp_path / "trained")
    spec.data["initialize"] = True
    X, y = digits(40, offset=50)
    for batch, algorithm in zip(batches(X, y, 8), [None, 0, 1, None, 1]):
        spec.step(batch, algorithm)
        python.train_step(batch, algorithm=algorithm)
    spec.run()
    back = bundle.load(tmp_path / "trained")
    assert_same_state(back, python)
    assert int(back.state["step0"]) == 3 and int(back.state["step1"]) == 4
    batch = batches(*digits(8, offset=200), 8)[0]
    back.train_step(batch, algorithm=1)
    python.train_step(batch, algorithm=1)
    assert_same_state(back, python)


def test_fit_position_survives_javascript_and_python_resumes_there(tmp_path):
    """JS fits 2 epochs of gradient accumulation (cycle [0, 1]); Python's fit resumes at
    epoch 2 and ends exactly where one uninterrupted Python fit of 3 epochs ends."""
    model = builder_mlp(optimizer=build.Adam(lr=0.01), accumulate=2)
    X, y = digits(60, offset=400)
    bundle.save(model, tmp_path / "start")
    spec = Spec(tmp_path, tmp_path / "start", tmp_path / "trained")
    spec.fit({"X": X, "label": y}, epochs=2, batch_size=16)
    result = spec.run()
    assert result["position"] == {"epoch": 2, "batch": 0, "step": 8}
    manifest = json.loads((tmp_path / "trained" / "manifest.json").read_text())
    assert manifest["fit_position"] == {"epoch": 2, "batch": 0, "step": 8}

    uninterrupted = onnxtrain.TrainingSession(model)
    history = uninterrupted.fit(X, y, epochs=3, batch_size=16, shuffle=False, progress=False)
    np.testing.assert_allclose(result["fitLoss"], history.history["loss"][:2], rtol=1e-12)
    back = bundle.load(tmp_path / "trained")
    assert back.fit_position["epoch"] == 2 and back.fit_position["step"] == 8
    resumed = back.fit(X, y, epochs=3, batch_size=16, shuffle=False, progress=False)
    assert resumed.epochs == [2]
    assert_same_state(back, uninterrupted)
    assert back.fit_position["step"] == uninterrupted.fit_position["step"] == 12
