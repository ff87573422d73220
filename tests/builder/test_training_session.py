"""build.training_session: the built model from the startup cache, its weights
held in files without passing through a protobuf (``builder.cache.held_attached``).

The session trains, resets and exports exactly as ``TrainingSession`` of
``build.training_model`` does; its model holds no weight's data; a weight and
its starting value are written once; the files go with the session.
"""

from __future__ import annotations

import gc
import inspect
import os

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from test_build import mlp
from test_build_cache import private_cache  # noqa: F401  (autouse: a startup cache of the test's own)

from onnxtrain import TrainingSession, build
from onnxtrain.builder import cache as built_cache
from onnxtrain.core import diskcache
from onnxtrain.core.protos import all_tensors
from onnxtrain.io import mapped, storage

SIZES = (1024, 512, 64)  # W1: 2 MiB, held (storage.HOLD_FROM); W2: 128 KiB, put back; the rest inline
OPTIONS = dict(loss="cross_entropy", target="label", optimizer=build.AdamW(lr=1e-2, weight_decay=0.01))


def feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"X": rng.standard_normal((16, SIZES[0])).astype(np.float32), "label": rng.integers(0, SIZES[2], 16)}


def trained(sess: TrainingSession) -> tuple[list[float], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Three steps' losses, the state after them, and after ``initialize()``."""
    losses = [float(sess.train_step(feeds())["loss"]) for _ in range(3)]
    after = {k: np.array(v) for k, v in sess.state.items()}
    sess.initialize()
    return losses, after, {k: np.array(v) for k, v in sess.state.items()}


def session_hit(**options) -> TrainingSession:
    """``build.training_session`` on a model the cache has (the first call builds and stores it)."""
    build.training_session(mlp(SIZES), **OPTIONS, **options)
    diskcache.flush()
    hits = diskcache.stats["built.hit"]
    sess = build.training_session(mlp(SIZES), **OPTIONS, **options)
    assert diskcache.stats["built.hit"] == hits + 1
    return sess


@pytest.mark.parametrize("trainable", [None, ["b1", "W2", "b2"]])  # W1 trained, or frozen
def test_a_session_from_a_hit_trains_resets_and_exports_as_the_two_calls(tmp_path, trainable):
    reference = TrainingSession(build.training_model(mlp(SIZES), **OPTIONS, trainable=trainable))
    expected = trained(reference)
    sess = session_hit(trainable=trainable)
    model = sess.model
    assert not [t.name for t in model.graph.initializer if t.HasField("raw_data") and len(t.raw_data) >= 1 << 20]
    got = trained(sess)
    assert got[0] == expected[0]
    for want, have in zip(expected[1:], got[1:]):
        assert sorted(want) == sorted(have)
        for k in want:
            np.testing.assert_array_equal(want[k], have[k], err_msg=k)
    sess.train_step(feeds())
    sess.export(tmp_path / "trained.onnx")
    reference.train_step(feeds())
    reference.export(tmp_path / "reference.onnx")
    a, b = (onnx.load(tmp_path / f) for f in ("trained.onnx", "reference.onnx"))
    assert [numpy_helper.to_array(t).tobytes() for t in a.graph.initializer] == \
        [numpy_helper.to_array(t).tobytes() for t in b.graph.initializer]


def test_a_weight_and_its_starting_value_are_written_once_and_go_with_the_session():
    sess = session_hit()
    held = [t for t in onnx.ModelProto.FromString(sess.model.SerializeToString()).graph.initializer
            if mapped.is_mapped(t)]
    assert [t.name for t in held] == ["W1"]
    path = mapped.source(held[0])[0]
    init = sess.model.training_info[0].initialization  # (starting values: Constant nodes)
    starting = [a.t for n in init.node for a in n.attribute if a.type == onnx.AttributeProto.TENSOR
                and mapped.is_mapped(a.t)]
    assert len(starting) == 1 and mapped.source(starting[0]) == mapped.source(held[0])  # written once
    assert os.path.getsize(path) < 2 * (1 << 21)  # W1 (2 MiB) once, not twice
    del sess, held, starting
    gc.collect()
    assert not os.path.exists(path)


def test_hold_writes_given_data_once_and_compares_nothing(monkeypatch):
    def compared(*a):
        raise AssertionError("the same bytes were compared with what the file holds")
    monkeypatch.setattr(storage._HeldFile, "_holds", compared)
    w = numpy_helper.from_array(np.arange(1 << 18, dtype=np.float32), "w")  # 1 MiB
    model = mlp(SIZES)
    for name in ("w", "v"):
        t = model.graph.initializer.add()
        t.CopyFrom(w)
        t.name = name
        t.ClearField("raw_data")
    blob = w.raw_data
    given = {id(t): (t, blob) for t in model.graph.initializer if t.name in ("w", "v")}
    out = storage.hold(model, {"w", "v"}, given)
    held = {t.name: t for t in out.graph.initializer if mapped.is_mapped(t)}
    assert sorted(held) == ["W1", "v", "w"]
    assert mapped.source(held["w"])[1:] == mapped.source(held["v"])[1:]  # the same bytes, at one place
    np.testing.assert_array_equal(mapped.array(held["v"]), np.arange(1 << 18, dtype=np.float32))


def test_hold_in_place_is_hold_without_the_copy_even_where_a_write_fails(monkeypatch):
    """``hold(in_place=True)`` (a cache hit's own model) changes the model
    itself into what the copy would be.  Where a write fails (a small
    /dev/shm), what it wrote goes and the model is held on disk as a whole:
    bug caught, had the tensors moved as they were written, those written
    before the failure pointed into the removed file."""
    def with_constant():
        model = mlp(SIZES)
        model.graph.node.insert(0, onnx.helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(
            np.ones(1 << 18, np.float32), "c")))  # (a tensor attribute, held too)
        return model

    copied = storage.hold(with_constant(), {"W1"})
    model = with_constant()
    assert storage.hold(model, {"W1"}, in_place=True) is model
    def where(m):
        return [(t.name, t.data_location, mapped.is_mapped(t), t.raw_data) for t in all_tensors(m)]
    assert where(model) == where(copied)
    for a, b in zip(all_tensors(model), all_tensors(copied)):
        if mapped.is_mapped(a):
            np.testing.assert_array_equal(mapped.array(a), mapped.array(b))
    put, calls = storage._HeldFile.put, []

    def full_at_the_second(self, t, given=None):
        calls.append(self.path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return put(self, t, given)
    monkeypatch.setattr(storage._HeldFile, "put", full_at_the_second)
    model = with_constant()
    assert storage.hold(model, set(), in_place=True) is model and len(calls) == 4
    held = [t for t in all_tensors(model) if mapped.is_mapped(t)]
    assert len(held) == 2 and {mapped.source(t)[0] for t in held} == {calls[-1]}  # (the second try's file)
    assert not os.path.exists(calls[0])
    for t, ref in zip(held, [t for t in all_tensors(with_constant()) if storage.holds(t)]):
        np.testing.assert_array_equal(mapped.array(t), numpy_helper.to_array(ref))


def test_a_damaged_entry_is_rebuilt_on_the_held_path_too():
    build.training_session(mlp(SIZES), **OPTIONS)
    diskcache.flush()
    bound = inspect.signature(build.training_model).bind(mlp(SIZES), **OPTIONS)
    bound.apply_defaults()  # (the options in the order training_model hands them over)
    key = built_cache.BuiltModels(mlp(SIZES), None, dict(list(bound.arguments.items())[1:])).key
    meta, payload = diskcache.read(built_cache.KIND, key)
    meta["detached"] = [[i + 1000, d] for i, d in meta["detached"]]
    diskcache.write_now(built_cache.KIND, key, meta, payload)
    sess = build.training_session(mlp(SIZES), **OPTIONS)
    assert diskcache.stats["built.corrupt"] == 1 and diskcache.stats["built.miss"] == 2
    expected = trained(TrainingSession(build.training_model(mlp(SIZES), **OPTIONS)))
    assert trained(sess)[0] == expected[0]


def test_the_options_and_the_session_arguments_are_checked():
    with pytest.raises(TypeError, match="optimiser"):
        build.training_session(mlp(SIZES), optimiser=build.SGD(lr=0.1))
    with pytest.raises(ValueError, match="memory"):
        build.training_session(mlp(SIZES), **OPTIONS, session={"memory": "tiny"})
    lean = build.training_session(mlp(SIZES), **OPTIONS, session={"memory": "lean"})
    assert np.isfinite(lean.train_step(feeds())["loss"])


def test_weights_mapped_from_the_source_file_are_held_from_their_map(tmp_path):
    path = str(tmp_path / "m.onnx")
    onnx.save(mlp(SIZES), path, save_as_external_data=True, size_threshold=1024, location="m.data")
    expected = trained(TrainingSession(build.training_model(path, **OPTIONS)))
    diskcache.flush()
    hits = diskcache.stats["built.hit"]
    sess = build.training_session(path, **OPTIONS)
    assert diskcache.stats["built.hit"] == hits + 1
    assert mapped.source(next(t for t in sess.model.graph.initializer if t.name == "W1"))[0] != str(tmp_path / "m.data")
    got = trained(sess)
    assert got[0] == expected[0]
    np.testing.assert_array_equal(got[2]["W1"], expected[2]["W1"])


def test_the_session_takes_the_builders_model_without_checking_it_again(monkeypatch):
    """The hostile-file checks (strings, tensor sizes) ran on the inference
    model, or on the model an entry was stored from; ``Checked`` says so."""
    from onnxtrain.io import loading

    build.training_session(mlp(SIZES), **OPTIONS)
    diskcache.flush()  # (stored)

    def checked_again(*a, **k):
        raise AssertionError("the builder's model was checked again")
    monkeypatch.setattr(loading, "check_strings", checked_again)
    monkeypatch.setattr(loading, "check_tensors", checked_again)
    sess = build.training_session(mlp(SIZES), **OPTIONS)
    assert np.isfinite(sess.train_step(feeds())["loss"])
    with pytest.raises(AssertionError, match="checked again"):
        TrainingSession(sess.model)  # (any other ModelProto is)


def test_options_a_key_cannot_describe_fault_nothing_ahead(monkeypatch):
    """A callable option (here ``trainable``) has no description that a later
    process would find again: no first run is looked up or recorded for it."""
    from onnxtrain.runtime import firstrun

    seen = []
    real = build.expected
    monkeypatch.setattr(build, "expected", lambda model, described, on: seen.append(on) or real(model, described, on))
    build.training_session(mlp(SIZES), **OPTIONS, trainable=lambda name: True)
    build.training_session(mlp(SIZES), **OPTIONS)
    assert seen == [False, firstrun.wanted(None, None, False)]
