"""The startup caches (onnxtrain.core.diskcache and its clients): shape inference, lowered programs
with their fused-kernel rewrite, and onnxruntime's optimized models.

Each test gets a private cache directory.  A cached start must give exactly
the results of an uncached one; an entry that is corrupt, truncated, of
another key or refused by onnxruntime is ignored and rebuilt; what a program
depends on (the model's structure, onnxtrain's code and runtime state, the
session options) changes its key, and what it does not (state values) does
not."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from models import linear_regression, mlp_classifier
from onnx import helper, numpy_helper
from test_build import blobs, mlp

from onnxtrain import TrainingSession, build
from onnxtrain.core import diskcache as cache
from onnxtrain.core.fingerprint import standard_domains
from onnxtrain.core.graph import infer_types
from onnxtrain.errors import TrainingModelError
from onnxtrain.io import mapped
from onnxtrain.kernels import fuse
from onnxtrain.lower import program_cache
from onnxtrain.runtime import ortcache
from onnxtrain.runtime.executor import default_session_options

GENAI = Path(__file__).resolve().parent.parent / "data" / "genai"


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """A cache of our own, on, with fresh counters; deferred work runs at once."""
    cache.flush()
    monkeypatch.setenv("ONNXTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(cache.ENV, "1")
    monkeypatch.setattr(ortcache, "ORT_DELAY", 0.0)
    monkeypatch.setattr(ortcache, "ORT_MAX_MADE", 10_000)
    cache.stats.clear()
    yield tmp_path / "cache" / "startup"
    cache.flush()


def built_model():
    """A builder model: AdamW (fused kernels where available), an initialization graph."""
    return build.training_model(mlp(), loss="cross_entropy", target="label",
                                optimizer=build.AdamW(lr=0.05, weight_decay=0.01))


def spec_model():
    """A hand-written spec model: Gradient + the spec's Adam op."""
    return mlp_classifier(optimizer="adam")


FEEDS = {"X": blobs()[0], "label": blobs()[1]}


def run(model, steps=3, **kwargs):
    """Losses of ``steps`` steps, a digest of the final state, and a prediction."""
    sess = TrainingSession(model, **kwargs)
    losses = [float(sess.train_step(FEEDS)["loss"]) for _ in range(steps)]
    h = hashlib.sha256()
    for k in sorted(sess.state):
        h.update(k.encode())
        h.update(np.ascontiguousarray(sess.state[k]).tobytes())
    pred = sess.run({"X": FEEDS["X"]})
    return losses, h.hexdigest(), {k: v.tobytes() for k, v in pred.items()}


def sessions(model):
    """A session of ``model`` with its two programs built: the algorithm, and
    the inference program (built when ``run`` first needs it)."""
    sess = TrainingSession(model)
    sess.run({"X": FEEDS["X"]})
    return sess


def entries(folder: Path, kind: str) -> list[Path]:
    cache.flush()
    return sorted(folder.glob(f"{kind}-*")) if folder.exists() else []


def counts(*names):
    return {n: cache.stats.get(n, 0) for n in names}


# ------------------------------------------------------------------ hits and equal results
@pytest.mark.parametrize("make", [built_model, spec_model], ids=["builder", "spec"])
def test_cold_warm_and_uncached_starts_agree_bit_for_bit(make, private_cache, monkeypatch):
    monkeypatch.setenv(cache.ENV, "0")
    model = make()
    uncached = run(model)
    assert not private_cache.exists()  # off: nothing written
    monkeypatch.setenv(cache.ENV, "1")
    cold = run(model)
    assert cache.stats.get("program.miss") == 2 and not cache.stats.get("program.hit")
    assert entries(private_cache, "program") and entries(private_cache, "infer")
    assert entries(private_cache, "ort")  # made on the writer thread (flushed above)
    cache.stats.clear()
    warm = run(model)
    assert counts("program.hit", "program.miss", "fused.hit") == {
        "program.hit": 2, "program.miss": 0, "fused.hit": 1}
    assert cache.stats.get("ort.hit", 0) >= 1 and not cache.stats.get("infer.miss")
    assert uncached == cold == warm


def test_a_fresh_session_of_an_equal_model_hits(private_cache):
    run(built_model(), steps=1)
    cache.flush()
    cache.stats.clear()
    model = built_model()  # built again: another object, the same bytes
    sessions(model)
    assert cache.stats.get("program.hit") == 2


def test_disabled_cache_reads_and_writes_nothing(private_cache, monkeypatch):
    run(built_model(), steps=1)
    cache.flush()
    before = sorted(p.name for p in private_cache.iterdir())
    monkeypatch.setenv(cache.ENV, "off")
    cache.stats.clear()
    run(built_model(), steps=1)
    cache.flush()
    assert cache.stats == {}
    assert sorted(p.name for p in private_cache.iterdir()) == before


# ------------------------------------------------------------------ keys
def test_state_values_do_not_change_the_key_but_structure_does(private_cache):
    model = built_model()
    sess = sessions(model)
    sess.train_step(FEEDS)
    checkpoint = sess.to_model(training=True)  # other state values, same structure
    cache.flush()
    cache.stats.clear()
    sessions(checkpoint)
    assert cache.stats.get("program.hit") == 2

    other = onnx.ModelProto()
    other.CopyFrom(model)
    other.graph.node[0].name = "renamed"  # not state: a new key
    cache.stats.clear()
    sessions(other)
    assert cache.stats.get("program.miss") == 2 and not cache.stats.get("program.hit")


def test_a_non_state_initializer_value_changes_the_key(private_cache):
    """Constants of the algorithm (here the spec model's learning rate) are
    part of the program: their values are in the key."""
    model = spec_model()
    lr = next(t for t in model.training_info[0].algorithm.initializer if t.name.startswith("lr"))
    TrainingSession(model)
    other = onnx.ModelProto()
    other.CopyFrom(model)
    for t in other.training_info[0].algorithm.initializer:
        if t.name == lr.name:
            t.CopyFrom(numpy_helper.from_array(np.asarray(0.5, np.float32), lr.name))
    cache.flush()
    cache.stats.clear()
    a, b = run(model, steps=2), run(other, steps=2)
    assert a[0][0] == b[0][0] and a[0][1] != b[0][1]  # the second loss sees the other rate


def test_a_replaced_module_constant_changes_the_key(private_cache, monkeypatch):
    """What lowering reads besides its source (module constants, functions,
    gradient rules) is hashed as it is at the time: a patched value is never
    served a program made with the old one."""
    model = built_model()
    TrainingSession(model)
    cache.flush()
    cache.stats.clear()
    monkeypatch.setattr(fuse, "BATCH_BELOW", 1)
    sessions(model)
    assert cache.stats.get("program.miss") == 2


def test_a_user_gradient_rule_is_part_of_the_key(monkeypatch):
    from onnxtrain.autodiff import registry

    before = program_cache.runtime_digest()
    rules = dict(registry.REGISTRY._rules)
    monkeypatch.setattr(registry.REGISTRY, "_rules", rules)

    @registry.vjp("MyOp", domain="example.test")
    def rule_a(ctx):  # pragma: no cover  (never run)
        return [None]

    with_a = program_cache.runtime_digest()
    del rules[("example.test", "MyOp")]

    @registry.vjp("MyOp", domain="example.test")
    def rule_a(ctx):  # noqa: F811  the same name, other code  # pragma: no cover
        return [ctx]

    with_other = program_cache.runtime_digest()
    assert len({before, with_a, with_other}) == 3


def test_model_errors_still_surface_with_a_warm_cache(private_cache):
    model = spec_model()
    TrainingSession(model)
    bad = onnx.ModelProto()
    bad.CopyFrom(model)
    bad.training_info[0].update_binding[0].value = "no_such_output"
    for _ in range(2):
        with pytest.raises(TrainingModelError, match="no_such_output"):
            TrainingSession(bad)


def test_a_lowering_error_is_never_cached(private_cache):
    model = spec_model()
    algo = model.training_info[0].algorithm
    # An op without a gradient rule on the path to the loss.
    node = next(n for n in algo.node if n.op_type == "SoftmaxCrossEntropyLoss")
    mid = helper.make_node("Mystery", [node.input[0]], ["hm"], name="mystery", domain="example.test")
    node.input[0] = "hm"
    algo.node.insert(0, mid)
    model.opset_import.append(helper.make_opsetid("example.test", 1))
    for _ in range(2):
        with pytest.raises(TrainingModelError, match="Mystery"):
            TrainingSession(model)
        cache.flush()
    # (the op has no onnx schema, so the model is keyed: a miss each time, nothing stored)
    assert not cache.stats.get("program.hit") and not cache.stats.get("program.write")


def test_contrib_models_are_cached_unless_onnx_has_a_schema_for_their_ops(private_cache):
    """An onnxruntime-genai model (com.microsoft ops) means what onnxtrain's
    rules say: its programs are cached.  Once onnx has a schema for one of its
    ops (registered at run time, in no key), it is not."""
    proto = onnx.load(str(GENAI / "llama_int4" / "model.onnx"))

    def session():
        sess = TrainingSession(build.training_model(proto, loss="cross_entropy", output="logits"))
        cache.flush()
        return sess

    first = session().programs()
    assert cache.stats.get("program.miss") and not cache.stats.get("program.hit")
    again = session().programs()
    assert cache.stats.get("program.hit")
    assert {k: m.SerializeToString() for k, m in first.items()} == {
        k: m.SerializeToString() for k, m in again.items()}
    tm = build.training_model(proto, loss="cross_entropy", output="logits")
    assert standard_domains(tm)
    schema = onnx.defs.OpSchema("GroupQueryAttention", "com.microsoft", 1, doc="registered by a test")
    onnx.defs.register_schema(schema)
    try:
        assert not standard_domains(tm)
    finally:
        onnx.defs.deregister_schema("GroupQueryAttention", 1, "com.microsoft")


def test_a_failed_lowering_is_rebuilt_every_time(private_cache, monkeypatch):
    """A model whose algorithm cannot be lowered: the error comes back at
    every construction (the inference program, built on first use, is not
    built)."""
    import onnxtrain.lower.pipeline as passes

    model = spec_model()
    calls = []
    original = passes.expand_gradient_nodes

    def failing(low):
        calls.append(low.label)
        if "algorithm" in low.label:
            raise TrainingModelError("refused for the test")
        original(low)

    def lists(step):
        return {kind: tuple(step if s is original else s for s in steps)
                for kind, steps in passes.PASS_LISTS.items()}

    unpatched = lists(original)
    monkeypatch.setattr(passes, "PASS_LISTS", lists(failing))
    for _ in range(2):
        with pytest.raises(TrainingModelError, match="refused for the test"):
            TrainingSession(model)
        cache.flush()
    assert len([c for c in calls if "algorithm" in c]) == 2
    assert not cache.stats.get("program.hit") and cache.stats.get("program.miss") == 2
    monkeypatch.setattr(passes, "PASS_LISTS", unpatched)
    cache.stats.clear()
    sessions(model)  # the patched pass lists were part of the key: nothing stale
    assert cache.stats.get("program.miss") == 2


# ------------------------------------------------------------------ bad entries
def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(os.urandom(len(data)))


@pytest.mark.parametrize("how", ["flip", "truncate", "empty", "garbage"])
def test_corrupt_entries_are_ignored_and_rebuilt(how, private_cache):
    model = built_model()
    good = run(model)
    for kind in ("program", "infer", "ort"):
        for p in entries(private_cache, kind):
            _corrupt(p, how)
    cache.stats.clear()
    assert run(model) == good
    assert cache.stats.get("program.corrupt", 0) >= 1 and cache.stats.get("program.hit", 0) == 0
    cache.flush()
    cache.stats.clear()
    assert run(model) == good  # rewritten
    assert cache.stats.get("program.hit") == 2


def test_an_entry_of_another_key_is_not_used(private_cache):
    a, b = built_model(), spec_model()
    good_a = run(a)
    run(b)
    progs = entries(private_cache, "program")
    assert len(progs) == 4
    data = {p: p.read_bytes() for p in progs}
    # Every program file now holds another key's (valid) entry.
    for p, q in zip(progs, progs[1:] + progs[:1]):
        p.write_bytes(data[q])
    cache.stats.clear()
    assert run(a) == good_a
    assert cache.stats.get("program.hit", 0) == 0 and cache.stats.get("program.corrupt", 0) >= 1


def test_an_optimized_model_onnxruntime_refuses_is_dropped(private_cache):
    model = spec_model()
    good = run(model)
    ort_entries = entries(private_cache, "ort")
    assert ort_entries
    for p in ort_entries:
        # A well-formed entry (its checksum holds) whose payload is no model.
        raw = p.read_bytes()
        key = raw[len(cache.MAGIC):len(cache.MAGIC) + 32]
        header, _ = cache.read("ort", key)
        p.unlink()
        cache.write_now("ort", key, header, b"not a model")
    cache.stats.clear()
    assert run(model) == good
    assert cache.stats.get("ort.hit", 0) >= 1
    assert all(not p.exists() for p in ort_entries) or entries(private_cache, "ort") != ort_entries


def test_unwritable_cache_directory_is_only_a_miss(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ONNXTRAIN_CACHE_DIR", str(blocker))
    model = built_model()
    assert run(model) == run(model)


def test_eviction_keeps_the_newest_entries(private_cache, monkeypatch):
    monkeypatch.setattr(cache, "MAX_ENTRIES", 4)
    for i in range(12):
        cache.write("infer", hashlib.sha256(str(i).encode()).digest(), {}, b"x")
        cache.flush()
    left = entries(private_cache, "infer")
    assert 0 < len(left) <= 4
    assert cache.entry_path("infer", hashlib.sha256(b"11").digest()) in left


def test_eviction_bounds_every_kind_of_entry(private_cache, monkeypatch):
    """The bound holds for every kind a client stores (the builder's
    ``built`` entries too), counted together; a file that is not an entry
    stays.

    Bug caught: eviction counting only the ``infer``, ``program`` and ``ort``
    kinds, so that built models piled up without bound."""
    monkeypatch.setattr(cache, "MAX_ENTRIES", 4)
    private_cache.mkdir(parents=True)
    other = private_cache / "README"
    other.write_text("not an entry")
    for i in range(12):
        cache.write("built" if i % 3 else "program", hashlib.sha256(str(i).encode()).digest(), {}, b"x")
        cache.flush()
    left = entries(private_cache, "built") + entries(private_cache, "program")
    assert 0 < len(left) <= 4
    assert cache.entry_path("built", hashlib.sha256(b"11").digest()) in left
    assert other.read_text() == "not an entry"


def test_stale_temporary_files_are_removed(private_cache):
    private_cache.mkdir(parents=True)
    stale = private_cache / ".program-x.123.tmp"
    stale.write_bytes(b"half")
    old = os.stat(stale).st_mtime - 7200
    os.utime(stale, (old, old))
    cache.write("infer", b"k" * 32, {}, b"x")
    cache.flush()
    assert not stale.exists()


# ------------------------------------------------------------------ shape inference
def test_inference_memo_answers_as_onnx_does(private_cache):
    model = linear_regression()
    g = model.training_info[0].algorithm
    first = infer_types(g, model.opset_import)
    assert cache.stats.get("infer.miss") == 1
    cache.flush()
    cache.stats.clear()
    assert infer_types(g, model.opset_import) == first
    assert cache.stats == {"infer.hit": 1}


def test_large_constants_are_typed_inputs_for_inference():
    """A large float Constant only contributes its type: inference sees an
    input, the results are unchanged."""
    big = numpy_helper.from_array(np.ones((64, 32), np.float32), "w")
    nodes = [helper.make_node("Constant", [], ["W"], value=big),
             helper.make_node("MatMul", ["X", "W"], ["Y"]),
             helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(
                 np.array([-1, 8, 4], np.int64), "s")),
             helper.make_node("Reshape", ["Y", "shape"], ["Z"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [5, 64])],
                          [helper.make_tensor_value_info("Z", onnx.TensorProto.FLOAT, None)])
    dtypes, shapes = infer_types(g, [helper.make_opsetid("", 17)])
    assert shapes["W"] == (64, 32) and shapes["Y"] == (5, 32) and shapes["Z"] == (5, 8, 4)
    assert dtypes["W"] == onnx.TensorProto.FLOAT


# ------------------------------------------------------------------ onnxruntime options
def test_options_that_restrict_rewrites_bypass_the_optimized_models(private_cache):
    model = spec_model()
    run(model)  # makes the optimized models
    so = default_session_options()
    so.add_session_config_entry("optimization.disable_specified_optimizers", "GemmActivationFusion")
    cache.stats.clear()
    run(model, session_options=so)
    assert not cache.stats.get("ort.hit") and not cache.stats.get("ort.miss")
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL  # untouched


def test_the_optimization_level_is_part_of_the_key(private_cache):
    model = spec_model()
    good = run(model)
    so = default_session_options()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    cache.stats.clear()
    assert run(model, session_options=so) == good
    assert cache.stats.get("ort.miss", 0) >= 1 and not cache.stats.get("ort.hit")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    cache.stats.clear()
    assert run(model, session_options=so) == good
    assert not cache.stats.get("ort.miss") and not cache.stats.get("ort.hit")


# ------------------------------------------------------------------ large constants by reference
def frozen_model(seed=0):
    """A builder model whose frozen weights (W1 128 KiB, W2 96 KiB) are over
    BY_REFERENCE_BYTES: a LoRA base model's weights in small."""
    return build.training_model(mlp(sizes=(4, 8192, 3), seed=seed), loss="cross_entropy", target="label",
                                optimizer=build.AdamW(lr=0.05), trainable=["b1", "b2"])


@pytest.fixture(params=["inline", "held"])
def holding(request, monkeypatch):
    """Frozen weights left in the protobuf, or held (``storage.hold``: in a
    file of this process, which another session or process does not share)."""
    from onnxtrain.io import storage

    monkeypatch.setattr(storage, "HOLD_FROM", 2**30 if request.param == "inline" else 64 << 10)
    monkeypatch.setattr(mapped, "PARALLEL_HASH_BYTES", 0)  # the held data hashed on threads
    return request.param


def test_large_frozen_constants_are_cached_by_reference(private_cache, holding):
    model = frozen_model()
    weights = {t.name: t.raw_data for t in model.graph.initializer if t.name in ("W1", "W2")}
    assert min(len(w) for w in weights.values()) >= 64 << 10  # BY_REFERENCE_BYTES, HOLD_FROM
    cold = run(model)
    files = entries(private_cache, "program")
    assert cache.stats.get("program.miss") == 2 and files
    for f in files:  # the entries hold the programs without the weights' data, or this process's files
        data = f.read_bytes()
        assert f.stat().st_size < 64 << 10
        assert not any(w[:4096] in data for w in weights.values())
        assert f"onnxtrain-{os.getpid()}-".encode() not in data
    cache.stats.clear()
    warm = run(frozen_model())  # another object, the same bytes: the data come from it
    assert counts("program.hit", "program.miss", "fused.hit") == {
        "program.hit": 2, "program.miss": 0, "fused.hit": 1}
    assert warm == cold
    sess = TrainingSession(model)
    held = [t.name for t in sess.model.graph.initializer if mapped.is_owned(t)]
    assert held == (["W1", "W2"] if holding == "held" else [])


def test_the_data_of_constants_by_reference_is_in_the_key(private_cache, holding):
    a = run(frozen_model(seed=0), steps=1)
    cache.flush()
    cache.stats.clear()
    b = run(frozen_model(seed=1), steps=1)  # other frozen weights, the same skeleton
    assert counts("program.hit", "program.miss") == {"program.hit": 0, "program.miss": 2}
    assert a[0] != b[0]
    cache.flush()
    cache.stats.clear()
    again = run(frozen_model(seed=1), steps=1)
    assert cache.stats.get("program.hit") == 2 and again == b


# ------------------------------------------------------------------ optimized forms of shared weights
@pytest.fixture
def held_weights(monkeypatch):
    """The frozen weights of ``frozen_model`` held (mapped, and given to
    onnxruntime as shared initializers)."""
    from onnxtrain.io import storage

    monkeypatch.setattr(storage, "HOLD_FROM", 64 << 10)


def test_programs_with_shared_weights_load_their_optimized_form(private_cache, held_weights, monkeypatch):
    model = frozen_model()
    weights = [t.raw_data for t in model.graph.initializer if t.name in ("W1", "W2")]
    monkeypatch.setenv(cache.ENV, "0")
    uncached = run(model)
    monkeypatch.setenv(cache.ENV, "1")
    cold = run(model)
    made = entries(private_cache, "ort")
    assert cache.stats.get("ort.made", 0) >= 1 and made
    assert not list(private_cache.glob(".ort-*"))  # the session's saved form and data: removed
    for f in made:  # the weights are named, neither their data nor this process's files
        data = f.read_bytes()
        assert not any(w[:4096] in data for w in weights)
        assert f"onnxtrain-{os.getpid()}-".encode() not in data and mapped.HELD.encode() in data
    cache.stats.clear()
    warm = run(frozen_model())  # other held files, the same weights
    assert cache.stats.get("ort.hit", 0) >= 1 and not cache.stats.get("ort.bad")
    assert uncached == cold == warm


def derived_model(seed):
    """``frozen_model`` with its second weight stored transposed and doubled,
    read through Transpose and Mul nodes: a value of the frozen weights alone,
    which onnxruntime folds into a constant when the weight is one."""
    model = mlp(sizes=(4, 8192, 3), seed=seed)
    g = model.graph
    w2 = next(t for t in g.initializer if t.name == "W2")
    g.initializer.remove(w2)
    g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(w2).T) * 2, "W2t"))
    g.initializer.append(numpy_helper.from_array(np.array(0.5, np.float32), "half"))
    g.node.insert(0, helper.make_node("Transpose", ["W2t"], ["W2x2"], name="w2_t", perm=[1, 0]))
    g.node.insert(1, helper.make_node("Mul", ["W2x2", "half"], ["W2"], name="w2_half"))
    return build.training_model(model, loss="cross_entropy", target="label",
                                optimizer=build.AdamW(lr=0.05), trainable=["b1", "b2"])


def test_the_weights_data_is_in_the_optimized_forms_key(private_cache, held_weights, monkeypatch):
    """onnxruntime folds a value of the frozen weights alone into the
    optimized form: other weights of the same shapes do not load it, and each
    model gets its own results, cold, warm and uncached alike."""
    monkeypatch.setenv(cache.ENV, "0")
    uncached = [run(derived_model(seed=seed)) for seed in (0, 1)]
    monkeypatch.setenv(cache.ENV, "1")
    assert run(derived_model(seed=0)) == uncached[0]
    cache.flush()
    cache.stats.clear()
    assert run(derived_model(seed=1)) == uncached[1]
    assert not cache.stats.get("ort.hit") and cache.stats.get("ort.miss", 0) >= 1
    cache.flush()
    cache.stats.clear()
    assert [run(derived_model(seed=seed)) for seed in (0, 1)] == uncached
    assert cache.stats.get("ort.hit", 0) >= 2


def test_an_entry_naming_other_weights_is_dropped(private_cache, held_weights):
    model = frozen_model()
    good = run(model)
    made = entries(private_cache, "ort")
    assert made
    for p in made:  # a well-formed entry whose weight W2 has other dims
        raw = p.read_bytes()
        key = raw[len(cache.MAGIC):len(cache.MAGIC) + 32]
        header, payload = cache.read("ort", key)
        optimized = onnx.ModelProto.FromString(payload)
        w2 = next(t for t in optimized.graph.initializer if t.name == "W2")
        w2.dims[0] += 1
        p.unlink()
        cache.write_now("ort", key, header, optimized.SerializeToString())
    cache.stats.clear()
    assert run(model) == good
    assert not cache.stats.get("ort.hit") and cache.stats.get("ort.miss", 0) >= 1


# ------------------------------------------------------------------ limits and processes
def test_models_over_the_entry_limit_are_not_cached(private_cache, monkeypatch):
    monkeypatch.setattr(cache, "MAX_ENTRY_BYTES", 64)
    model = spec_model()
    assert run(model) == run(model)
    assert not entries(private_cache, "program") and not entries(private_cache, "ort")
    assert not cache.stats.get("program.hit") and not cache.stats.get("program.miss")


def test_a_forked_child_writes_its_own_entries_and_exits_promptly(private_cache):
    import multiprocessing
    import time

    model = spec_model()
    TrainingSession(model)  # the parent's writer thread exists (and may hold jobs)
    ctx = multiprocessing.get_context("fork")

    def child(conn):
        cache.stats.clear()
        other = onnx.ModelProto()
        other.CopyFrom(model)
        other.graph.node[0].name = "in the child"
        sess = TrainingSession(other)
        sess.train_step(FEEDS)
        cache.flush(timeout=30)
        conn.send(cache.stats.get("program.write", 0))

    parent_end, child_end = ctx.Pipe()
    p = ctx.Process(target=child, args=(child_end,))
    start = time.monotonic()
    p.start()
    assert parent_end.poll(60)
    assert parent_end.recv() >= 2
    p.join(30)
    assert p.exitcode == 0 and time.monotonic() - start < 30


_EXIT_SCRIPT = """
import sys, time
sys.path[:0] = {paths!r}
from onnxtrain import TrainingSession
from onnxtrain.core import diskcache as cache
from models import mlp_classifier
from test_build import blobs
x, y = blobs()
sess = TrainingSession(mlp_classifier(optimizer="adam"))
sess.train_step({{"X": x, "label": y}})
print(dict(cache.stats))
"""


def test_interpreter_exit_writes_the_entries_and_exits_cleanly(tmp_path):
    """The optimized model, deferred ORT_DELAY seconds, is made at exit (within
    EXIT_BUDGET); the process exits at once and with status 0, never with the
    writer thread inside onnxruntime."""
    import subprocess
    import sys
    import time

    here = Path(__file__).resolve().parent
    paths = [str(here.parent), str(here.parent / "builder")]
    env = dict(os.environ, ONNXTRAIN_CACHE_DIR=str(tmp_path / "c"), ONNXTRAIN_PROGRAM_CACHE="1")
    script = _EXIT_SCRIPT.format(paths=paths)
    outs = []
    for _ in range(2):
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "terminate" not in proc.stderr
        assert time.monotonic() - start < 60
        outs.append(proc.stdout)
    # (the second process reads it, made ahead on the first run's thread: runtime.firstrun)
    assert "'ort.miss': 1" in outs[0] and "'ort.ahead': 1" in outs[1]


def test_a_cached_nchwc_program_is_only_used_with_its_block(private_cache, monkeypatch):
    """The NCHWc layout depends on the machine's onnxruntime (its block): an
    entry made for another block is rewritten, not used."""
    from test_conv_kernels import _cnn, needs_library

    from onnxtrain.kernels.nchwc import REORDER_KERNEL
    from onnxtrain.runtime import executor

    if needs_library.args[0]:
        pytest.skip("no C compiler")
    model = build.training_model(_cnn(3, [16, 16], [{"k": [3, 3], "pads": [1, 1, 1, 1]} for _ in range(2)]),
                                 loss="cross_entropy", optimizer=build.SGD(lr=0.1))

    def layout_blocks():
        program = TrainingSession(model).programs(executed=True)["training_info[0].algorithm"]
        values = {t.name: numpy_helper.to_array(t) for t in program.graph.initializer}
        return {int(values[n.input[1]][0]) for n in program.graph.node if n.op_type == REORDER_KERNEL}

    monkeypatch.setattr(executor, "_nchwc_block", 16)
    assert layout_blocks() == {16}
    cache.flush()
    cache.stats.clear()
    assert layout_blocks() == {16} and cache.stats.get("fused.hit") == 1
    monkeypatch.setattr(executor, "_nchwc_block", 8)
    cache.stats.clear()
    assert layout_blocks() == {8} and not cache.stats.get("fused.hit")


def test_cache_eviction_is_least_recently_used_not_first_in(private_cache, monkeypatch):
    """Four entries written oldest first; a hit on the oldest; a fifth write
    evicts down to three: the two least recently used go (entries 1 and 2),
    the one just read stays.

    Bug caught: ``cache.read`` no longer touching the entry it returns
    (``os.utime(path)`` removed), which makes eviction first-in first-out."""
    monkeypatch.setattr(cache, "MAX_ENTRIES", 4)
    keys = [hashlib.sha256(f"entry {i}".encode()).digest() for i in range(5)]
    paths: dict[int, object] = {}
    now = time.time()
    for i in range(4):
        cache.write("infer", keys[i], {"i": i}, b"payload %d" % i)
        cache.flush()
        (paths[i],) = set(private_cache.rglob("infer-*")) - set(paths.values())
        # Distinct, old modification times in write order (a coarse clock gives ties).
        os.utime(paths[i], (now - 1000 + i, now - 1000 + i))
    assert cache.read("infer", keys[0]) == ({"i": 0}, b"payload 0")  # the hit
    cache.write("infer", keys[4], {"i": 4}, b"payload 4")
    cache.flush()
    left = [i for i in range(5) if cache.read("infer", keys[i]) is not None]
    assert left == [0, 3, 4], f"entries left after eviction: {left}"


def test_an_unsound_kernel_rewrite_is_refused_and_never_cached(monkeypatch):
    """A rewritten program is checked SSA and sorted before the cache keeps
    it (one the cache hands back is not walked again): a rewrite that breaks
    the order is refused, checks off, at a cold start and again at the next,
    never handed back from the cache."""
    from onnxtrain.lower import executed
    from onnxtrain.lower.checks import PassError

    real = executed._with_fused_kernels

    def unsorted(model):
        fused, count = real(model)
        out = onnx.ModelProto()
        out.CopyFrom(fused)
        nodes = list(out.graph.node)
        del out.graph.node[:]
        out.graph.node.extend(reversed(nodes))
        return out, count

    monkeypatch.setattr(executed, "_with_fused_kernels", unsorted)
    model = built_model()
    for _ in range(2):
        with pytest.raises(PassError, match="executed: the graph is no longer SSA and sorted"):
            TrainingSession(model).train_step(FEEDS)
        cache.flush()  # (entries are written on the writer thread)
    assert cache.stats.get("program.hit") and not cache.stats.get("fused.hit")


def test_a_cached_kernel_rewrite_is_not_walked_again(monkeypatch):
    """The rewrite checked before the cache kept it (above) is trusted as it
    comes back, as a cached program is: no second walk of it at a warm start.
    (Programs specialized to the feeds' shapes are not cached: off here.)"""
    from onnxtrain.lower import executed
    from onnxtrain.runtime.runner import SPECIALIZE_ENV

    monkeypatch.setenv(SPECIALIZE_ENV, "0")
    model = built_model()
    cold = run(model)
    cache.flush()
    cache.stats.clear()
    real, walks = executed.check_sound, []
    monkeypatch.setattr(executed, "check_sound", lambda graph, where, *a: walks.append(where) or real(graph, where, *a))
    assert run(model) == cold
    assert cache.stats.get("fused.hit") == 1 and walks == []
