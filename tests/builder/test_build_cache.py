"""``build.training_model``'s answers in the startup cache (onnxtrain.builder.cache).

A hit must be the model a build gives, bit for bit, with the data of the
model given now; anything the build reads (the weights' values, every
option, the path, the builder's tables, a mapped weight's file) changes
the key; what no key can cover (a callable option, an optimizer defined
elsewhere), a model the builder leaves mapped, one ``load`` refuses and a
build that warned are not stored; a damaged entry is rebuilt."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from test_build import mlp

from onnxtrain import TrainingSession, build
from onnxtrain.builder import builder as builder_module
from onnxtrain.builder import cache as built_cache
from onnxtrain.core import diskcache

DATA = Path(__file__).resolve().parents[1] / "data"
SIZES = (128, 256, 3)  # W1 is 128 KiB: kept by reference


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    diskcache.flush()
    monkeypatch.setenv("ONNXTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(diskcache.ENV, "1")
    diskcache.stats.clear()
    yield
    diskcache.flush()


def built(model, **options) -> onnx.ModelProto:
    options.setdefault("loss", "cross_entropy")
    options.setdefault("optimizer", build.AdamW(lr=1e-3, weight_decay=0.01))
    out = build.training_model(model, **options)
    diskcache.flush()  # the entry is written
    return out


def uncached(model, monkeypatch, **options) -> onnx.ModelProto:
    with monkeypatch.context() as m:
        m.setenv(diskcache.ENV, "0")
        return built(model, **options)


def entries() -> list[Path]:
    return sorted((diskcache.directory()).glob(f"{built_cache.KIND}-*"))


def refuse_to_build(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the builder ran")
    monkeypatch.setattr(builder_module, "_plan", fail)


def test_a_hit_is_the_build_bit_for_bit_and_runs_no_builder(monkeypatch):
    model = mlp(SIZES)
    first = built(model)
    assert diskcache.stats["built.miss"] == 1 and len(entries()) == 1
    # the entry holds the graph, not the weights (W1 is there twice: initializer and initial value)
    assert entries()[0].stat().st_size < 128 << 10
    refuse_to_build(monkeypatch)
    second = built(model)
    assert diskcache.stats["built.hit"] == 1
    assert second.SerializeToString() == first.SerializeToString()


def test_the_hit_matches_an_uncached_build_and_trains_the_same(monkeypatch):
    reference = uncached(mlp(SIZES), monkeypatch)
    built(mlp(SIZES))
    hit = built(mlp(SIZES))
    assert diskcache.stats["built.hit"] == 1
    assert hit.SerializeToString() == reference.SerializeToString()
    rng = np.random.default_rng(0)
    feeds = {"X": rng.standard_normal((8, SIZES[0])).astype(np.float32),
             "target": rng.integers(0, 3, 8).astype(np.int64)}
    losses = []
    for m in (reference, hit):
        sess = TrainingSession(m)
        losses.append([float(sess.train_step(feeds)["loss"]) for _ in range(3)])
    assert losses[0] == losses[1]


def with_w1(model, value) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.initializer[0].CopyFrom(numpy_helper.from_array(value, "W1"))
    return out


def test_other_weights_are_another_key_and_their_data_is_used():
    model = mlp(SIZES)
    built(model)
    assert model.graph.initializer[0].name == "W1"
    w1 = numpy_helper.to_array(model.graph.initializer[0]) * 2  # only the large weight differs
    out = built(with_w1(model, w1))
    assert diskcache.stats["built.miss"] == 2 and not diskcache.stats["built.hit"]
    assert not diskcache.stats["built.corrupt"]  # another key, not a near miss
    got = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}["W1"]
    np.testing.assert_array_equal(got, w1)
    # and a hit of that key puts back the data of the model given now
    assert built(with_w1(model, w1)).SerializeToString() == out.SerializeToString()
    assert diskcache.stats["built.hit"] == 1


def test_a_small_weight_is_in_the_key_too():
    model = mlp(SIZES)
    built(model)
    b2 = model.graph.initializer[3]
    assert b2.name == "b2"
    b2.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(b2) + 1, "b2"))
    out = built(model)
    assert diskcache.stats["built.miss"] == 2
    assert np.array_equal(numpy_helper.to_array(out.graph.initializer[3]), numpy_helper.to_array(b2))


@pytest.mark.parametrize("change", [
    {"optimizer": build.AdamW(lr=2e-3, weight_decay=0.01)},
    {"optimizer": build.Adam(lr=1e-3, weight_decay=0.01)},
    {"loss": build.CrossEntropy(label_smoothing=0.1)},
    {"trainable": ["W1", "b1"]},
    {"clip_grad_norm": 1.0},
    {"schedule": build.cosine(total_steps=10)},
    {"accumulate": 2},
    {"target": "labels"},
])
def test_every_option_is_in_the_key(change):
    base = built(mlp(SIZES))
    out = built(mlp(SIZES), **change)
    assert diskcache.stats["built.miss"] == 2
    assert out.SerializeToString() != base.SerializeToString()
    assert built(mlp(SIZES), **change).SerializeToString() == out.SerializeToString()
    assert diskcache.stats["built.hit"] == 1


def test_equal_options_are_one_key():
    built(mlp(SIZES), optimizer=build.SGD(lr=0.1, momentum=0.9), trainable=["W1", "W2"])
    built(mlp(SIZES), optimizer=build.SGD(lr=0.1, momentum=0.9), trainable=("W1", "W2"))
    built(mlp(SIZES), optimizer=build.SGD(lr=0.1, momentum=0.9), trainable=["W1", "W2"])
    assert diskcache.stats["built.hit"] == 1  # a tuple is not a list: two keys, one hit


def test_callable_options_are_not_cached():
    out = built(mlp(SIZES), trainable=lambda name: name.startswith("W"))
    again = built(mlp(SIZES), trainable=lambda name: name.startswith("b"))
    assert not entries() and diskcache.stats["built.uncacheable"] == 2
    assert [b.key for b in out.training_info[0].update_binding] != \
        [b.key for b in again.training_info[0].update_binding]


def test_an_optimizer_defined_outside_onnxtrain_is_not_cached():
    class Slower(build.SGD):
        pass

    built(mlp(SIZES), optimizer=Slower(lr=0.1))
    assert not entries() and diskcache.stats["built.uncacheable"] == 1


def test_a_changed_builder_table_is_another_key(monkeypatch):
    first = built(mlp(SIZES))
    monkeypatch.setattr(builder_module, "IR_VERSION", 11)
    second = built(mlp(SIZES))
    assert diskcache.stats["built.miss"] == 2
    assert (first.ir_version, second.ir_version) == (10, 11)


def test_the_path_is_in_the_key(tmp_path):
    model = mlp(SIZES)
    for name in ("a.onnx", "b.onnx"):
        onnx.save(model, tmp_path / name)
    a = built(str(tmp_path / "a.onnx"))
    b = built(tmp_path / "b.onnx")
    assert diskcache.stats["built.miss"] == 2
    source = {p.key: p.value for p in b.metadata_props}["onnxtrain.source"]
    assert json.loads(source) == str(tmp_path / "b.onnx")
    assert built(str(tmp_path / "a.onnx")).SerializeToString() == a.SerializeToString()
    assert diskcache.stats["built.hit"] == 1


def test_mapped_weights_are_hashed_from_their_file_and_copied_back(tmp_path, monkeypatch):
    """W1 of 1 MiB stays in its file (io.mapped) until the build copies it in."""
    onnx.save(mlp((1024, 256, 3)), tmp_path / "m.onnx", save_as_external_data=True, size_threshold=1024,
              location="m.data")  # (saving makes the model given external: a fresh one each time)
    reference = uncached(str(tmp_path / "m.onnx"), monkeypatch)
    first = built(str(tmp_path / "m.onnx"))
    assert entries()[0].stat().st_size < 1 << 20
    hit = built(str(tmp_path / "m.onnx"))
    assert diskcache.stats["built.hit"] == 1
    assert hit.SerializeToString() == first.SerializeToString() == reference.SerializeToString()
    # the same file, the same ranges, other data: another key, and the new data
    w1 = numpy_helper.to_array(mlp((1024, 256, 3)).graph.initializer[0]) * 2
    (tmp_path / "m.data").unlink()  # (onnx.save appends to a data file that exists)
    onnx.save(with_w1(mlp((1024, 256, 3)), w1), tmp_path / "m.onnx", save_as_external_data=True, size_threshold=1024,
              location="m.data")
    out = built(str(tmp_path / "m.onnx"))
    assert diskcache.stats["built.hit"] == 1 and not diskcache.stats["built.corrupt"]
    got = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}["W1"]
    np.testing.assert_array_equal(got, w1)


def test_models_the_builder_leaves_mapped_are_not_cached(tmp_path, monkeypatch):
    from onnxtrain.io import storage

    monkeypatch.setattr(storage, "SPILL_FROM", 1 << 20)  # W1 alone is that much
    onnx.save(mlp((1024, 256, 3)), tmp_path / "m.onnx", save_as_external_data=True, size_threshold=1024)
    built(str(tmp_path / "m.onnx"))
    assert not entries() and diskcache.stats["built.uncacheable"] == 1


def test_a_build_that_warned_is_not_stored_and_warns_again(monkeypatch):
    from onnxtrain.builder import folding

    calls = []
    monkeypatch.setattr(folding, "batchnorm_hint", lambda m: calls.append(1) or "hint: a doubt")
    for _ in range(2):
        with pytest.warns(folding.FoldedBatchNormWarning, match="a doubt"):
            built(mlp(SIZES))
    assert len(calls) == 2 and not entries()


def test_the_builders_warnings_point_at_the_caller_with_the_cache_on():
    case = next(c for c in json.loads((DATA / "folding" / "manifest.json").read_text())["cases"]
                if c["folded"])
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build.training_model(str(DATA / "folding" / case["file"]), loss="cross_entropy")
        diskcache.flush()
        assert [w.filename for w in caught if "folded" in str(w.message)] == [__file__]
    assert not entries()


@pytest.mark.parametrize("damage", ["beyond the model", "onto a tensor with data"])
def test_a_damaged_entry_is_rebuilt(damage):
    model = mlp(SIZES)
    first = built(model)
    key = key_of(model)
    meta, payload = diskcache.read(built_cache.KIND, key)
    # a verified entry (the store's checks pass) whose places are not the model's
    taken = {i for i, _ in meta["detached"]}
    if damage == "beyond the model":
        meta["detached"] = [[i + 1000, d] for i, d in meta["detached"]]
    else:
        meta["detached"][0][0] = next(i for i in range(len(taken) + 1) if i not in taken)
    diskcache.write_now(built_cache.KIND, key, meta, payload)
    again = built(model)
    assert diskcache.stats["built.corrupt"] == 1 and diskcache.stats["built.miss"] == 2
    assert again.SerializeToString() == first.SerializeToString()
    assert built(model).SerializeToString() == first.SerializeToString()
    assert diskcache.stats["built.hit"] == 1


def key_of(model) -> bytes:
    """The key ``built`` uses (the options as training_model hands them over)."""
    options = dict(loss="cross_entropy", target="target", output=None,
                   optimizer=build.AdamW(lr=1e-3, weight_decay=0.01), trainable=None, schedule=None,
                   clip_grad_norm=None, accumulate=1, train_mode=True, batchnorm_var="auto",
                   lora=None, recompute=None)
    return built_cache.BuiltModels(model, None, options).key


def test_the_cache_off_reads_and_writes_nothing(monkeypatch):
    monkeypatch.setenv(diskcache.ENV, "0")
    built(mlp(SIZES))
    built(mlp(SIZES))
    assert not entries() and not diskcache.stats


def test_describe_option():
    d = built_cache.describe_option
    assert d(build.AdamW(lr=1e-3)) != d(build.Adam(lr=1e-3))
    assert d(build.LoRA(rank=4, targets=["W1"])) is not None
    assert d(build.LoRA(rank=4, targets=lambda n: True)) is None
    assert d(np.ones(3, np.float32)) != d(np.ones(3, np.float64))
    assert d(1) != d(1.0) != d(True)
    assert d(object()) is None and d(print) is None


def test_a_model_load_refuses_is_refused_at_every_call():
    """A ModelProto is hashed before ``load`` checks it: nothing is stored
    for one that fails, so the check runs again."""
    from onnxtrain.errors import TrainingModelError

    model = mlp(SIZES)
    w1 = model.graph.initializer[0]
    w1.raw_data = w1.raw_data[:-4]  # one float short of its dims
    for _ in range(2):
        with pytest.raises(TrainingModelError, match="W1"):
            built(model)
    assert not entries() and diskcache.stats["built.miss"] == 2
