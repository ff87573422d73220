"""Make tests/data/ort_training/: artifacts, checkpoints and runs recorded with
ONNX Runtime training 1.19.2 (the peer), plus PyTorch references.

Run in the peer's venv (bash benchmarks/setup_ort_training.sh):

    benchmarks/.venv-ort-training/bin/python scripts/make_ort_artifacts.py

Writes, under tests/data/ort_training/:
- mlp.onnx: a 12-16-5 MLP (Gemm-Relu-Gemm), weights from a fixed seed;
- adamw/: ORT's artifacts for CrossEntropyLoss + AdamW, fc1.bias frozen, with a
  nominal checkpoint; adamw/checkpoint_step3: the state after 3 steps with
  optimizer state and properties;
- sgd/: ORT's artifacts for MSELoss + SGD, every parameter trained;
- ort_runs.npz: the data, ORT's losses and parameters step by step, the
  AdamW resume trajectory (steps 4-5), an accumulated step, LinearLRScheduler's
  learning rates;
- torch_reference.npz: the four losses and their gradients, and SGD steps,
  computed by PyTorch on the same weights and data.
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "ort_training"
PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(25)
    w1 = (rng.standard_normal((16, 12)) * 0.3).astype(np.float32)
    b1 = (rng.standard_normal(16) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((5, 16)) * 0.3).astype(np.float32)
    b2 = (rng.standard_normal(5) * 0.1).astype(np.float32)
    nodes = [
        helper.make_node("Gemm", ["input", "fc1.weight", "fc1.bias"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "fc2.weight", "fc2.bias"], ["output"], transB=1),
    ]
    g = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 12])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 5])],
        [numpy_helper.from_array(a, n) for a, n in zip([w1, b1, w2, b2], PARAMS)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def data():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 5, 12)).astype(np.float32)        # 6 batches of 5
    labels = rng.integers(0, 5, (6, 5)).astype(np.int64)
    target = rng.standard_normal((6, 5, 5)).astype(np.float32)
    return x, labels, target


def params_of(state):
    return {n: np.array(state.parameters[n].data) for n in PARAMS}


def ort_side(model, rec):
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, LinearLRScheduler, Module, Optimizer

    x, labels, target = data()
    rec["x"], rec["labels"], rec["target"] = x, labels, target
    for d in ("adamw", "sgd"):
        shutil.rmtree(OUT / d, ignore_errors=True)
        (OUT / d).mkdir(parents=True)
    artifacts.generate_artifacts(
        model, requires_grad=["fc1.weight", "fc2.weight", "fc2.bias"], frozen_params=["fc1.bias"],
        loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
        artifact_directory=str(OUT / "adamw"), nominal_checkpoint=True)
    artifacts.generate_artifacts(
        model, requires_grad=PARAMS, loss=artifacts.LossType.MSELoss,
        optimizer=artifacts.OptimType.SGD, artifact_directory=str(OUT / "sgd"))

    # AdamW: 3 steps at lr 0.01, checkpoint with optimizer state, 2 more steps.
    a = OUT / "adamw"
    state = CheckpointState.load_checkpoint(str(a / "checkpoint"))
    module = Module(str(a / "training_model.onnx"), state, str(a / "eval_model.onnx"))
    opt = Optimizer(str(a / "optimizer_model.onnx"), module)
    rec["adamw_default_lr"] = np.float32(opt.get_learning_rate())
    rec["adamw_contiguous_all"] = module.get_contiguous_parameters(trainable_only=False).numpy()
    rec["adamw_contiguous_trainable"] = module.get_contiguous_parameters(trainable_only=True).numpy()
    opt.set_learning_rate(0.01)
    losses, steps = [], []
    for i in range(5):
        module.train()
        losses.append(float(module(x[i], labels[i])))
        opt.step()
        module.lazy_reset_grad()
        steps.append(params_of(state))
        if i == 2:
            state.properties["epoch"] = 3
            state.properties["best_loss"] = 0.25
            state.properties["tag"] = "mlp"
            CheckpointState.save_checkpoint(state, str(a / "checkpoint_step3"), include_optimizer_state=True)
    rec["adamw_losses"] = np.array(losses, np.float32)
    for n in PARAMS:
        rec[f"adamw_{n}"] = np.stack([s[n] for s in steps])
    module.eval()
    rec["adamw_eval_loss"] = np.float32(module(x[5], labels[5]))
    rec["adamw_eval_output_names"] = np.array(module.output_names())
    module.train()
    rec["adamw_train_input_names"] = np.array(module.input_names())

    # SGD: 3 steps at lr 0.05; step 3 accumulates two micro-batches (x[2], x[3]).
    s = OUT / "sgd"
    state = CheckpointState.load_checkpoint(str(s / "checkpoint"))
    module = Module(str(s / "training_model.onnx"), state, str(s / "eval_model.onnx"))
    opt = Optimizer(str(s / "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.05)
    losses, steps = [], []
    for i in range(3):
        losses.append(float(module(x[i], target[i])))
        if i == 2:
            losses.append(float(module(x[3], target[3])))
        opt.step()
        module.lazy_reset_grad()
        steps.append(params_of(state))
    rec["sgd_losses"] = np.array(losses, np.float32)
    for n in PARAMS:
        rec[f"sgd_{n}"] = np.stack([st[n] for st in steps])

    # LinearLRScheduler(opt, warmup_step_count=2, total_step_count=6, initial_lr=0.1) on a
    # fresh SGD run: the learning rate after construction, then after each
    # opt.step(); sched.step() (1.19.2's binding swaps the two counts).
    state = CheckpointState.load_checkpoint(str(s / "checkpoint"))
    module = Module(str(s / "training_model.onnx"), state, str(s / "eval_model.onnx"))
    opt = Optimizer(str(s / "optimizer_model.onnx"), module)
    sched = LinearLRScheduler(opt, 2, 6, 0.1)
    lrs = [opt.get_learning_rate()]
    for _ in range(8):
        module(x[0], target[0])
        opt.step()
        module.lazy_reset_grad()
        sched.step()
        lrs.append(opt.get_learning_rate())
    rec["ort_scheduler_lrs"] = np.array(lrs, np.float32)


def torch_side(model, rec):
    import torch

    x, labels, target = data()
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}

    def net(p, xb):
        h = torch.relu(xb @ p["fc1.weight"].T + p["fc1.bias"])
        return h @ p["fc2.weight"].T + p["fc2.bias"]

    for key in ("mse", "l1", "bce", "ce"):
        p = {n: torch.tensor(init[n], dtype=torch.float64, requires_grad=True) for n in PARAMS}
        out = net(p, torch.from_numpy(x[0]).double())
        if key == "ce":
            loss = torch.nn.functional.cross_entropy(out, torch.from_numpy(labels[0]))
        elif key == "bce":
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                out, torch.from_numpy((target[0] > 0).astype(np.float64)))
        elif key == "mse":
            loss = torch.nn.functional.mse_loss(out, torch.from_numpy(target[0]).double())
        else:
            loss = torch.nn.functional.l1_loss(out, torch.from_numpy(target[0]).double())
        loss.backward()
        rec[f"{key}_loss"] = np.float64(loss.item())
        for n in PARAMS:
            rec[f"{key}_grad_{n}"] = p[n].grad.numpy()
    rec["bce_target"] = (target[0] > 0).astype(np.float32)

    # loss options: reduction="sum", class weights, pos_weight
    F = torch.nn.functional
    class_weight = np.array([1.0, 2.0, 0.5, 1.5, 1.0], np.float32)
    pos_weight = np.array([2.0, 1.0, 0.5, 3.0, 1.0], np.float32)
    rec["class_weight"], rec["pos_weight"] = class_weight, pos_weight
    variants = {
        "mse_sum": lambda o: F.mse_loss(o, torch.from_numpy(target[0]).double(), reduction="sum"),
        "l1_sum": lambda o: F.l1_loss(o, torch.from_numpy(target[0]).double(), reduction="sum"),
        "ce_weighted": lambda o: F.cross_entropy(o, torch.from_numpy(labels[0]),
                                                 weight=torch.from_numpy(class_weight).double()),
        "ce_sum": lambda o: F.cross_entropy(o, torch.from_numpy(labels[0]), reduction="sum"),
        "bce_pos_weight": lambda o: F.binary_cross_entropy_with_logits(
            o, torch.from_numpy((target[0] > 0).astype(np.float64)),
            pos_weight=torch.from_numpy(pos_weight).double()),
    }
    for key, fn in variants.items():
        p = {n: torch.tensor(init[n], dtype=torch.float64, requires_grad=True) for n in PARAMS}
        loss = fn(net(p, torch.from_numpy(x[0]).double()))
        loss.backward()
        rec[f"{key}_loss"] = np.float64(loss.item())
        for n in PARAMS:
            rec[f"{key}_grad_{n}"] = p[n].grad.numpy()

    # torch.optim.SGD(lr=0.05) on MSE, 3 steps, float32.
    p = [torch.tensor(init[n], requires_grad=True) for n in PARAMS]
    opt = torch.optim.SGD(p, lr=0.05)
    traj = []
    for i in range(3):
        opt.zero_grad()
        out = net(dict(zip(PARAMS, p)), torch.from_numpy(x[i]))
        torch.nn.functional.mse_loss(out, torch.from_numpy(target[i])).backward()
        opt.step()
        traj.append([t.detach().numpy().copy() for t in p])
    for j, n in enumerate(PARAMS):
        rec[f"torch_sgd_{n}"] = np.stack([t[j] for t in traj])


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    model = mlp()
    onnx.save(model, OUT / "mlp.onnx")
    if sys.argv[1:] == ["torch"]:
        rec = {}
        torch_side(model, rec)
        np.savez(OUT / "torch_reference.npz", **rec)
        return
    rec = {}
    ort_side(model, rec)
    np.savez(OUT / "ort_runs.npz", **rec)
    try:
        rec = {}
        torch_side(model, rec)
        np.savez(OUT / "torch_reference.npz", **rec)
    except ImportError:
        print("torch missing: run again with argument 'torch' in a venv that has it")
    import onnxruntime
    (OUT / "VERSIONS.json").write_text(json.dumps(
        {"onnxruntime-training": onnxruntime.__version__, "onnx": onnx.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
