"""The API on artifacts we generate: losses and gradients against PyTorch, SGD against
torch.optim.SGD, AdamW against its update rule, accumulation, checkpoints, properties,
parameters, export for inferencing, OrtValues, and the errors."""

import numpy as np
import onnx
import onnxruntime
import pytest
from ort_data import PARAMS

from onnxtrain.ort_training import artifacts, onnxblock
from onnxtrain.ort_training.api import CheckpointState, Module, Optimizer

LOSSES = {"mse": artifacts.LossType.MSELoss, "l1": artifacts.LossType.L1Loss,
          "bce": artifacts.LossType.BCEWithLogitsLoss, "ce": artifacts.LossType.CrossEntropyLoss}


def _generate(data_dir, tmp_path, loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
              **kw):
    model = onnx.load(data_dir / "mlp.onnx")
    kw.setdefault("requires_grad", PARAMS)
    artifacts.generate_artifacts(model, loss=loss, optimizer=optimizer, artifact_directory=tmp_path, **kw)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    opt = Optimizer(tmp_path / "optimizer_model.onnx", module) if optimizer is not None else None
    return state, module, opt


def _target(key, ort_runs, torch_ref):
    return {"ce": ort_runs["labels"][0], "bce": torch_ref["bce_target"]}.get(key, ort_runs["target"][0])


@pytest.mark.parametrize("key", sorted(LOSSES))
def test_losses_and_gradients_match_pytorch(key, data_dir, tmp_path, ort_runs, torch_ref):
    state, module, _ = _generate(data_dir, tmp_path, loss=LOSSES[key], optimizer=None)
    loss = module(ort_runs["x"][0], _target(key, ort_runs, torch_ref))
    np.testing.assert_allclose(loss, torch_ref[f"{key}_loss"], rtol=1e-6)
    for n in PARAMS:
        np.testing.assert_allclose(state.parameters[n].grad, torch_ref[f"{key}_grad_{n}"],
                                   rtol=1e-5, atol=1e-7)


def test_sgd_matches_torch_optim_sgd(data_dir, tmp_path, ort_runs, torch_ref):
    state, module, opt = _generate(data_dir, tmp_path, loss=artifacts.LossType.MSELoss,
                                   optimizer=artifacts.OptimType.SGD)
    opt.set_learning_rate(0.05)
    for i in range(3):
        module(ort_runs["x"][i], ort_runs["target"][i])
        opt.step()
        module.lazy_reset_grad()
        for n in PARAMS:
            np.testing.assert_allclose(state.parameters[n].data, torch_ref[f"torch_sgd_{n}"][i],
                                       rtol=0, atol=1e-6)


def _adamw_reference(p, g, m, v, t, lr, b1, b2, eps, wd, correct):
    """1.19.2's AdamW (adam_mode=1) in float64, the rule written out."""
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    step = lr * np.sqrt(1 - b2**t) / (1 - b1**t) if correct else lr
    p = p - step * m / (np.sqrt(v) + eps)
    return p - lr * wd * p, m, v


@pytest.mark.parametrize("settings", [dict(), dict(weight_decay=0.1, betas=(0.8, 0.99), eps=1e-4),
                                      dict(bias_correction=False, weight_decay=0.01)])
def test_adamw_follows_its_update_rule(settings, data_dir, tmp_path, ort_runs):
    opt_block = onnxblock.optim.AdamW(**settings)
    state, module, opt = _generate(data_dir, tmp_path, optimizer=opt_block)
    cfg = opt_block.config
    opt.set_learning_rate(0.02)
    ref = {n: state.parameters[n].data.astype(np.float64) for n in PARAMS}
    moments = {n: (np.zeros_like(ref[n]), np.zeros_like(ref[n])) for n in PARAMS}
    for t in (1, 2, 3):
        module(ort_runs["x"][t], ort_runs["labels"][t])
        grads = {n: state.parameters[n].grad.astype(np.float64) for n in PARAMS}
        opt.step()
        module.lazy_reset_grad()
        for n in PARAMS:
            ref[n], m, v = _adamw_reference(ref[n], grads[n], *moments[n], t, 0.02, *cfg.betas,
                                            cfg.eps, cfg.weight_decay, cfg.bias_correction)
            moments[n] = (m, v)
            np.testing.assert_allclose(state.parameters[n].data, ref[n], rtol=0, atol=3e-6)
            # keep the reference on our float32 trajectory
            ref[n] = state.parameters[n].data.astype(np.float64)


def test_gradients_accumulate_until_lazy_reset(data_dir, tmp_path, ort_runs):
    state, module, _ = _generate(data_dir, tmp_path)
    x, y = ort_runs["x"], ort_runs["labels"]
    module(x[0], y[0])
    g0 = state.parameters["fc1.weight"].grad
    module(x[1], y[1])
    g01 = state.parameters["fc1.weight"].grad
    module.lazy_reset_grad()
    module(x[1], y[1])
    g1 = state.parameters["fc1.weight"].grad
    assert np.abs(g0).max() > 0
    np.testing.assert_allclose(g01, g0 + g1, rtol=1e-6, atol=1e-7)


def test_gradient_clipping_and_custom_weighted_loss(data_dir, tmp_path, ort_runs, torch_ref):
    """A custom loss block (0.5 * MSE + 0.25 * L1) and SGD with ClipGradNorm(0.1)."""

    class WeightedLoss(onnxblock.Block):
        def __init__(self):
            super().__init__()
            self.mse, self.l1 = onnxblock.loss.MSELoss(), onnxblock.loss.L1Loss()

        def build(self, output_name):
            a = onnxblock.blocks.Mul()(self.mse(output_name, "target"), onnxblock.blocks.Constant(0.5)())
            b = onnxblock.blocks.Mul()(self.l1(output_name, "target"), onnxblock.blocks.Constant(0.25)())
            return onnxblock.blocks.Add()(a, b)

    opt_block = onnxblock.optim.SGD(clip_grad=onnxblock.optim.ClipGradNorm(0.1))
    state, module, opt = _generate(data_dir, tmp_path, loss=WeightedLoss(), optimizer=opt_block)
    before = {n: state.parameters[n].data for n in PARAMS}
    loss = module(ort_runs["x"][0], ort_runs["target"][0])
    np.testing.assert_allclose(loss, 0.5 * torch_ref["mse_loss"] + 0.25 * torch_ref["l1_loss"], rtol=1e-6)
    grads = {n: 0.5 * torch_ref[f"mse_grad_{n}"] + 0.25 * torch_ref[f"l1_grad_{n}"] for n in PARAMS}
    for n in PARAMS:
        np.testing.assert_allclose(state.parameters[n].grad, grads[n], rtol=1e-5, atol=1e-7)
    norm = np.sqrt(sum((g**2).sum() for g in grads.values()))
    assert norm > 0.1  # the clipping is active
    opt.set_learning_rate(1.0)
    opt.step()
    for n in PARAMS:
        expected = before[n] - grads[n] * 0.1 / (norm + 1e-6)
        np.testing.assert_allclose(state.parameters[n].data, expected, rtol=0, atol=1e-6)


def test_checkpoint_with_optimizer_state_resumes_exactly(data_dir, tmp_path, ort_runs):
    state, module, opt = _generate(data_dir, tmp_path)
    opt.set_learning_rate(0.01)
    x, y = ort_runs["x"], ort_runs["labels"]
    for i in range(2):
        module(x[i], y[i]); opt.step(); module.lazy_reset_grad()  # noqa: E702
    state.properties["epoch"] = 2
    CheckpointState.save_checkpoint(state, tmp_path / "resume", include_optimizer_state=True)
    CheckpointState.save_checkpoint(state, tmp_path / "params_only")
    for i in (2, 3):
        module(x[i], y[i]); opt.step(); module.lazy_reset_grad()  # noqa: E702
    expected = {n: state.parameters[n].data for n in PARAMS}

    resumed = CheckpointState.load_checkpoint(tmp_path / "resume")
    assert resumed.properties["epoch"] == 2
    module2 = Module(tmp_path / "training_model.onnx", resumed)
    opt2 = Optimizer(tmp_path / "optimizer_model.onnx", module2)
    opt2.set_learning_rate(0.01)
    for i in (2, 3):
        module2(x[i], y[i]); opt2.step(); module2.lazy_reset_grad()  # noqa: E702
    for n in PARAMS:
        np.testing.assert_array_equal(resumed.parameters[n].data, expected[n])
    # without the optimizer state the moments restart: a different trajectory
    fresh = CheckpointState.load_checkpoint(tmp_path / "params_only")
    module3 = Module(tmp_path / "training_model.onnx", fresh)
    opt3 = Optimizer(tmp_path / "optimizer_model.onnx", module3)
    opt3.set_learning_rate(0.01)
    module3(x[2], y[2]); opt3.step()  # noqa: E702
    assert not np.allclose(fresh.parameters["fc1.weight"].data, expected["fc1.weight"], atol=1e-5)


def test_parameters_and_properties_api(data_dir, tmp_path):
    state, module, _ = _generate(data_dir, tmp_path, requires_grad=PARAMS[2:], frozen_params=PARAMS[:2])
    params = state.parameters
    assert len(params) == 4 and "fc1.weight" in params and "nope" not in params
    assert [name for name, _ in params] == ["fc2.weight", "fc2.bias", "fc1.weight", "fc1.bias"]
    assert params["fc2.bias"].requires_grad and not params["fc1.bias"].requires_grad
    assert repr(params["fc2.bias"]) == "Parameter(name=fc2.bias, requires_grad=True)"
    np.testing.assert_array_equal(params["fc2.bias"].grad, np.zeros(5, np.float32))  # no step yet
    assert params["fc1.bias"].grad is None  # frozen
    new = np.full(5, 0.5, np.float32)
    params["fc2.bias"].data = new
    np.testing.assert_array_equal(params["fc2.bias"].data, new)
    params["fc1.bias"] = np.zeros(16, np.float32)
    np.testing.assert_array_equal(params["fc1.bias"].data, 0)
    with pytest.raises(ValueError, match="float32\\[5\\]"):
        params["fc2.bias"].data = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="float64"):
        params["fc2.bias"].data = np.zeros(5, np.float64)
    with pytest.raises(KeyError, match="nope"):
        params["nope"]
    props = state.properties
    props["epoch"], props["score"], props["name"] = 7, 0.75, "run-1"
    assert len(props) == 3 and "epoch" in props and dict(props)["name"] == "run-1"
    props["tenth"] = 0.1  # kept as float32, as the checkpoint (and ORT) keeps it
    assert props["tenth"] == float(np.float32(0.1)) != 0.1
    del state._data.properties["tenth"]
    with pytest.raises(TypeError):
        props["bad"] = [1, 2]
    with pytest.raises(KeyError):
        props["missing"]
    CheckpointState.save_checkpoint(state, tmp_path / "ck")
    back = CheckpointState.load_checkpoint(tmp_path / "ck")
    assert dict(back.properties) == {"epoch": 7, "score": 0.75, "name": "run-1"}
    np.testing.assert_array_equal(back.parameters["fc2.bias"].data, new)
    assert not back.parameters["fc1.weight"].requires_grad


def test_export_model_for_inferencing(data_dir, tmp_path, ort_runs):
    state, module, opt = _generate(data_dir, tmp_path)
    opt.set_learning_rate(0.05)
    module(ort_runs["x"][0], ort_runs["labels"][0]); opt.step()  # noqa: E702
    module.export_model_for_inferencing(tmp_path / "inference.onnx", ["output"])
    sess = onnxruntime.InferenceSession(str(tmp_path / "inference.onnx"),
                                        providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["input"]
    x = ort_runs["x"][1]
    p = {n: state.parameters[n].data for n in PARAMS}
    expected = np.maximum(x @ p["fc1.weight"].T + p["fc1.bias"], 0) @ p["fc2.weight"].T + p["fc2.bias"]
    np.testing.assert_allclose(sess.run(["output"], {"input": x})[0], expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="'nope'"):
        module.export_model_for_inferencing(tmp_path / "bad.onnx", ["nope"])


def test_ortvalues_in_ortvalues_out_and_extra_outputs(data_dir, tmp_path, ort_runs):
    state, module, _ = _generate(data_dir, tmp_path, additional_output_names=["output"])
    x, y = ort_runs["x"][0], ort_runs["labels"][0]
    loss, out = module(x, y)
    assert out.shape == (5, 5)
    assert module.output_names()[1] == "output"
    ov = module(onnxruntime.OrtValue.ortvalue_from_numpy(x), onnxruntime.OrtValue.ortvalue_from_numpy(y))
    assert all(type(v).__name__ == "OrtValue" for v in ov)
    np.testing.assert_allclose(ov[0].numpy(), loss, rtol=1e-6)


def test_errors_instead_of_crashes(data_dir, tmp_path, ort_runs):
    state, module, opt = _generate(data_dir, tmp_path)
    alone = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    no_eval = Module(tmp_path / "training_model.onnx", alone)
    with pytest.raises(RuntimeError, match="no eval model"):
        no_eval.eval()
    with pytest.raises(RuntimeError, match="already belongs"):
        Module(tmp_path / "training_model.onnx", alone)
    with pytest.raises(ValueError, match="device 'cuda'"):
        Module(tmp_path / "training_model.onnx", CheckpointState.load_checkpoint(tmp_path / "checkpoint"),
               device="cuda")
    with pytest.raises(ValueError, match="expected 2 inputs"):
        module(ort_runs["x"][0])
    with pytest.raises(TypeError):
        CheckpointState(None)
    with pytest.raises(FileNotFoundError):
        Optimizer(tmp_path / "missing.onnx", module)
    with pytest.raises(ValueError, match="not an optimizer model"):
        Optimizer(tmp_path / "eval_model.onnx", module)
    (tmp_path / "m.ort").write_bytes(b"\0\0\0\0ORTM")
    with pytest.raises(NotImplementedError, match=".ort format"):
        Module(tmp_path / "m.ort", CheckpointState.load_checkpoint(tmp_path / "checkpoint"))


def test_generate_artifacts_options(data_dir, tmp_path):
    model = onnx.load(data_dir / "mlp.onnx")
    with pytest.raises(NotImplementedError, match="ort_format"):
        artifacts.generate_artifacts(model, requires_grad=PARAMS, ort_format=True, artifact_directory=tmp_path)
    with pytest.raises(NotImplementedError, match="custom-op"):
        artifacts.generate_artifacts(model, requires_grad=PARAMS, custom_op_library="x.so",
                                     artifact_directory=tmp_path)
    with pytest.raises(RuntimeError, match="frozen and require"):
        artifacts.generate_artifacts(model, requires_grad=PARAMS, frozen_params=PARAMS[:1],
                                     artifact_directory=tmp_path)
    with pytest.raises(RuntimeError, match="Unknown loss"):
        artifacts.generate_artifacts(model, requires_grad=PARAMS, loss="mse", artifact_directory=tmp_path)
    artifacts.generate_artifacts(model, requires_grad=PARAMS[:2], loss=artifacts.LossType.MSELoss,
                                 artifact_directory=tmp_path, prefix="p_", nominal_checkpoint=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "p_checkpoint", "p_eval_model.onnx", "p_nominal_checkpoint", "p_training_model.onnx"]
    nominal = CheckpointState.load_checkpoint(tmp_path / "p_nominal_checkpoint")
    assert nominal._data.nominal and len(nominal.parameters) == 2  # fc2.* stay graph constants
    for name in ("p_training_model.onnx", "p_eval_model.onnx"):
        onnx.checker.check_model(onnx.load(tmp_path / name), full_check=True)


LOSS_OPTIONS = {
    "mse_sum": lambda r: onnxblock.loss.MSELoss(reduction="sum"),
    "l1_sum": lambda r: onnxblock.loss.L1Loss(reduction="sum"),
    "ce_weighted": lambda r: onnxblock.loss.CrossEntropyLoss(weight=r["class_weight"]),
    "ce_sum": lambda r: onnxblock.loss.CrossEntropyLoss(reduction="sum"),
    "bce_pos_weight": lambda r: onnxblock.loss.BCEWithLogitsLoss(pos_weight=r["pos_weight"]),
}


@pytest.mark.parametrize("key", sorted(LOSS_OPTIONS))
def test_loss_options_match_pytorch(key, data_dir, tmp_path, ort_runs, torch_ref):
    state, module, _ = _generate(data_dir, tmp_path, loss=LOSS_OPTIONS[key](torch_ref), optimizer=None)
    loss = module(ort_runs["x"][0], _target(key.split("_")[0], ort_runs, torch_ref))
    np.testing.assert_allclose(loss, torch_ref[f"{key}_loss"], rtol=1e-6)
    for n in PARAMS:
        np.testing.assert_allclose(state.parameters[n].grad, torch_ref[f"{key}_grad_{n}"],
                                   rtol=1e-5, atol=1e-6)


def test_loss_reduction_checked():
    with pytest.raises(RuntimeError, match="Reduction max not supported"):
        onnxblock.loss.MSELoss(reduction="max")


def test_session_options_and_device_index(data_dir, ort_runs):
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    d = data_dir / "adamw"
    state = CheckpointState.load_checkpoint(d / "checkpoint")
    module = Module(d / "training_model.onnx", state, d / "eval_model.onnx", device="cpu:0",
                    session_options=options)
    np.testing.assert_allclose(module.eval()(ort_runs["x"][0], ort_runs["labels"][0]),
                               ort_runs["adamw_losses"][0], rtol=2e-6)
