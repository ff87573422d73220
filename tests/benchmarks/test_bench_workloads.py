"""benchmarks/: the wiring of the workloads exported from PyTorch (W5, W6).

Without torch: the hand-built training model (``--no-builder``) of a model
with BatchNormalization and SGD with momentum trains as the builder's does
(batch statistics, torch's running_var, the spec ``Momentum`` op), the
analytic FLOP counts, the equal-work threshold.  With the ORT training
environment (``benchmarks/setup_ort_training.sh``, which exports W5/W6):
the exports themselves."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import run  # noqa: E402
import training_model  # noqa: E402
import workloads  # noqa: E402

ORT_PYTHON = os.path.join(BENCH, ".venv-ort-training", "bin", "python")


def _conv_bn_model() -> onnx.ModelProto:
    """Conv -> BatchNormalization -> Relu -> GlobalAveragePool -> Flatten -> Gemm, as an
    exporter writes it (eval-mode BatchNormalization, producer pytorch)."""
    rng = np.random.default_rng(0)
    params = {
        "conv.weight": rng.normal(0, 0.3, (4, 2, 3, 3)).astype(np.float32),
        "bn.weight": (1 + 0.1 * rng.standard_normal(4)).astype(np.float32),
        "bn.bias": (0.1 * rng.standard_normal(4)).astype(np.float32),
        "bn.running_mean": (0.1 * rng.standard_normal(4)).astype(np.float32),
        "bn.running_var": (1 + 0.2 * rng.random(4)).astype(np.float32),
        "fc.weight": rng.normal(0, 0.3, (3, 4)).astype(np.float32),
        "fc.bias": np.zeros(3, np.float32) + 0.01,
    }
    nodes = [
        helper.make_node("Conv", ["X", "conv.weight"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "bn.weight", "bn.bias", "bn.running_mean",
                                                "bn.running_var"], ["b"], epsilon=1e-5, momentum=0.9),
        helper.make_node("Relu", ["b"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"], axis=1),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes, "convbn", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [6, 2, 5, 5])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [6, 3])],
        [numpy_helper.from_array(v, k) for k, v in params.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="pytorch")
    model.ir_version = 8
    return model


def _workload(**kw):
    base = workloads.WORKLOADS["W5"]
    return replace(base, **kw)


def _train(model, workload, use_builder, batch, steps=4):
    tm, how = training_model.training_model(model, workload, use_builder=use_builder)
    sess = onnxtrain.TrainingSession(tm)
    losses = [float(sess.train_step(batch)["loss"]) for _ in range(steps)]
    return how, losses, dict(sess.state)


@pytest.mark.parametrize("optimizer,kw", [("sgd", {"lr": 0.05, "momentum": 0.9}),
                                          ("adamw", {"lr": 1e-2, "weight_decay": 1e-2})])
def test_hand_built_batchnorm_model_trains_as_the_builder(optimizer, kw):
    model = _conv_bn_model()
    rng = np.random.default_rng(1)
    batch = {"X": rng.random((6, 2, 5, 5), dtype=np.float32),
             "label": rng.integers(0, 3, 6).astype(np.int64)}
    w = _workload(optimizer=optimizer, **kw)
    hand_how, hand, hand_state = _train(model, w, False, batch)
    built_how, built, built_state = _train(model, w, True, batch)
    assert (hand_how, built_how) == ("hand-built", "builder")
    # The statistics are no parameters; both train BatchNormalization in training mode.
    assert training_model.trainable(model) == ["conv.weight", "bn.weight", "bn.bias", "fc.weight", "fc.bias"]
    assert hand[0] == pytest.approx(built[0], rel=1e-6)
    # SGD with momentum: the spec Momentum op is torch's rule exactly; AdamW: the spec Adam
    # op's epsilon/decay convention differs from torch's (the builder's) by ~1e-5 here.
    tol = 1e-5 if optimizer == "sgd" else 1e-3
    np.testing.assert_allclose(hand, built, rtol=tol)
    assert hand[-1] < hand[0]
    # torch's running statistics (unbiased var); under AdamW the weights, and so the batch
    # statistics, differ by the convention above.
    for stat in ("bn.running_mean", "bn.running_var"):
        np.testing.assert_allclose(hand_state[stat], built_state[stat], rtol=tol, atol=tol * 1e-2)
    assert not np.allclose(hand_state["bn.running_var"], numpy_helper.to_array(model.graph.initializer[4]))


def test_hand_built_momentum_is_the_spec_op():
    tm, _ = training_model.training_model(_conv_bn_model(), _workload(), use_builder=False)
    algo = tm.training_info[0].algorithm
    (mom,) = [n for n in algo.node if n.op_type == "Momentum"]
    attrs = {a.name: helper.get_attribute_value(a) for a in mom.attribute}
    assert mom.domain == "ai.onnx.preview.training"
    assert attrs == {"alpha": pytest.approx(0.9), "beta": 1.0, "norm_coefficient": 0.0, "mode": b"standard"}
    keys = {b.key for b in tm.training_info[0].update_binding}
    assert {"bn.running_mean", "bn.running_var", "momentum.conv.weight", "step"} <= keys
    assert any(n.op_type == "BatchNormalization" and any(a.name == "training_mode" and a.i for a in n.attribute)
               for n in algo.node)


def test_flop_counts():
    # resnet18 at 224x224 with 1000 classes: 1.814 G multiply-adds per image.
    old = (workloads.RN_BATCH, workloads.RN_SIZE, workloads.RN_CLASSES)
    try:
        workloads.RN_BATCH, workloads.RN_SIZE, workloads.RN_CLASSES = 1, 224, 1000
        assert workloads.resnet18_flops() / 6 == pytest.approx(1.814e9, rel=2e-3)
    finally:
        workloads.RN_BATCH, workloads.RN_SIZE, workloads.RN_CLASSES = old
    assert workloads.WORKLOADS["W5"].flops_per_step == workloads.resnet18_flops()
    # BERT: 4 layers x (4 d^2 + 2 d f) per token + attention 2 S^2 d per sequence, pooler, head.
    d, f, t = 256, 1024, 8 * 128
    expected = 4 * (t * (4 * d * d + 2 * d * f) + 2 * 8 * 128 * 128 * d) + 8 * (d * d + 2 * d)
    assert workloads.WORKLOADS["W6"].flops_per_step == 6.0 * expected


def test_unequal_threshold_follows_the_float32_drift():
    assert run.unequal_threshold({}) == run.UNEQUAL_LOSSES
    assert run.unequal_threshold({"max_rel_diff_float64": {"torch": 1e-3}}) == pytest.approx(2e-3)
    assert run.unequal_threshold({"max_rel_diff_float64": {"torch": 1e-6}}) == run.UNEQUAL_LOSSES
    r = {"torch": run.Result("torch", ready={"losses": [1.0, 0.5], "float64_losses": [1.0, 0.4]}),
         "onnxtrain": run.Result("onnxtrain", ready={"losses": [1.0, 0.4]})}
    eq = run.equal_work(r)
    assert eq["max_rel_diff_float64"] == {"torch": pytest.approx(0.25), "onnxtrain": 0.0}


def test_export_cache_key_changes_with_the_sources(monkeypatch):
    d = workloads.export_dir()
    assert d.parent == workloads.CACHE and d.name.startswith("exports-")
    monkeypatch.setattr(workloads, "BERT_VOCAB", workloads.BERT_VOCAB + 1)
    assert workloads.export_dir() != d


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(ORT_PYTHON),
                    reason="needs benchmarks/.venv-ort-training (setup_ort_training.sh) to export W5/W6")
@pytest.mark.parametrize("key", ["W5", "W6"])
def test_exported_workloads(key):
    w = workloads.WORKLOADS[key]
    try:
        model, params, batch = w.build()
    except RuntimeError as exc:  # an environment without torchvision/transformers
        pytest.skip(str(exc)[:200])
    assert model.ir_version <= 8 and max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) <= 17
    assert [i.name for i in model.graph.input] == w.extra["inputs"]
    assert set(batch) == set(w.extra["inputs"]) | {w.target}
    names = training_model.trainable(model)
    # Every weight its own initializer (no Identity-shared copies), named as torch's state_dict.
    assert not any(n.op_type == "Identity" and n.input[0] in params for n in model.graph.node)
    if key == "W5":
        assert len(names) == 62 and len(params) - len(names) == 40  # 20 BatchNorms x 2 statistics
        assert all(n.startswith(("conv1", "bn1", "layer", "fc")) for n in names)
        assert batch["X"].shape == (16, 3, 112, 112)
    else:
        assert all(n.startswith("model.") for n in names)
        assert batch["input_ids"].shape == (8, 128) and batch["input_ids"].min() >= 1
        ln = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
        assert ln and all(len(n.output) == 3 for n in ln)  # ORT training's gradient needs them


def test_rnn_optional_inputs_listed_for_ort_training():
    """W7's model, as ORT training's gradient builder needs it: absent optional
    inputs named empty, up to initial_c (LSTM) or initial_h (GRU); the model
    computes the same."""
    import onnxruntime as ort
    import worker

    for key, width in (("W7-LSTM", 7), ("W7-GRU", 6)):
        model, _, batch = workloads.WORKLOADS[key].build()
        listed = onnx.ModelProto()
        listed.CopyFrom(model)
        worker._name_rnn_optional_inputs(listed)
        rnn = [n for n in listed.graph.node if n.op_type in ("LSTM", "GRU")]
        assert rnn and all(len(n.input) == width and not any(n.input[4:]) for n in rnn)
        outs = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": batch["X"]})
                for m in (model, listed)]
        np.testing.assert_array_equal(outs[0][0], outs[1][0])


def test_error_summary_gives_the_reason():
    error = "W7-LSTM-ort-artifacts failed (1):\nTraceback:\n  File x\nRuntimeError: bad | type\n"
    assert run.error_summary(error) == "W7-LSTM-ort-artifacts failed (1): RuntimeError: bad \\| type"
    assert run.error_summary(None) == "no data"
    assert len(run.error_summary("x" * 500)) == 140


def test_the_torch_peers_read_their_weights_from_a_file(tmp_path):
    """PyTorch's construction reads its weights from a ``torch.save`` file
    inside its clock, as onnxtrain reads ``model.onnx`` (before, its weights
    came from ``params.npz`` before the clock: W5's peer saved 38 ms)."""
    pytest.importorskip("torch")
    import worker

    params = {"a.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "a.bias": np.ones(2, np.float32)}
    worker.save_torch_weights(tmp_path, params)
    worker.save_torch_weights(tmp_path, {"other": np.zeros(1, np.float32)})  # (written once)
    read = worker.read_torch_weights(tmp_path)
    assert sorted(read) == sorted(params)
    for k, v in params.items():
        np.testing.assert_array_equal(read[k], v)
    assert [p.name for p in tmp_path.iterdir()] == [worker.TORCH_WEIGHTS]
