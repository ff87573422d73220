"""The JavaScript examples run as the README says: examples/node_finetune.mjs
fine-tunes a bundle that examples/web/prepare.py wrote, and
examples/federated/ averages its clients so that, with equal shards, one
local SGD step per round and no momentum, a round is one SGD step on the
union of the shards (issue 32, point 4)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from jsrun import ROOT, run_node
from onnx import numpy_helper

import onnxtrain
from onnxtrain import build, bundle
from onnxtrain.datasets import load_digits

sys.path.insert(0, str(ROOT / "examples"))
from inference_models import mlp  # noqa: E402


def test_node_finetune_trains_the_prepared_bundle_and_python_loads_it(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "examples" / "web" / "prepare.py"), "--bundle-only",
                    "--out", str(tmp_path)], check=True, capture_output=True)
    out = run_node([str(ROOT / "examples" / "node_finetune.mjs"), str(tmp_path / "bundle"),
                    "-o", str(tmp_path / "trained"), "--quick"])
    assert "digits: 1438 for training, 359 for testing" in out, out
    accuracy = float(out.split("epoch 1: mean loss ")[1].split("test accuracy ")[1].split("%")[0])
    assert accuracy > 85, out
    assert f"saved the trained bundle to {tmp_path / 'trained'}" in out
    back = bundle.load(tmp_path / "trained")
    assert back.fit_position["epoch"] == 1 and back.fit_position["step"] == 45
    assert int(back.state["step"]) == 45


def float_model(dtype) -> onnx.ModelProto:
    """The digits MLP with SGD (no momentum), its weights and data in ``dtype``."""
    m = mlp(n_in=64, hidden=16, seed=5)
    if dtype == np.float64:
        for t in m.graph.initializer:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
        for v in list(m.graph.input) + list(m.graph.output):
            v.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    return build.training_model(m, loss="cross_entropy", target="label", optimizer=build.SGD(lr=0.5))


@pytest.mark.parametrize("dtype, clients, rows", [(np.float32, 2, 50), (np.float64, 3, 40)])
def test_a_federated_round_is_one_sgd_step_on_the_union_of_the_shards(tmp_path, dtype, clients, rows):
    model = float_model(dtype)
    bundle.save(model, tmp_path / "start")
    rounds = 3
    out = run_node([str(ROOT / "examples" / "federated" / "run.mjs"), str(tmp_path / "start"),
                    "-o", str(tmp_path / "global"), "--clients", str(clients), "--rounds", str(rounds),
                    "--rows", str(rows), "--batch-size", str(rows), "--local-epochs", "1", "--no-shuffle"])
    assert out.count("global test accuracy") == rounds, out

    # Python: one SGD step per round on the union of the shards (the first clients x rows
    # digits, in file order: fedavg.mjs's shards).
    X, y = load_digits()
    union = {"X": X[:clients * rows].astype(dtype), "label": y[:clients * rows]}
    python = onnxtrain.TrainingSession(model)
    for _ in range(rounds):
        python.train_step(union)
    federated = bundle.load(tmp_path / "global")
    manifest = json.loads((tmp_path / "global" / "manifest.json").read_text())
    averaged = [v["name"] for v in manifest["state"] if v["name"] in manifest["inference"]["state_inputs"]]
    assert sorted(averaged) == ["W1", "W2", "b1", "b2"]
    tight = {np.float32: dict(rtol=1e-5, atol=1e-6), np.float64: dict(rtol=1e-12, atol=1e-14)}[dtype]
    for name in averaged:
        np.testing.assert_allclose(federated.state[name], python.state[name], err_msg=name, **tight)
    start = onnxtrain.TrainingSession(model).state
    assert np.abs(federated.state["W1"] - start["W1"]).max() > 1e-3, "the weights moved"
    # Optimizer state and counters stay the server's: the step counter of the start.
    assert int(federated.state["step"]) == 0 and int(python.state["step"]) == rounds
