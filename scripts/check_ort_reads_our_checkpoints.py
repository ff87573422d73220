"""Check that ONNX Runtime training 1.19.2 reads the checkpoints onnxtrain writes.

Step 1 (onnxtrain's venv) writes them: after 3 AdamW steps of our Module on
ORT's adamw artifacts, with optimizer state and properties; and a nominal one:

    .venv/bin/python scripts/check_ort_reads_our_checkpoints.py write OUT_DIR

Step 2 (the peer's venv) loads them with ORT, checks the values and the
properties, and resumes training with ORT's Module/Optimizer, which must land
on the trajectory ORT recorded (tests/data/ort_training/ort_runs.npz):

    benchmarks/.venv-ort-training/bin/python scripts/check_ort_reads_our_checkpoints.py read OUT_DIR
"""

import sys
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "ort_training"


def write(out: Path) -> None:
    import onnx

    from onnxtrain.ort_training import artifacts
    from onnxtrain.ort_training.api import CheckpointState, Module, Optimizer

    r = np.load(DATA / "ort_runs.npz")
    a = DATA / "adamw"
    state = CheckpointState.load_checkpoint(a / "checkpoint")
    module = Module(a / "training_model.onnx", state, a / "eval_model.onnx")
    opt = Optimizer(a / "optimizer_model.onnx", module)
    opt.set_learning_rate(0.01)
    for i in range(3):
        module(r["x"][i], r["labels"][i])
        opt.step()
        module.lazy_reset_grad()
    state.properties["epoch"] = 3
    state.properties["best_loss"] = 0.25
    state.properties["tag"] = "ours"
    out.mkdir(parents=True, exist_ok=True)
    CheckpointState.save_checkpoint(state, out / "ours_step3", include_optimizer_state=True)
    CheckpointState.save_checkpoint(state, out / "ours_params_only")
    artifacts.generate_artifacts(onnx.load(DATA / "mlp.onnx"), requires_grad=["fc1.weight", "fc2.weight", "fc2.bias"],
                                 frozen_params=["fc1.bias"], artifact_directory=out / "art",
                                 nominal_checkpoint=True)
    print("wrote", out)


def read(out: Path) -> None:
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    r = np.load(DATA / "ort_runs.npz")
    a = DATA / "adamw"
    state = CheckpointState.load_checkpoint(str(out / "ours_step3"))
    assert state.properties["epoch"] == 3 and state.properties["tag"] == "ours"
    assert abs(state.properties["best_loss"] - 0.25) < 1e-7
    module = Module(str(a / "training_model.onnx"), state, str(a / "eval_model.onnx"))
    opt = Optimizer(str(a / "optimizer_model.onnx"), module)
    np.testing.assert_allclose(state.parameters["fc1.weight"].data, r["adamw_fc1.weight"][2], atol=1e-6)
    opt.set_learning_rate(0.01)
    for i in (3, 4):
        loss = module(r["x"][i], r["labels"][i])
        opt.step()
        module.lazy_reset_grad()
        np.testing.assert_allclose(loss, r["adamw_losses"][i], rtol=1e-5)
        for n in ("fc1.weight", "fc2.weight", "fc2.bias"):
            np.testing.assert_allclose(state.parameters[n].data, r[f"adamw_{n}"][i], atol=1e-6)
    print("ORT resumed from our checkpoint (optimizer state, properties): steps 4-5 match")
    state = CheckpointState.load_checkpoint(str(out / "ours_params_only"))
    assert len(state.parameters) == 4
    for sub in ("checkpoint", "nominal_checkpoint"):
        st = CheckpointState.load_checkpoint(str(out / "art" / sub))
        print(sub, "loaded by ORT:", sorted(st._state.parameter_names()))
    st = CheckpointState.load_checkpoint(str(out / "art" / "nominal_checkpoint"))
    m = Module(str(a / "training_model.onnx"), st, str(a / "eval_model.onnx"))
    full = CheckpointState.load_checkpoint(str(a / "checkpoint"))
    ref = Module(str(a / "training_model.onnx"), full, str(a / "eval_model.onnx"))
    m.copy_buffer_to_parameters(ref.get_contiguous_parameters(), trainable_only=False)
    print("ORT completed our nominal checkpoint and runs:", float(m(r["x"][0], r["labels"][0])))


if __name__ == "__main__":
    {"write": write, "read": read}[sys.argv[1]](Path(sys.argv[2]))
