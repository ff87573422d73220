"""import_ort / `onnxtrain import-ort`: ORT artifacts + checkpoint -> one standard
training model that TrainingSession, fit and the CLI run."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from ort_data import PARAMS

from onnxtrain import TrainingSession
from onnxtrain.cli import main
from onnxtrain.ort_training import artifacts, import_ort
from onnxtrain.ort_training.api import CheckpointState, Module


def test_imported_model_continues_ort_trajectory(data_dir, ort_runs, tmp_path):
    out = tmp_path / "model.onnx"
    model = import_ort(data_dir / "adamw", out, checkpoint=data_dir / "adamw" / "checkpoint_step3")
    assert model.training_info and not any(
        n.domain == "com.microsoft" for ti in model.training_info for n in ti.algorithm.node)
    sess = TrainingSession(out)
    assert sess.learning_rate == pytest.approx(0.001)  # the checkpoint's
    sess.learning_rate = 0.01
    for i in (3, 4):
        result = sess.train_step({"input": ort_runs["x"][i], "labels": ort_runs["labels"][i]})
        np.testing.assert_allclose(result["onnx::loss::2"], ort_runs["adamw_losses"][i], rtol=2e-6)
        for n in PARAMS:
            np.testing.assert_allclose(sess.state[n], ort_runs[f"adamw_{n}"][i], atol=2e-6)
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["ort_training.property.epoch"] == "3"


def test_imported_model_fits(data_dir, ort_runs, tmp_path):
    import_ort(data_dir / "sgd", tmp_path / "m.onnx")
    sess = TrainingSession(tmp_path / "m.onnx")
    sess.learning_rate = 0.05
    history = sess.fit(ort_runs["x"].reshape(-1, 12), ort_runs["target"].reshape(-1, 5), epochs=3,
                       batch_size=5, shuffle=False, progress=False)
    losses = history.history["loss"]
    assert losses[-1] < losses[0]
    # one epoch of fit = ORT's SGD steps on the same batches: the first step's parameters
    first = TrainingSession(tmp_path / "m.onnx")
    first.learning_rate = 0.05
    first.train_step({"input": ort_runs["x"][0], "target": ort_runs["target"][0]})
    np.testing.assert_allclose(first.state["fc1.weight"], ort_runs["sgd_fc1.weight"][0], atol=1e-6)


def test_cli_import_and_train(data_dir, ort_runs, tmp_path, capsys):
    out = tmp_path / "imported.onnx"
    assert main(["import-ort", str(data_dir / "adamw"), "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    np.savez(tmp_path / "d.npz", input=ort_runs["x"].reshape(-1, 12), labels=ort_runs["labels"].reshape(-1))
    assert main(["train", str(out), "--data", str(tmp_path / "d.npz"), "--epochs", "1",
                 "--batch-size", "5", "-o", str(tmp_path / "t.onnx"), "--no-progress"]) == 0
    assert "accuracy" in capsys.readouterr().out  # the prediction was found for the metrics


@pytest.mark.parametrize("args, message", [
    (["/no/such/dir"], "is not a folder"),
    (["{adamw}", "--checkpoint", "{adamw}/nominal_checkpoint"], "nominal checkpoint"),
    (["{adamw}", "--prefix", "x_"], "no x_checkpoint"),
    (["{adamw}", "--checkpoint", "{adamw}/eval_model.onnx"], "ODTC"),
])
def test_cli_mistakes_are_one_line(args, message, data_dir, tmp_path, capsys):
    args = [a.format(adamw=data_dir / "adamw") for a in args]
    assert main(["import-ort", *args, "-o", str(tmp_path / "x.onnx")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "x.onnx").exists()


def test_batchnorm_model_eval_loads_and_runs(tmp_path):
    """1.19.2 crashed loading a BatchNormalization model's eval model; here it runs
    (BatchNormalization in inference mode, its statistics graph constants)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(np.ones(4, np.float32), "scale"),
             numpy_helper.from_array(np.zeros(4, np.float32), "bias"),
             numpy_helper.from_array(np.full(4, 0.5, np.float32), "mean"),
             numpy_helper.from_array(np.full(4, 2.0, np.float32), "var")]
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["h"], transB=1),
         helper.make_node("BatchNormalization", ["h", "scale", "bias", "mean", "var"], ["y"])],
        "bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 15)])
    artifacts.generate_artifacts(model, requires_grad=["w", "scale", "bias"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    x, t = rng.standard_normal((2, 3)).astype(np.float32), np.zeros((2, 4), np.float32)
    train_loss = module(x, t)
    eval_loss = module.eval()(x, t)
    h = x @ numpy_helper.to_array(inits[0]).T
    expected = np.mean(((h - 0.5) / np.sqrt(2.0 + 1e-5)) ** 2)
    np.testing.assert_allclose([train_loss, eval_loss], [expected, expected], rtol=1e-5)


def _mlp_forward(state, x):
    p = {n: np.asarray(state[n], np.float64) for n in PARAMS}
    return np.maximum(x @ p["fc1.weight"].T + p["fc1.bias"], 0) @ p["fc2.weight"].T + p["fc2.bias"]


def test_an_imported_model_exports_the_model_the_artifacts_were_made_from(data_dir, ort_runs, tmp_path):
    """ORT's artifacts hold the loss: the imported model's inference export
    is the model they were made from (input -> output), without the loss or
    the labels, with the trained weights; ``outputs=`` chooses others
    (the loss, which brings the labels back), as ORT's
    export_model_for_inferencing(path, names)."""
    import onnxruntime

    sess = TrainingSession(import_ort(data_dir / "adamw"))
    sess.learning_rate = 0.01
    sess.train_step({"input": ort_runs["x"][0], "labels": ort_runs["labels"][0]})
    path = sess.export(tmp_path / "inference.onnx")
    ort_sess = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in ort_sess.get_inputs()] == ["input"]
    assert [o.name for o in ort_sess.get_outputs()] == ["output"]
    x = ort_runs["x"][1]
    (out,) = ort_sess.run(None, {"input": x})
    np.testing.assert_allclose(out, _mlp_forward(sess.state, x), rtol=1e-5, atol=1e-6)
    model = sess.to_model()
    assert [o.name for o in model.graph.output] == ["output"] and len(model.graph.node) == 3

    both = sess.to_model(outputs=["output", "onnx::loss::2"])
    assert [i.name for i in both.graph.input] == ["input", "labels"]
    assert [o.name for o in both.graph.output] == ["output", "onnx::loss::2"]
    hidden = sess.to_model(outputs=["h"])  # an intermediate value: fc1's Gemm alone
    assert [n.op_type for n in hidden.graph.node] == ["Gemm"]
    assert sorted(t.name for t in hidden.graph.initializer) == ["fc1.bias", "fc1.weight"]
    assert hidden.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    with pytest.raises(ValueError, match="'nope' is not a value of the model's main graph"):
        sess.export(tmp_path / "bad.onnx", outputs=["nope"])
    with pytest.raises(ValueError, match="training=True"):
        sess.export(tmp_path / "bad.onnx", training=True, outputs=["output"])
    assert not (tmp_path / "bad.onnx").exists()
    # the training checkpoint keeps everything, and its export again the model alone
    sess.export(tmp_path / "ck.onnx", training=True)
    again = TrainingSession(tmp_path / "ck.onnx").to_model()
    assert [i.name for i in again.graph.input] == ["input"] and [o.name for o in again.graph.output] == ["output"]


def test_cli_import_train_and_export_write_the_model_without_loss_or_labels(data_dir, ort_runs, tmp_path,
                                                                           capsys):
    """``onnxtrain import-ort`` then ``onnxtrain train ... -o``: the inference
    model takes the input alone and returns the model's output;
    ``onnxtrain export --outputs`` cuts where asked."""
    import onnx
    import onnxruntime

    imported = tmp_path / "imported.onnx"
    assert main(["import-ort", str(data_dir / "adamw"), "-o", str(imported)]) == 0
    np.savez(tmp_path / "d.npz", input=ort_runs["x"].reshape(-1, 12), labels=ort_runs["labels"].reshape(-1))
    out, ck = tmp_path / "out.onnx", tmp_path / "ck.onnx"
    assert main(["train", str(imported), "--data", str(tmp_path / "d.npz"), "--epochs", "1", "--batch-size", "5",
                 "-o", str(out), "--checkpoint", str(ck), "--no-progress"]) == 0
    model = onnx.load(out)
    assert [i.name for i in model.graph.input] == ["input"] and [o.name for o in model.graph.output] == ["output"]
    x = ort_runs["x"][2]
    (got,) = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"input": x})
    np.testing.assert_allclose(got, _mlp_forward(TrainingSession(str(ck)).state, x), rtol=1e-5, atol=1e-6)
    capsys.readouterr()
    cut = tmp_path / "cut.onnx"
    assert main(["export", str(ck), "-o", str(cut), "--outputs", "output,onnx::loss::2"]) == 0
    model = onnx.load(cut)
    assert [o.name for o in model.graph.output] == ["output", "onnx::loss::2"]
    assert [i.name for i in model.graph.input] == ["input", "labels"]
    for argv, message in ((["--outputs", "nope"], "'nope' is not a value"),
                          (["--outputs", "output", "--training"], "--outputs cuts the inference model"),
                          (["--outputs", ","], "expected output names")):
        assert main(["export", str(ck), "-o", str(tmp_path / "bad.onnx"), *argv]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "bad.onnx").exists()


def test_an_imported_batch_norm_model_updates_its_running_statistics(tmp_path):
    """Training-mode BatchNormalization in the artifacts: each step of the
    imported model updates the running mean and variance by ONNX's rule
    (state variables of the model, written to its checkpoint)."""
    from test_api_ort_behaviours import MOMENTUM, STATS, WEIGHTS, bn_model

    artifacts.generate_artifacts(bn_model(), requires_grad=WEIGHTS, loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    sess = TrainingSession(import_ort(tmp_path))
    assert set(STATS) <= set(sess.state)
    x = np.random.default_rng(3).standard_normal((8, 6)).astype(np.float32)
    before = {n: np.array(sess.state[n], np.float64) for n in [*WEIGHTS, *STATS]}
    sess.train_step({"input": x, "labels": np.arange(8) % 3})
    h = x @ before["fc1.weight"] + before["fc1.bias"]
    np.testing.assert_allclose(sess.state["bn.running_mean"],
                               MOMENTUM * before["bn.running_mean"] + (1 - MOMENTUM) * h.mean(0), rtol=1e-5)
    np.testing.assert_allclose(sess.state["bn.running_var"],
                               MOMENTUM * before["bn.running_var"] + (1 - MOMENTUM) * h.var(0), rtol=1e-5)
