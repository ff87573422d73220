"""Artifacts and checkpoints made by ONNX Runtime training 1.19.2, trained by our
Module/Optimizer: the numbers ORT recorded (tests/data/ort_training/ort_runs.npz)."""

import numpy as np
import pytest
from ort_data import PARAMS

from onnxtrain.ort_training.api import CheckpointState, LinearLRScheduler, Module, Optimizer


def _open(data_dir, kind, checkpoint="checkpoint"):
    d = data_dir / kind
    state = CheckpointState.load_checkpoint(d / checkpoint)
    module = Module(d / "training_model.onnx", state, d / "eval_model.onnx")
    return state, module, Optimizer(d / "optimizer_model.onnx", module)


def test_adamw_trains_to_ort_numbers(data_dir, ort_runs):
    state, module, opt = _open(data_dir, "adamw")
    assert opt.get_learning_rate() == pytest.approx(float(ort_runs["adamw_default_lr"]))
    opt.set_learning_rate(0.01)
    for i in range(5):
        loss = module(ort_runs["x"][i], ort_runs["labels"][i])
        opt.step()
        module.lazy_reset_grad()
        assert isinstance(loss, np.ndarray) and loss.shape == ()
        np.testing.assert_allclose(loss, ort_runs["adamw_losses"][i], rtol=2e-6)
        for n in PARAMS:
            np.testing.assert_allclose(state.parameters[n].data, ort_runs[f"adamw_{n}"][i],
                                       rtol=0, atol=2e-6)
    # fc1.bias is frozen in these artifacts: unchanged, no gradient
    assert not state.parameters["fc1.bias"].requires_grad
    assert state.parameters["fc1.bias"].grad is None
    np.testing.assert_array_equal(state.parameters["fc1.bias"].data, ort_runs["adamw_fc1.bias"][0])
    module.eval()
    np.testing.assert_allclose(module(ort_runs["x"][5], ort_runs["labels"][5]),
                               ort_runs["adamw_eval_loss"], rtol=2e-6)
    assert module.output_names() == list(ort_runs["adamw_eval_output_names"])
    assert module.train() is module and module.training
    assert module.input_names() == list(ort_runs["adamw_train_input_names"])


def test_resume_from_ort_checkpoint_continues_its_trajectory(data_dir, ort_runs):
    state, module, opt = _open(data_dir, "adamw", "checkpoint_step3")
    assert dict(state.properties) == {"epoch": 3, "best_loss": 0.25, "tag": "mlp"}
    opt.set_learning_rate(0.01)
    for i in (3, 4):  # the step count (3) and the moments come from the checkpoint
        loss = module(ort_runs["x"][i], ort_runs["labels"][i])
        opt.step()
        module.lazy_reset_grad()
        np.testing.assert_allclose(loss, ort_runs["adamw_losses"][i], rtol=2e-6)
        for n in PARAMS:
            np.testing.assert_allclose(state.parameters[n].data, ort_runs[f"adamw_{n}"][i],
                                       rtol=0, atol=2e-6)


def test_sgd_with_accumulation_matches_ort(data_dir, ort_runs):
    state, module, opt = _open(data_dir, "sgd")
    opt.set_learning_rate(0.05)
    losses = []
    for i in range(3):
        losses.append(module(ort_runs["x"][i], ort_runs["target"][i]))
        if i == 2:  # two micro-batches summed into one update
            losses.append(module(ort_runs["x"][3], ort_runs["target"][3]))
        opt.step()
        module.lazy_reset_grad()
        for n in PARAMS:
            np.testing.assert_allclose(state.parameters[n].data, ort_runs[f"sgd_{n}"][i],
                                       rtol=0, atol=1e-6)
    np.testing.assert_allclose(losses, ort_runs["sgd_losses"], rtol=2e-6)


def test_linear_scheduler_documented_schedule_and_ort_swap(data_dir, ort_runs):
    """Ours follows the documentation; 1.19.2 swaps the counts, so ORT's recorded
    (warmup=2, total=6) rates are ours with (warmup=6, total=2)."""
    for (warmup, total), expected in (((2, 6), [0, .05, .1, .075, .05, .025, 0, 0, 0]),
                                      ((6, 2), ort_runs["ort_scheduler_lrs"])):
        state, module, opt = _open(data_dir, "sgd")
        sched = LinearLRScheduler(opt, warmup, total, 0.1)
        lrs = [opt.get_learning_rate()]
        for _ in range(8):
            module(ort_runs["x"][0], ort_runs["target"][0])
            opt.step()
            module.lazy_reset_grad()
            sched.step()
            lrs.append(opt.get_learning_rate())
        np.testing.assert_allclose(lrs, expected, atol=1e-7)


def test_nominal_checkpoint_refuses_until_loaded(data_dir, ort_runs):
    d = data_dir / "adamw"
    state = CheckpointState.load_checkpoint(d / "nominal_checkpoint")
    module = Module(d / "training_model.onnx", state, d / "eval_model.onnx")
    opt = Optimizer(d / "optimizer_model.onnx", module)
    with pytest.raises(RuntimeError, match="nominal.*'fc1.weight'.*copy_buffer_to_parameters"):
        module(ort_runs["x"][0], ort_runs["labels"][0])
    with pytest.raises(RuntimeError, match="nominal"):
        opt.set_learning_rate(0.01)
    with pytest.raises(RuntimeError, match="nominal"):
        opt.step()
    with pytest.raises(RuntimeError, match="load the parameter states first"):
        state.parameters["fc1.weight"]
    with pytest.raises(RuntimeError, match="load all the parameter states first"):
        state.parameters["fc1.weight"] = np.ones((16, 12), np.float32)
    with pytest.raises(RuntimeError, match="load the model parameters first"):
        module.get_contiguous_parameters()
    with pytest.raises(RuntimeError, match="nominal"):
        module.eval()(ort_runs["x"][0], ort_runs["labels"][0])
    module.train()
    assert module.get_parameters_size(False) == 293
    full_state, full, _ = _open(data_dir, "adamw")
    buffer = full.get_contiguous_parameters(trainable_only=False)
    assert full.get_parameters_size(False) == 16 * 12 + 16 + 5 * 16 + 5
    assert full.get_parameters_size() == 16 * 12 + 5 * 16 + 5
    module.copy_buffer_to_parameters(buffer, trainable_only=False)
    opt.set_learning_rate(0.01)
    loss = module(ort_runs["x"][0], ort_runs["labels"][0])
    opt.step()
    np.testing.assert_allclose(loss, ort_runs["adamw_losses"][0], rtol=2e-6)
    np.testing.assert_allclose(state.parameters["fc2.weight"].data, ort_runs["adamw_fc2.weight"][0],
                               atol=2e-6)


def test_contiguous_parameters_in_ort_order(data_dir, ort_runs):
    state, module, _ = _open(data_dir, "adamw")
    everything = module.get_contiguous_parameters(trainable_only=False)
    assert type(everything).__name__ == "OrtValue"
    np.testing.assert_array_equal(everything.numpy(), ort_runs["adamw_contiguous_all"])
    np.testing.assert_array_equal(module.get_contiguous_parameters(trainable_only=True).numpy(),
                                  ort_runs["adamw_contiguous_trainable"])
    # round trip: a changed buffer lands in the parameters, in that order
    module.copy_buffer_to_parameters(ort_runs["adamw_contiguous_trainable"] * 2)
    np.testing.assert_array_equal(state.parameters["fc2.bias"].data,
                                  2 * ort_runs["adamw_contiguous_trainable"][-5:])
    with pytest.raises(ValueError, match="277"):
        module.copy_buffer_to_parameters(np.zeros(3, np.float32))
