"""ODTC checkpoints: ORT 1.19.2's files read, ours written in the same format."""

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from ort_data import PARAMS

from onnxtrain.ort_training import checkpoint as ckpt


def _mlp_weights(data_dir):
    m = onnx.load(data_dir / "mlp.onnx")
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}


def test_reads_ort_checkpoint_values_and_split(data_dir):
    ck = ckpt.load(data_dir / "adamw" / "checkpoint")
    w = _mlp_weights(data_dir)
    assert ck.version == 2 and not ck.nominal
    assert list(ck.trainable) == ["fc1.weight", "fc2.weight", "fc2.bias"]
    assert list(ck.frozen) == ["fc1.bias"]
    for name in PARAMS:
        arr = ck.trainable.get(name, ck.frozen.get(name))
        np.testing.assert_array_equal(arr, w[name])
        assert arr.dtype == np.float32
    assert ck.optimizer_groups == [] and ck.properties == {}


def test_reads_ort_optimizer_state_and_properties(data_dir, ort_runs):
    ck = ckpt.load(data_dir / "adamw" / "checkpoint_step3")
    assert ck.properties == {"epoch": 3, "best_loss": 0.25, "tag": "mlp"}
    (group,) = ck.optimizer_groups
    assert group.name == "group0" and group.step == 3
    assert group.initial_learning_rate == pytest.approx(0.001)
    assert sorted(group.states) == ["fc1.weight", "fc2.bias", "fc2.weight"]
    assert sorted(group.states["fc1.weight"]) == ["momentum0", "momentum1"]
    assert group.states["fc2.weight"]["momentum1"].shape == (5, 16)
    assert (group.states["fc2.weight"]["momentum1"] > 0).all()  # v = sum of squares
    # parameters after 3 steps, as ORT recorded them
    np.testing.assert_array_equal(ck.trainable["fc1.weight"], ort_runs["adamw_fc1.weight"][2])


def test_reads_ort_nominal_checkpoint(data_dir):
    ck = ckpt.load(data_dir / "adamw" / "nominal_checkpoint")
    assert ck.nominal
    assert list(ck.trainable) == ["fc1.weight", "fc2.weight", "fc2.bias"]
    assert list(ck.frozen) == ["fc1.bias"]


def test_round_trip_keeps_everything(data_dir, tmp_path):
    ck = ckpt.load(data_dir / "adamw" / "checkpoint_step3")
    path = tmp_path / "again"
    ckpt.save(ck, path)
    back = ckpt.load(path)
    assert back.properties == ck.properties and back.version == ck.version
    for a, b in ((ck.trainable, back.trainable), (ck.frozen, back.frozen)):
        assert list(a) == list(b)
        for n in a:
            np.testing.assert_array_equal(a[n], b[n])
    g0, g1 = ck.optimizer_groups[0], back.optimizer_groups[0]
    assert (g0.name, g0.step, g0.initial_learning_rate) == (g1.name, g1.step, g1.initial_learning_rate)
    for p in g0.states:
        for k in g0.states[p]:
            np.testing.assert_array_equal(g0.states[p][k], g1.states[p][k])
    assert path.read_bytes()[4:8] == b"ODTC"


def test_dtypes_and_shapes_round_trip():
    arrays = {"f64": np.arange(6, dtype=np.float64).reshape(2, 3), "i64": np.array([-1, 2**40]),
              "f16": np.ones((1, 2, 2), np.float16), "scalar": np.array(3.5, np.float32)}
    back = ckpt.loads(ckpt.dumps(ckpt.Checkpoint(trainable=arrays)))
    for n, a in arrays.items():
        assert back.trainable[n].dtype == a.dtype and back.trainable[n].shape == a.shape
        np.testing.assert_array_equal(back.trainable[n], a)


def test_properties_types():
    ck = ckpt.Checkpoint(properties={"i": -5, "f": 0.5, "s": "ü"})
    assert ckpt.loads(ckpt.dumps(ck)).properties == {"i": -5, "f": 0.5, "s": "ü"}
    with pytest.raises(TypeError, match="bool"):
        ckpt.dumps(ckpt.Checkpoint(properties={"b": True}))
    with pytest.raises(TypeError, match="list"):
        ckpt.dumps(ckpt.Checkpoint(properties={"l": [1]}))


def test_bad_files_are_clear_errors(tmp_path, data_dir):
    with pytest.raises(ckpt.CheckpointError, match="ODTC"):
        ckpt.loads(b"not a checkpoint at all")
    good = (data_dir / "adamw" / "checkpoint").read_bytes()
    with pytest.raises(ckpt.CheckpointError):
        ckpt.loads(good[: len(good) // 2])
    with pytest.raises(FileNotFoundError):
        ckpt.load(tmp_path / "missing")


def test_a_complete_checkpoint_with_a_tensor_without_data_is_refused(tmp_path, monkeypatch):
    """Only a nominal checkpoint may hold tensors without data (their shapes);
    in a complete one, a tensor of shape [2, 3] with no bytes is a broken file,
    never zeros.

    Bug caught: ``nominal and`` dropped from the empty-data test of
    ``_read_tensor``: the broken tensor read back silently as zeros."""
    real = ckpt._write_tensor
    # write "w" as a nominal tensor (shape, no data) in a checkpoint that says it is complete
    monkeypatch.setattr(ckpt, "_write_tensor",
                        lambda fb, b, name, arr, nominal: real(fb, b, name, arr, nominal or name == "w"))
    arrays = {"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32)}
    complete = ckpt.dumps(ckpt.Checkpoint(trainable=arrays))
    nominal = ckpt.dumps(ckpt.Checkpoint(trainable=arrays, nominal=True))
    monkeypatch.undo()
    with pytest.raises(ckpt.CheckpointError, match=r"'w': 0 bytes of data for shape \[2, 3\]"):
        ckpt.loads(complete)
    (tmp_path / "broken").write_bytes(complete)
    from onnxtrain.ort_training.api import CheckpointState

    with pytest.raises(ckpt.CheckpointError, match="'w'"):
        CheckpointState.load_checkpoint(tmp_path / "broken")
    # the nominal checkpoint keeps its shapes, and says it is nominal
    back = ckpt.loads(nominal)
    assert back.nominal and back.trainable["w"].shape == (2, 3)
