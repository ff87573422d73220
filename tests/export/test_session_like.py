"""Every way out takes one ``SessionLike`` (``model``, ``state``, ``fit_position``):
the ONNX export (inference and checkpoint), the adapter files and the
requantized QLoRA export, as the bundle does; ``TrainingSession`` is one and
delegates to them.

Oracles: the session's own ``to_model``/``export`` (bit for bit), and a
``SessionLike`` that is not a session, holding the same values."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession, build, genai
from onnxtrain.build import lora
from onnxtrain.export import SessionLike
from onnxtrain.export import model as model_export


@dataclass
class Frozen:
    """A SessionLike that is not a session."""

    model: onnx.ModelProto
    state: Mapping[str, np.ndarray]
    fit_position: dict[str, Any] | None = None


class Recording(Mapping):
    """A state mapping that records which values were read (and when)."""

    def __init__(self, values: Mapping[str, np.ndarray]) -> None:
        self.values, self.read = dict(values), []

    def __getitem__(self, name: str) -> np.ndarray:
        self.read.append(name)
        return self.values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def __contains__(self, name: object) -> bool:
        return name in self.values


def _inference(n_in=4, n_out=3, seed=0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["H"]), helper.make_node("Add", ["H", "b"], ["Y"])], "m",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", n_in])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", n_out])],
        [numpy_helper.from_array(rng.standard_normal((n_in, n_out)).astype(np.float32), "W"),
         numpy_helper.from_array(np.zeros(n_out, np.float32), "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _batch(seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"X": rng.standard_normal((8, 4)).astype(np.float32),
            "T": rng.standard_normal((8, 3)).astype(np.float32)}


def _trained(**kw) -> TrainingSession:
    sess = TrainingSession(build.training_model(_inference(), loss="mse", target="T",
                                                optimizer=build.AdamW(lr=0.05), **kw))
    for step in range(3):
        sess.train_step(_batch(step))
    sess.fit_position = {"epoch": 1, "batch": 0, "step": 3, "source": "fit"}
    return sess


def _frozen(sess: TrainingSession) -> Frozen:
    return Frozen(sess.model, dict(sess.state), dict(sess.fit_position or {}) or None)


def test_a_session_and_a_frozen_copy_are_session_like():
    sess = _trained()
    assert isinstance(sess, SessionLike) and isinstance(_frozen(sess), SessionLike)
    assert not isinstance(sess.model, SessionLike) and not isinstance(object(), SessionLike)


@pytest.mark.parametrize("training", [False, True])
def test_the_onnx_export_of_any_session_like_equals_the_sessions(training, tmp_path):
    sess = _trained()
    frozen = _frozen(sess)
    ours = model_export.to_model(frozen, training)
    assert ours.SerializeToString() == sess.to_model(training).SerializeToString()
    a = model_export.write(frozen, tmp_path / "a" / "m.onnx", training)
    b = sess.export(tmp_path / "b" / "m.onnx", training)
    assert a.read_bytes() == b.read_bytes()
    written = onnx.load(str(a))
    w = next(t for t in written.graph.initializer if t.name == "W")
    np.testing.assert_array_equal(numpy_helper.to_array(w), sess.state["W"])
    assert bool(written.training_info) == training
    assert any(p.key == "onnxtrain.checkpoint" for p in written.metadata_props) == training


def test_write_reads_each_state_value_only_while_writing_it(tmp_path, monkeypatch):
    """A written export reads ``source.state`` lazily: no value is read (for a
    session: copied) before the writer starts, so state is never held twice."""
    sess = _trained()
    state = Recording(sess.state)
    real = model_export.write_model
    read_before: list[list[str]] = []

    def writing(*args, **kwargs):
        read_before.append(list(state.read))
        return real(*args, **kwargs)

    monkeypatch.setattr(model_export, "write_model", writing)
    out = model_export.write(Frozen(sess.model, state), tmp_path / "m.onnx", training=True)
    assert read_before == [[]]
    assert sorted(set(state.read)) == sorted(sess.state)
    again = TrainingSession(str(out))
    for name in sess.state:
        np.testing.assert_array_equal(again.state[name], sess.state[name])


def test_adapter_files_of_any_session_like(tmp_path):
    sess = _trained(lora=build.LoRA(rank=2, alpha=4))
    frozen = _frozen(sess)
    a = lora.save_adapters(frozen, tmp_path / "a.npz")
    b = lora.save_adapters(sess, tmp_path / "b.npz")
    (desc_a, arrays_a), (desc_b, arrays_b) = lora.load_adapters(a), lora.load_adapters(b)
    assert desc_a == desc_b and sorted(arrays_a) == sorted(arrays_b)
    for name, value in arrays_a.items():
        np.testing.assert_array_equal(value, arrays_b[name])
        np.testing.assert_array_equal(value, sess.state[name])
    # a model (not a SessionLike) gives its initializers: the adapters it was built with
    built = lora.load_adapters(lora.save_adapters(sess.model, tmp_path / "c.npz"))[1]
    assert any(not np.array_equal(built[n], arrays_a[n]) for n in built)
    merged = {t.name: numpy_helper.to_array(t) for t in lora.apply_adapters(_inference(), a).graph.initializer}
    exported = {t.name: numpy_helper.to_array(t) for t in sess.to_model().graph.initializer}
    np.testing.assert_array_equal(merged["W"], exported["W"])


def test_a_non_session_like_is_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match="SessionLike"):
        genai.export(object(), tmp_path / "g", base=tmp_path)
    with pytest.raises(TypeError, match="SessionLike"):
        genai.export(Frozen, tmp_path / "g", base=tmp_path)  # the class, not an object with values
