"""Fuzzing with hypothesis: mutated models and bad feeds either work or fail cleanly.

Allowed exceptions, by call:

- ``onnxtrain.io.model.load`` + ``validate`` (every model mutation):
  ``TrainingModelError`` only.
- ``TrainingSession(...)``, ``initialize()``, ``train_step()``, ``run()``:
  ``TrainingModelError`` (a ValueError: model problems, found while building
  programs or when onnxruntime cannot compile one), ``ValueError`` (bad feeds,
  bad ``algorithm`` or output names), ``RuntimeError`` (onnxruntime failed
  while running: ``Executor`` wraps every onnxruntime exception in one),
  ``FloatingPointError`` (``check_finite=True``).
- ``load_state()``: ``KeyError`` (unknown name) and ``ValueError``.

After any failed call the session's state is byte-identical to before.

Three tests share the budget of examples (at least 2,000 in CI, fixed and
derandomized): feeds against long-lived sessions (cheap: no recompiling),
model mutations checked by load + validate (cheap), and model mutations run
through whole sessions (compiles programs: fewer).  Set
``ONNXTRAIN_FUZZ_EXAMPLES=50000`` for the long run (the same split), and
``ONNXTRAIN_FUZZ_REPORT=path.json`` to get per-test counts of outcomes.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import string
import warnings

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import PREVIEW, linear_regression, mlp_classifier, vi
from onnx import TensorProto, helper
from reliability_models import ALLOWED, counter_model, state_digest

from onnxtrain import TrainingModelError, TrainingSession
from onnxtrain.io.model import load, validate

TOTAL = int(os.environ.get("ONNXTRAIN_FUZZ_EXAMPLES", "2400"))
SHARES = {"feeds": 0.58, "validation": 0.34, "sessions": 0.08}
EXAMPLES = {name: max(10, round(TOTAL * share)) for name, share in SHARES.items()}
FUZZ = dict(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)

STATS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
#: A few messages per (test, exception type), to review what the errors say.
SAMPLES: dict[str, list[str]] = collections.defaultdict(list)


def _write_report() -> None:
    path = os.environ.get("ONNXTRAIN_FUZZ_REPORT")
    if path and STATS:
        report = {k: dict(v) for k, v in STATS.items()}
        report["samples"] = dict(SAMPLES)
        with open(path, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)


atexit.register(_write_report)


def outcome(test: str, exc: BaseException | None) -> None:
    """Count one call's outcome (a session example makes up to four calls)."""
    STATS[test]["calls"] += 1
    STATS[test]["ok" if exc is None else type(exc).__name__] += 1
    if exc is not None:
        samples = SAMPLES[f"{test}: {type(exc).__name__}"]
        if len(samples) < 4:
            samples.append(str(exc)[:300])


# ================================================================= feeds
def ir3_linear() -> onnx.ModelProto:
    """Linear regression whose W is also a main-graph input (IR 3 style): run() may override it."""
    m = linear_regression()
    m.graph.input.append(vi("W", TensorProto.FLOAT, [3, 1]))
    return m


class Target:
    """A long-lived session, its valid feeds and its baseline state."""

    def __init__(self, name: str, model: onnx.ModelProto, feeds, check_finite: bool) -> None:
        self.name = name
        self.sess = TrainingSession(model, check_finite=check_finite)
        self.sess.initialize()
        self.feeds = feeds
        self.baseline = dict(self.sess.state)
        self.digest = state_digest(self.baseline)
        self.run_feeds = {k: v for k, v in feeds.items() if k in self.sess.inference_inputs}
        for _ in range(2):  # compile every program and warm the caches now
            self.sess.train_step(feeds)
            self.sess.run(self.run_feeds)
        self.reset()

    def reset(self) -> None:
        self.sess.load_state(self.baseline)


def _rng_feeds(n: int, n_in: int, classes: int | None):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, n_in)).astype(np.float32)
    if classes is None:
        return {"X": x, "T": rng.standard_normal((n, 1)).astype(np.float32)}
    return {"X": x, "label": rng.integers(0, classes, n).astype(np.int64)}


@pytest.fixture(scope="module")
def targets() -> list[Target]:
    return [
        Target("mlp-adam-guarded", mlp_classifier("adam"), _rng_feeds(8, 4, 3), True),
        Target("mlp-momentum-2-algorithms",
               mlp_classifier("momentum", groups=[["W1", "b1"], ["W2", "b2"]]),
               _rng_feeds(8, 4, 3), False),
        Target("linear-ir3", ir3_linear(), _rng_feeds(8, 3, None), False),
    ]


DTYPES = [np.float32, np.float64, np.float16, np.int64, np.int32, np.int8, np.uint8, np.bool_,
          np.complex64, np.str_]
#: Values that are not arrays.  Python ints beyond int64 (2**70) are left out
#: until FeedSpec.check turns their OverflowError into a ValueError (see
#: test_feed_with_an_int_beyond_int64_is_a_value_error, a strict xfail).
WEIRD_VALUES = [None, "abc", b"abc", 3, 2.5, 2**62, -(2**62), [], [[]], [1.0, [2.0]], {"a": 1},
                object(), np.array(object()), float("nan")]
NAMES = ["X", "T", "label", "W", "W1", "b2", "step0", "loss", "logits", "Y", "", "x", "nope", 1]


@st.composite
def feed_case(draw, n_targets: int):
    """(target index, operation, feeds mutation script)."""
    target = draw(st.integers(0, n_targets - 1))
    op = draw(st.sampled_from(["train", "train", "train", "run", "run", "load_state"]))
    algorithm = draw(st.sampled_from([None, None, None, 0, 1, 2, -1, True, 1.0, "0"]))
    fetch = draw(st.booleans())
    outputs = draw(st.sampled_from([None, None, "all", [], ["nope"], "dup", "first"]))
    n_mut = draw(st.integers(0, 3))
    muts = [draw(st.tuples(st.integers(0, 11), st.integers(0, 2**31 - 1))) for _ in range(n_mut)]
    return target, op, algorithm, fetch, outputs, muts


def mutate_feeds(feeds: dict, muts, state_names) -> dict:
    """Apply mutation codes to a copy of ``feeds`` (deterministic given the seeds).
    A mutation that cannot apply to what an earlier one left (say, a dtype
    cast of ``object()``) is skipped."""
    out = dict(feeds)
    for code, seed in muts:
        try:
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # lossy casts are the point here
                out = _mutate_once(out, code, seed, state_names)
        except (TypeError, ValueError, OverflowError, IndexError):
            continue
    return out


def _mutate_once(out: dict, code: int, seed: int, state_names) -> dict:
    out = dict(out)
    rng = np.random.default_rng(seed)
    keys = list(out)
    key = keys[rng.integers(len(keys))] if keys else None
    if code == 0 and key is not None:                       # missing name
        del out[key]
    elif code == 1:                                         # extra name
        out[NAMES[rng.integers(len(NAMES))]] = np.zeros((2, 3), np.float32)
    elif code == 2 and key is not None:                     # wrong dtype
        dtype = DTYPES[rng.integers(len(DTYPES))]
        out[key] = np.asarray(out[key]).astype(dtype)
    elif code == 3 and key is not None:                     # wrong rank
        arr = np.asarray(out[key])
        out[key] = arr[None] if rng.integers(2) else arr.reshape(-1)[: max(arr.size, 1)].reshape(-1)
        if rng.integers(3) == 0:
            out[key] = np.asarray(arr.flat[0] if arr.size else 0, arr.dtype)
    elif code == 4 and key is not None:                     # non-finite values
        arr = np.array(out[key], copy=True)
        if arr.dtype.kind == "f" and arr.size:
            arr.flat[rng.integers(arr.size)] = [np.nan, np.inf, -np.inf][rng.integers(3)]
        out[key] = arr
    elif code == 5:                                         # empty batch
        out = {k: np.asarray(v)[:0] if np.ndim(v) else v for k, v in out.items()}
    elif code == 6 and key is not None:                     # batch mismatch / wrong width
        arr = np.asarray(out[key])
        if arr.ndim:
            pad = np.concatenate([arr, arr[:1]]) if rng.integers(2) else arr[1:]
            out[key] = pad
        if arr.ndim == 2 and rng.integers(2):
            out[key] = np.concatenate([arr, arr[:, :1]], axis=1)
    elif code == 7 and key is not None:                     # not an array at all
        out[key] = WEIRD_VALUES[rng.integers(len(WEIRD_VALUES))]
    elif code == 8 and key is not None:                     # a python list of the values
        out[key] = np.asarray(out[key]).tolist()
    elif code == 9 and key is not None:                     # non-contiguous view
        arr = np.asarray(out[key])
        if arr.ndim:
            out[key] = np.repeat(arr, 2, axis=0)[::2]
        if arr.ndim == 2:
            out[key] = np.asfortranarray(arr)
    elif code == 10 and key is not None:                    # out-of-range labels, extremes
        arr = np.array(out[key], copy=True)
        if arr.size:
            if arr.dtype.kind == "i":
                arr.flat[rng.integers(arr.size)] = [-1, 3, 99, 2**62][rng.integers(4)]
            elif arr.dtype.kind == "f":
                arr.flat[rng.integers(arr.size)] = [1e38, -1e38, 1e-45, 0.0][rng.integers(4)]
        out[key] = arr
    elif code == 11 and state_names:                        # a state variable as a feed
        name = state_names[rng.integers(len(state_names))]
        out[name] = np.zeros((1,), np.float32)
    return out


def _run_op(t: Target, op, algorithm, fetch, outputs, feeds):
    sess = t.sess
    if op == "train":
        if algorithm is None and not fetch:
            return sess.train_step(feeds, fetch=False)
        return sess.train_step(feeds, algorithm=algorithm, fetch=fetch)
    if op == "run":
        names = sess.inference_outputs
        chosen = outputs
        if isinstance(outputs, str):
            chosen = {"all": names, "dup": names[:1] * 2, "first": names[:1]}[outputs]
        return sess.run({k: v for k, v in feeds.items() if k not in ("T", "label")}
                        if algorithm is None else feeds, chosen)
    mapping = {k: v for k, v in feeds.items()}
    mapping.update({k: v for k, v in t.baseline.items() if k in ("W", "W1", "b1")})
    return sess.load_state(mapping)


@settings(max_examples=EXAMPLES["feeds"], **FUZZ)
@given(case=feed_case(3))
def test_fuzz_feeds(targets, case):
    target, op, algorithm, fetch, outputs, muts = case
    STATS["feeds"]["examples"] += 1
    t = targets[target]
    feeds = mutate_feeds(t.feeds, muts, list(t.baseline))
    exc = None
    try:
        _run_op(t, op, algorithm, fetch, outputs, feeds)
    except BaseException as e:  # noqa: BLE001 - classified below
        exc = e
    outcome("feeds", exc)
    try:
        if exc is not None:
            allowed = (KeyError, ValueError) if op == "load_state" else ALLOWED
            if not isinstance(exc, allowed):
                raise AssertionError(f"{op} raised {type(exc).__name__}: {exc}") from exc
            assert str(exc), "empty error message"
            assert state_digest(t.sess.state) == t.digest, f"failed {op} changed the state"
        elif op == "run":
            assert state_digest(t.sess.state) == t.digest, "run() changed the state"
    finally:
        t.reset()


# ========================================================== model mutations
BASE_MODELS = {
    "mlp-adam": lambda: mlp_classifier("adam"),
    "linear-sgd": lambda: linear_regression(),
    "mlp-momentum-2": lambda: mlp_classifier("momentum", groups=[["W1", "b1"], ["W2", "b2"]]),
    "counter": lambda: counter_model(p0_shape=(4,), p1_shape=(2, 2)),
    "mlp-adagrad-f64": lambda: mlp_classifier("adagrad", dtype=np.float64),
}
_BASE_CACHE: dict[str, bytes] = {}


def base_bytes(name: str) -> bytes:
    if name not in _BASE_CACHE:
        _BASE_CACHE[name] = BASE_MODELS[name]().SerializeToString()
    return _BASE_CACHE[name]


def graphs_of(m: onnx.ModelProto) -> list[onnx.GraphProto]:
    out = [m.graph]
    for ti in m.training_info:
        out.append(ti.algorithm)
        if ti.HasField("initialization"):
            out.append(ti.initialization)
    return out


def names_of(m: onnx.ModelProto) -> list[str]:
    names = set()
    for g in graphs_of(m):
        names |= {i.name for i in g.input} | {o.name for o in g.output}
        names |= {t.name for t in g.initializer}
        for n in g.node:
            names.update(n.input)
            names.update(n.output)
    return sorted(names)


OPS = ["Relu", "Add", "Mul", "Identity", "MatMul", "Gemm", "Gradient", "Adam", "Momentum",
       "Adagrad", "GraphCall", "SoftmaxCrossEntropyLoss", "ReduceMean", "Nope", "Loop"]
DOMAINS = ["", "", PREVIEW, "ai.onnx", "custom.domain"]
ELEM_TYPES = [TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64, TensorProto.INT32,
              TensorProto.FLOAT16, TensorProto.BOOL, TensorProto.STRING, TensorProto.UINT8, 0, 99]
TEXT = st.text(alphabet=string.ascii_letters + string.digits + "_/:", max_size=8)


@st.composite
def mutated_model(draw) -> tuple[str, bytes]:
    """A base training model with 1-4 structural mutations, maybe byte-level damage."""
    base = draw(st.sampled_from(sorted(BASE_MODELS)))
    m = onnx.ModelProto()
    m.ParseFromString(base_bytes(base))
    pool = names_of(m)
    name = lambda: draw(st.one_of(st.sampled_from(pool), TEXT, st.just("")))  # noqa: E731
    for _ in range(draw(st.integers(1, 4))):
        graphs = graphs_of(m)
        g = graphs[draw(st.integers(0, len(graphs) - 1))]
        kind = draw(st.integers(0, 21))
        nodes = list(g.node)
        node = nodes[draw(st.integers(0, len(nodes) - 1))] if nodes else None
        infos = list(m.training_info)
        ti = infos[draw(st.integers(0, len(infos) - 1))] if infos else None
        if kind == 0 and node is not None and len(node.input):            # node input renamed
            node.input[draw(st.integers(0, len(node.input) - 1))] = name()
        elif kind == 1 and node is not None and len(node.output):         # node output renamed
            node.output[draw(st.integers(0, len(node.output) - 1))] = name()
        elif kind == 2 and node is not None:                              # input dropped/added
            if len(node.input) and draw(st.booleans()):
                del node.input[draw(st.integers(0, len(node.input) - 1))]
            else:
                node.input.append(name())
        elif kind == 3 and node is not None and len(node.attribute):      # attribute changed
            a = node.attribute[draw(st.integers(0, len(node.attribute) - 1))]
            choice = draw(st.integers(0, 6))
            if choice == 0:
                node.attribute.remove(a)
            elif choice == 1:
                a.i = draw(st.integers(-(2**63), 2**63 - 1))
            elif choice == 2:
                a.f = draw(st.floats(allow_nan=True, allow_infinity=True, width=32))
            elif choice == 3:
                a.s = name().encode()
            elif choice == 4:
                a.type = draw(st.sampled_from(list(onnx.AttributeProto.AttributeType.values())))
            elif choice == 5:
                a.ints[:] = draw(st.lists(st.integers(-5, 5), max_size=4))
            else:
                a.strings[:] = [name().encode() for _ in range(draw(st.integers(0, 3)))]
        elif kind == 4 and node is not None:                              # attribute added
            node.attribute.append(helper.make_attribute(
                draw(st.sampled_from(["axis", "keepdims", "alpha", "y", "xs", "mode", "zz"])),
                draw(st.one_of(st.integers(-3, 3), st.floats(-2, 2), TEXT))))
        elif kind == 5 and node is not None:                              # op or domain changed
            node.op_type = draw(st.sampled_from(OPS))
            node.domain = draw(st.sampled_from(DOMAINS))
        elif kind == 6 and nodes:                                         # graph order
            perm = draw(st.permutations(range(len(nodes))))
            del g.node[:]
            g.node.extend(nodes[i] for i in perm)
        elif kind == 7 and node is not None:                              # node deleted / duplicated
            if draw(st.booleans()):
                g.node.remove(node)
            else:
                g.node.append(node)
        elif kind == 8 and node is not None:                              # node moved to another graph
            other = graphs[draw(st.integers(0, len(graphs) - 1))]
            g.node.remove(node)
            other.node.insert(draw(st.integers(0, len(other.node))), node)
        elif kind == 9 and ti is not None and len(ti.update_binding):     # binding key / value
            b = ti.update_binding[draw(st.integers(0, len(ti.update_binding) - 1))]
            if draw(st.booleans()):
                b.key = name()
            else:
                b.value = name()
        elif kind == 10 and ti is not None:                               # bindings dropped/duplicated/swapped
            choice = draw(st.integers(0, 3))
            if choice == 0 and len(ti.update_binding):
                del ti.update_binding[draw(st.integers(0, len(ti.update_binding) - 1))]
            elif choice == 1 and len(ti.update_binding):
                ti.update_binding.append(ti.update_binding[0])
            elif choice == 2 and len(ti.initialization_binding):
                ti.update_binding.append(ti.initialization_binding[0])
            elif len(ti.initialization_binding):
                b = ti.initialization_binding[draw(st.integers(0, len(ti.initialization_binding) - 1))]
                b.value = name()
        elif kind == 11 and len(g.initializer):                           # initializer dtype
            t = g.initializer[draw(st.integers(0, len(g.initializer) - 1))]
            t.data_type = draw(st.sampled_from(ELEM_TYPES))
        elif kind == 12 and len(g.initializer):                           # initializer dims
            t = g.initializer[draw(st.integers(0, len(g.initializer) - 1))]
            dims = list(t.dims)
            choice = draw(st.integers(0, 3))
            if choice == 0:
                dims.append(1)
            elif choice == 1 and dims:
                dims.pop()
            elif choice == 2 and dims:
                dims[draw(st.integers(0, len(dims) - 1))] = draw(st.sampled_from([0, 2, 7, 2**40, -1]))
            else:
                dims = dims[::-1]
            t.dims[:] = dims
        elif kind == 13:                                                  # value_info type / shape
            vis = list(g.input) + list(g.output)
            if vis:
                v = vis[draw(st.integers(0, len(vis) - 1))]
                tt = v.type.tensor_type
                if draw(st.booleans()):
                    tt.elem_type = draw(st.sampled_from(ELEM_TYPES))
                elif len(tt.shape.dim):
                    d = tt.shape.dim[draw(st.integers(0, len(tt.shape.dim) - 1))]
                    d.dim_value = draw(st.sampled_from([0, 1, 5, 2**40]))
                else:
                    tt.shape.dim.add().dim_value = 3
        elif kind == 14 and len(g.initializer):                           # initializer deleted
            del g.initializer[draw(st.integers(0, len(g.initializer) - 1))]
        elif kind == 15 and len(g.output):                                # output deleted / duplicated
            if draw(st.booleans()):
                del g.output[draw(st.integers(0, len(g.output) - 1))]
            else:
                g.output.append(g.output[0])
        elif kind == 16:                                                  # graph input added / dropped
            if len(g.input) and draw(st.booleans()):
                del g.input[draw(st.integers(0, len(g.input) - 1))]
            else:
                g.input.append(vi(name() or "extra", TensorProto.FLOAT, [2]))
        elif kind == 17 and ti is not None:                               # initialization graph removed
            ti.ClearField("initialization")
        elif kind == 18:                                                  # versions
            if draw(st.booleans()):
                m.ir_version = draw(st.integers(0, 20))
            else:
                m.opset_import[0].version = draw(st.integers(1, 30))
        elif kind == 19 and ti is not None:                               # training_info dropped / duplicated
            if draw(st.booleans()):
                m.training_info.remove(ti)
            else:
                m.training_info.append(ti)
        elif kind == 20 and node is not None and node.op_type == "Gradient":  # Gradient xs/zs/y
            for a in node.attribute:
                if a.name in ("xs", "zs") and len(a.strings):
                    a.strings[draw(st.integers(0, len(a.strings) - 1))] = name().encode()
                elif a.name == "y":
                    a.s = name().encode()
        elif kind == 21 and len(g.initializer):                           # initializer renamed
            t = g.initializer[draw(st.integers(0, len(g.initializer) - 1))]
            t.name = name()
    data = m.SerializeToString()
    damage = draw(st.integers(0, 9))
    if damage == 0 and data:                                              # truncated
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif damage == 1 and data:                                            # a byte flipped
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
    elif damage == 2:                                                     # bytes inserted
        i = draw(st.integers(0, len(data)))
        data = data[:i] + draw(st.binary(min_size=1, max_size=8)) + data[i:]
    return base, data


@settings(max_examples=EXAMPLES["validation"], **FUZZ)
@given(case=mutated_model())
def test_fuzz_model_validation(case):
    """load + validate: every mutant is accepted or refused with TrainingModelError."""
    _, data = case
    STATS["validation"]["examples"] += 1
    exc = None
    try:
        validate(*load(data))
    except TrainingModelError as e:
        exc = e
        assert str(e)
    outcome("validation", exc)


FEEDS = {
    "mlp-adam": _rng_feeds(8, 4, 3),
    "linear-sgd": _rng_feeds(8, 3, None),
    "mlp-momentum-2": _rng_feeds(8, 4, 3),
    "counter": {"X": np.zeros(1)},
    "mlp-adagrad-f64": {"X": np.random.default_rng(0).standard_normal((8, 4)),
                        "label": np.arange(8, dtype=np.int64) % 3},
}


@settings(max_examples=EXAMPLES["sessions"], **FUZZ)
@given(case=mutated_model())
def test_fuzz_model_sessions(case):
    """Whole sessions of mutants: construct, initialize, train, run; clean failures
    only, and a failed call never changes the state."""
    base, data = case
    STATS["sessions"]["examples"] += 1
    try:
        sess = TrainingSession(data)
    except ALLOWED as e:
        outcome("sessions", e)
        return
    feeds = FEEDS[base]
    calls = [
        ("initialize", lambda: sess.initialize()),
        ("train_step", lambda: sess.train_step(feeds)),
        ("run", lambda: sess.run({k: v for k, v in feeds.items() if k in sess.inference_inputs})),
    ]
    for what, call in calls:
        before = state_digest(sess._store.to_numpy())
        exc = None
        try:
            call()
        except ALLOWED as e:
            exc = e
            assert str(e)
            after = state_digest(sess._store.to_numpy())
            assert after == before, f"a failed {what} changed the state"
        outcome("sessions", exc)


# ------------------------------------------- findings of the fuzzing, now fixed
def test_feed_with_an_int_beyond_int64_is_a_value_error(targets):
    t = targets[0]
    with pytest.raises(ValueError, match="label"):
        t.sess.train_step({"X": t.feeds["X"], "label": [2**70] * 8})


def test_feeds_disagreeing_on_a_symbolic_dim_are_refused(targets):
    t = targets[0]
    with pytest.raises(ValueError, match="'N'"):
        t.sess.train_step({"X": t.feeds["X"], "label": t.feeds["label"][:3]})
    t.reset()


def test_fuzz_budget():
    """The CI budget is at least 2,000 cases (the split is documented above)."""
    assert sum(EXAMPLES.values()) >= min(TOTAL, 2000)
