"""ONNX Runtime training 1.19.2's last behaviours (issue 33, item 4), each
checked against numpy on the same weights or against ORT's own numbers:
BatchNormalization's running statistics (updated in training, read in eval,
Dropout off in eval), string inputs fed as numpy text, OrtValues in and out,
the parameter order of the contiguous buffer, and custom loss blocks."""

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from ort_data import PARAMS

from onnxtrain.ort_training import artifacts, onnxblock
from onnxtrain.ort_training.api import CheckpointState, Module, Optimizer

WEIGHTS = ["fc1.weight", "fc1.bias", "bn.weight", "bn.bias", "fc2.weight", "fc2.bias"]
STATS = ["bn.running_mean", "bn.running_var"]
MOMENTUM = 0.9  # ONNX's: running = momentum * running + (1 - momentum) * batch


def bn_model() -> onnx.ModelProto:
    """x -> Gemm -> BatchNormalization (training mode, as PyTorch exports in
    TrainingMode.TRAINING) -> Relu -> Dropout(0.5, training) -> Gemm."""
    rng = np.random.default_rng(0)
    inits = {
        "fc1.weight": rng.standard_normal((6, 4)).astype(np.float32),
        "fc1.bias": rng.standard_normal(4).astype(np.float32),
        "bn.weight": rng.uniform(0.5, 1.5, 4).astype(np.float32),
        "bn.bias": rng.standard_normal(4).astype(np.float32) * 0.1,
        "bn.running_mean": rng.standard_normal(4).astype(np.float32),
        "bn.running_var": rng.uniform(0.5, 2.0, 4).astype(np.float32),
        "fc2.weight": rng.standard_normal((4, 3)).astype(np.float32),
        "fc2.bias": np.zeros(3, np.float32),
        "ratio": np.array(0.5, np.float32),
        "training": np.array(True),
    }
    nodes = [
        helper.make_node("Gemm", ["input", "fc1.weight", "fc1.bias"], ["h"]),
        helper.make_node("BatchNormalization", ["h", "bn.weight", "bn.bias", "bn.running_mean",
                                                "bn.running_var"], ["bn_out", "mean_out", "var_out"],
                         momentum=MOMENTUM, training_mode=1),
        helper.make_node("Relu", ["bn_out"], ["r"]),
        helper.make_node("Dropout", ["r", "ratio", "training"], ["d"]),
        helper.make_node("Gemm", ["d", "fc2.weight", "fc2.bias"], ["output"]),
    ]
    graph = helper.make_graph(nodes, "bn", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 6])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 3])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()],
                              value_info=[helper.make_tensor_value_info("bn_out", TensorProto.FLOAT, ["N", 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])


def cross_entropy(logits: np.ndarray, labels: np.ndarray) -> float:
    z = logits - logits.max(1, keepdims=True)
    return float(np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(len(labels)), labels]))


def eval_loss(p: dict, x: np.ndarray, labels: np.ndarray) -> float:
    """The eval model in float64: running statistics, no Dropout."""
    p = {k: v.astype(np.float64) for k, v in p.items()}
    h = x @ p["fc1.weight"] + p["fc1.bias"]
    bn = (h - p["bn.running_mean"]) / np.sqrt(p["bn.running_var"] + 1e-5) * p["bn.weight"] + p["bn.bias"]
    return cross_entropy(np.maximum(bn, 0) @ p["fc2.weight"] + p["fc2.bias"], labels)


def _values(state: CheckpointState, module: Module, names) -> dict[str, np.ndarray]:
    return {n: np.array(module._session.state[n]) for n in names}


@pytest.mark.parametrize("stats_frozen", [True, False], ids=["stats-frozen-params", "stats-constants"])
def test_eval_reads_the_running_statistics_that_training_updates(tmp_path, stats_frozen):
    """Eval: BatchNormalization on its running statistics, Dropout off (two
    calls agree, numpy without Dropout agrees).  Training: batch statistics
    (the BN output equals numpy's normalisation by the batch's mean and
    biased variance) and the running ones updated by ONNX's rule, which
    the next eval reads.  The statistics are frozen parameters (then saved
    with the checkpoint) or graph constants."""
    artifacts.generate_artifacts(
        bn_model(), requires_grad=WEIGHTS, frozen_params=STATS if stats_frozen else None,
        loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
        artifact_directory=tmp_path, additional_output_names=["bn_out"])
    eval_model = onnx.load(tmp_path / "eval_model.onnx")  # as ORT writes it: training modes off
    onnx.checker.check_model(eval_model, full_check=True)
    (bn,) = [n for n in eval_model.graph.node if n.op_type == "BatchNormalization"]
    (dropout,) = [n for n in eval_model.graph.node if n.op_type == "Dropout"]
    assert helper.get_node_attr_value(bn, "training_mode") == 0 and list(bn.output) == ["bn_out"]
    assert not dropout.input[2:] or not dropout.input[2]
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    opt = Optimizer(tmp_path / "optimizer_model.onnx", module)
    opt.set_learning_rate(0.1)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((8, 6)) * 2 + 1).astype(np.float32)
    labels = rng.integers(0, 3, 8)
    p = _values(state, module, WEIGHTS + STATS)

    module.eval()
    first, _ = module(x, labels)
    again, _ = module(x, labels)
    assert first == again  # no Dropout
    np.testing.assert_allclose(first, eval_loss(p, x, labels), rtol=1e-5)

    for step in range(3):
        module.train()
        _, bn_out = module(x, labels)
        h = x.astype(np.float64) @ p["fc1.weight"] + p["fc1.bias"]
        mean, var = h.mean(0), h.var(0)
        np.testing.assert_allclose(bn_out, (h - mean) / np.sqrt(var + 1e-5) * p["bn.weight"] + p["bn.bias"],
                                   rtol=1e-4, atol=1e-5)
        opt.step()
        module.lazy_reset_grad()
        expected_mean = MOMENTUM * p["bn.running_mean"] + (1 - MOMENTUM) * mean
        expected_var = MOMENTUM * p["bn.running_var"] + (1 - MOMENTUM) * var
        p = _values(state, module, WEIGHTS + STATS)
        np.testing.assert_allclose(p["bn.running_mean"], expected_mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(p["bn.running_var"], expected_var, rtol=1e-5)

    module.eval()
    after, _ = module(x, labels)
    np.testing.assert_allclose(after, eval_loss(p, x, labels), rtol=1e-5)
    assert after != first
    np.testing.assert_array_equal(_values(state, module, STATS)["bn.running_mean"], p["bn.running_mean"])

    module.export_model_for_inferencing(tmp_path / "inference.onnx", ["output"])
    sess = onnxruntime.InferenceSession(str(tmp_path / "inference.onnx"), providers=["CPUExecutionProvider"])
    (out,) = sess.run(None, {"input": x})
    np.testing.assert_allclose(cross_entropy(out.astype(np.float64), labels), after, rtol=1e-5)
    if stats_frozen:  # parameters: saved with the checkpoint
        CheckpointState.save_checkpoint(state, tmp_path / "saved")
        back = CheckpointState.load_checkpoint(tmp_path / "saved")
        np.testing.assert_array_equal(back.parameters["bn.running_var"].data, p["bn.running_var"])


def test_an_ort_eval_model_with_training_outputs_on_batch_norm_loads(tmp_path):
    """1.19.2 writes its eval model's BatchNormalization with training_mode=0
    but all three outputs, which ONNX (and its own loader) refuses: the
    Module puts it in inference mode, one output."""
    artifacts.generate_artifacts(bn_model(), requires_grad=WEIGHTS, loss=artifacts.LossType.CrossEntropyLoss,
                                 artifact_directory=tmp_path)
    model = onnx.load(tmp_path / "training_model.onnx")  # ORT's form: training mode off, outputs kept
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            next(a for a in node.attribute if a.name == "training_mode").i = 0
        if node.op_type == "Dropout":
            node.input[2] = ""
    onnx.save(model, tmp_path / "ort_eval_model.onnx")
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "ort_eval_model.onnx")
    x, labels = np.ones((2, 6), np.float32), np.array([0, 2])
    p = _values(state, module, WEIGHTS + STATS)
    np.testing.assert_allclose(module.eval()(x, labels), eval_loss(p, x, labels), rtol=1e-5)


def string_model() -> onnx.ModelProto:
    """string[1, 4] -> Cast(float) -> Gemm(W, B): ORT's string-input test model."""
    graph = helper.make_graph(
        [helper.make_node("Cast", ["input"], ["f"], to=TensorProto.FLOAT),
         helper.make_node("Gemm", ["f", "W", "B"], ["output"])], "strings",
        [helper.make_tensor_value_info("input", TensorProto.STRING, [1, 4])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 2])],
        [numpy_helper.from_array(np.linspace(-0.4, 0.3, 8, dtype=np.float32).reshape(4, 2), "W"),
         numpy_helper.from_array(np.zeros(2, np.float32), "B")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def test_string_inputs_train_and_evaluate_from_numpy_text(tmp_path):
    """A model with a string input, fed a numpy unicode array (``<U3``) as ORT
    takes it: the loss is numpy's on the parsed numbers, the step moves the
    weights by SGD's rule, and eval agrees."""
    artifacts.generate_artifacts(string_model(), requires_grad=["W", "B"], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    opt = Optimizer(tmp_path / "optimizer_model.onnx", module)
    opt.set_learning_rate(0.05)
    text = np.array([["1.0", "2.5", "-3", "0.5"]])
    assert text.dtype == np.dtype("<U3")
    labels = np.array([1])
    w, b = state.parameters["W"].data, state.parameters["B"].data
    numbers = text.astype(np.float64)
    loss = module(text, labels)
    np.testing.assert_allclose(loss, cross_entropy(numbers @ w + b, labels), rtol=1e-6)
    logits = numbers @ w + b
    softmax = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    grad_b = softmax[0] - np.eye(2)[1]
    np.testing.assert_allclose(state.parameters["B"].grad, grad_b, rtol=1e-5)
    opt.step()
    np.testing.assert_allclose(state.parameters["B"].data, b - 0.05 * grad_b, rtol=1e-5)
    np.testing.assert_allclose(state.parameters["W"].data, w - 0.05 * numbers.T @ grad_b[None], rtol=1e-5)
    w, b = state.parameters["W"].data, state.parameters["B"].data
    module.eval()
    np.testing.assert_allclose(module(text, labels), cross_entropy(numbers @ w + b, labels), rtol=1e-6)
    np.testing.assert_allclose(module(text.astype(object), labels), module(text, labels))


def test_ortvalues_in_give_ortvalues_out_of_the_same_shape(data_dir, tmp_path, ort_runs):
    """As 1.19.2's ``Module.__call__``: OrtValues in, OrtValues out (one, or a
    tuple), of the shapes numpy inputs give (the loss is 0-d); any numpy
    input gives numpy outputs."""
    artifacts.generate_artifacts(onnx.load(data_dir / "mlp.onnx"), requires_grad=PARAMS,
                                 loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    x, y = ort_runs["x"][0], ort_runs["labels"][0]
    ov = onnxruntime.OrtValue.ortvalue_from_numpy
    for mode in ("train", "eval"):
        getattr(module, mode)()
        loss = module(x, y)
        assert isinstance(loss, np.ndarray) and loss.shape == ()
        out = module(ov(x), ov(y))
        assert isinstance(out, onnxruntime.OrtValue), mode
        assert out.shape() == [] and out.data_type() == "tensor(float)"
        np.testing.assert_allclose(out.numpy(), loss, rtol=1e-6)
        assert isinstance(module(x, ov(y)), np.ndarray)  # a numpy input: numpy out
    flat = module.get_contiguous_parameters()
    assert isinstance(flat, onnxruntime.OrtValue) and flat.shape() == [16 * 12 + 16 + 5 * 16 + 5]


def test_contiguous_parameters_follow_the_models_order(data_dir, tmp_path, ort_runs):
    """Our artifacts, made as ORT made its committed ones (fc1.bias frozen,
    the rest trainable), give ORT's buffer: the parameters in the order of
    the model's initializers, frozen and trainable alike, and the trainable
    ones alone in that order.  copy_buffer_to_parameters takes that order."""
    model = onnx.load(data_dir / "mlp.onnx")
    artifacts.generate_artifacts(model, requires_grad=["fc1.weight", "fc2.weight", "fc2.bias"],
                                 frozen_params=["fc1.bias"], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    np.testing.assert_array_equal(module.get_contiguous_parameters(trainable_only=False).numpy(),
                                  ort_runs["adamw_contiguous_all"])
    np.testing.assert_array_equal(module.get_contiguous_parameters(trainable_only=True).numpy(),
                                  ort_runs["adamw_contiguous_trainable"])
    order = [t.name for t in model.graph.initializer]
    assert order == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    sizes = [state.parameters[n].data.size for n in order]
    module.copy_buffer_to_parameters(np.arange(sum(sizes), dtype=np.float32), trainable_only=False)
    start = 0
    for name, size in zip(order, sizes):
        np.testing.assert_array_equal(state.parameters[name].data.ravel(), np.arange(start, start + size))
        start += size
    trainable = [n for n in order if state.parameters[n].requires_grad]
    module.copy_buffer_to_parameters(-np.arange(module.get_parameters_size(), dtype=np.float32))
    start = 0
    for name in trainable:
        size = state.parameters[name].data.size
        np.testing.assert_array_equal(state.parameters[name].data.ravel(), -np.arange(start, start + size))
        start += size


class HalfCrossEntropy(onnxblock.Block):
    """0.5 * CrossEntropyLoss(logits), the constant first (``Mul(Constant(0.5), CE(logits))``)."""

    def __init__(self):  # noqa: D107 -- as ORT's examples, without Block.__init__
        self.ce = onnxblock.loss.CrossEntropyLoss()

    def build(self, logits):
        return onnxblock.blocks.Mul()(onnxblock.blocks.Constant(0.5)(), self.ce(logits))


def test_custom_loss_blocks_compose(data_dir, tmp_path, ort_runs, torch_ref):
    """A user Block scaling CrossEntropyLoss by 0.5 generates artifacts and
    trains: half the loss, half the gradients and (SGD) half the step of the
    plain loss, whose values are PyTorch's."""
    model = onnx.load(data_dir / "mlp.onnx")
    runs = {}
    for name, loss in (("half", HalfCrossEntropy()), ("full", artifacts.LossType.CrossEntropyLoss)):
        artifacts.generate_artifacts(model, requires_grad=PARAMS, loss=loss, optimizer=artifacts.OptimType.SGD,
                                     artifact_directory=tmp_path / name)
        state = CheckpointState.load_checkpoint(tmp_path / name / "checkpoint")
        module = Module(tmp_path / name / "training_model.onnx", state, tmp_path / name / "eval_model.onnx")
        opt = Optimizer(tmp_path / name / "optimizer_model.onnx", module)
        opt.set_learning_rate(0.1)
        before = {n: state.parameters[n].data for n in PARAMS}
        loss_value = module(ort_runs["x"][0], ort_runs["labels"][0])
        grads = {n: state.parameters[n].grad for n in PARAMS}
        opt.step()
        steps = {n: state.parameters[n].data - before[n] for n in PARAMS}
        runs[name] = (float(np.asarray(loss_value).ravel()[0]), grads, steps,
                      float(np.asarray(module.eval()(ort_runs["x"][1], ort_runs["labels"][1])).ravel()[0]))
    (half, g_half, s_half, e_half), (full, g_full, s_full, e_full) = runs["half"], runs["full"]
    np.testing.assert_allclose(full, torch_ref["ce_loss"], rtol=1e-6)
    np.testing.assert_allclose(half, 0.5 * full, rtol=1e-6)
    for n in PARAMS:
        np.testing.assert_allclose(g_half[n], 0.5 * g_full[n], rtol=1e-5, atol=1e-8, err_msg=n)
        np.testing.assert_allclose(s_half[n], 0.5 * s_full[n], rtol=1e-4, atol=1e-7, err_msg=n)
    assert e_half < e_full  # each evaluates its own loss after its own step
