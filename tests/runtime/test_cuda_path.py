"""The CUDA path, tested without a GPU (issue 16, item 9).

The installed onnxruntime has the CPU provider only, so what needs a real
CUDA provider is mocked: ``onnxruntime.InferenceSession`` is wrapped (it runs
on CPU but records the providers it was given, and may report CUDA from
``get_providers()``), and the OrtValue constructors record the device they
were asked for while returning CPU OrtValues, so the session still trains.
What this checks:

- the providers a user passes reach every onnxruntime session unchanged;
- ``device_of`` / ``state_device`` read them;
- with CUDA, every state buffer is asked of onnxruntime on ('cuda', id), and
  the IOBinding binds the state outputs to those buffers;
- fused kernels stay off (the kernel choice, ``executed.KERNELS``; ``fused_kernels=True`` is
  refused: tests/runtime/test_fused_kernels.py::test_fused_kernels_true_is_refused_off_cpu);
- CUDA asked of an onnxruntime without it: onnxruntime warns and runs on CPU,
  the state lives on CPU, and training equals a CPU session bit for bit.

Not covered (needs a GPU): that onnxruntime really places the buffers and
kernels on the GPU, reading state back (``OrtValue.numpy()`` of a device
tensor in ``state``/``_diagnose``/``check_finite``/bound copies) and
numerics on CUDA.
"""

from __future__ import annotations

import copy
import warnings

import models
import numpy as np
import onnxruntime as ort
import pytest

from onnxtrain import TrainingSession
from onnxtrain.lower.executed import ExecOptions, execute
from onnxtrain.lower.lowering import ALGORITHM
from onnxtrain.runtime.executor import device_of, state_device

CUDA1 = [("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"]
REAL_SESSION = ort.InferenceSession
REAL_FROM_NUMPY = ort.OrtValue.ortvalue_from_numpy
REAL_FROM_SHAPE = ort.OrtValue.ortvalue_from_shape_and_type


def feeds(n=6, seed=1):
    rng = np.random.default_rng(seed)
    return {"X": rng.standard_normal((n, 4)).astype(np.float32),
            "label": rng.integers(0, 3, n).astype(np.int64)}


def spy_sessions(monkeypatch, reported=None) -> list:
    """Wrap onnxruntime.InferenceSession: record each call's providers (a
    deep copy, as given), run on CPU; ``reported``: what get_providers() says."""
    calls: list = []

    class Spy(REAL_SESSION):
        def __init__(self, path_or_bytes, sess_options=None, providers=None, provider_options=None,
                     **kwargs):
            calls.append(copy.deepcopy(providers))
            super().__init__(path_or_bytes, sess_options, providers=["CPUExecutionProvider"],
                             **kwargs)

        if reported is not None:
            def get_providers(self):
                return list(reported)

    monkeypatch.setattr(ort, "InferenceSession", Spy)
    return calls


def fake_cuda(monkeypatch) -> dict:
    """Pretend onnxruntime has CUDA: sessions report it, and device OrtValues
    are recorded ({id: (device type, id)}, values kept alive) but made on CPU."""
    made: dict = {}
    keep: list = []
    monkeypatch.setattr(ort, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    spy_sessions(monkeypatch, reported=["CUDAExecutionProvider", "CPUExecutionProvider"])

    def record(value, device_type, device_id):
        made[id(value)] = (device_type, device_id)
        keep.append(value)
        return value

    def from_numpy(arr, device_type="cpu", device_id=0, *args, **kwargs):
        if device_type == "cpu":
            return REAL_FROM_NUMPY(arr)
        # a device buffer holds its own copy of the array
        return record(REAL_FROM_NUMPY(np.array(arr, copy=True, order="C")), device_type, device_id)

    def from_shape(shape, element_type, device_type="cpu", device_id=0, *args, **kwargs):
        return record(REAL_FROM_SHAPE(shape, element_type), device_type, device_id)

    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_numpy", staticmethod(from_numpy))
    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_shape_and_type", staticmethod(from_shape))
    return made


def spy_bindings(monkeypatch) -> list:
    """Record every OrtValue bound to an IOBinding: (input|output, name, value)."""
    bound: list = []
    real_in, real_out = ort.IOBinding.bind_ortvalue_input, ort.IOBinding.bind_ortvalue_output

    def bind_in(self, name, value):
        bound.append(("input", name, value))
        return real_in(self, name, value)

    def bind_out(self, name, value):
        bound.append(("output", name, value))
        return real_out(self, name, value)

    monkeypatch.setattr(ort.IOBinding, "bind_ortvalue_input", bind_in)
    monkeypatch.setattr(ort.IOBinding, "bind_ortvalue_output", bind_out)
    return bound


def buffers(sess) -> list:
    store = sess._store
    return [v for v in list(store._current.values()) + list(store._spare.values()) if v is not None]


# ------------------------------------------------------------ providers passed through
@pytest.mark.parametrize("providers", [CUDA1, ["CPUExecutionProvider"],
                                       [("CPUExecutionProvider", {}), "AzureExecutionProvider"]])
def test_providers_reach_every_onnxruntime_session_unchanged(monkeypatch, providers):
    calls = spy_sessions(monkeypatch)
    given = copy.deepcopy(providers)
    sess = TrainingSession(models.mlp_classifier("adam"), providers=providers)
    sess.initialize()
    sess.train_step(feeds())
    sess.train_step(feeds(seed=2))
    sess.run({"X": feeds()["X"]})
    sess.evaluate_batch(feeds(), "loss")
    labels = {ex.label for ex in sess._runner.executors}
    assert labels == {"inference", "training_info[0].algorithm", "training_info[0].initialization",
                      "evaluate(training_info[0])"}
    assert len(calls) == len(labels)  # one onnxruntime session per program
    assert all(c == given for c in calls), calls
    assert providers == given  # the caller's list is not changed either


def test_no_providers_means_cpu(monkeypatch):
    calls = spy_sessions(monkeypatch)
    sess = TrainingSession(models.linear_regression())
    sess.train_step({"X": np.ones((2, 3), np.float32), "T": np.ones((2, 1), np.float32)})
    assert calls == [["CPUExecutionProvider"]]
    assert sess._store.device == ("cpu", 0)


# ------------------------------------------------------------ device_of
@pytest.mark.parametrize("providers, device", [
    (["CUDAExecutionProvider"], ("cuda", 0)),
    (["CUDAExecutionProvider", "CPUExecutionProvider"], ("cuda", 0)),
    ([("CUDAExecutionProvider", {})], ("cuda", 0)),
    (CUDA1, ("cuda", 1)),
    ([("CUDAExecutionProvider", {"device_id": "2"}), "CPUExecutionProvider"], ("cuda", 2)),
    (("CUDAExecutionProvider",), ("cuda", 0)),
    (["CPUExecutionProvider"], ("cpu", 0)),
    ([("CPUExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})], ("cpu", 0)),
    ([], ("cpu", 0)),
    (None, ("cpu", 0)),
])
def test_device_of(providers, device):
    assert device_of(providers) == device


def test_state_device_skips_providers_onnxruntime_lacks(monkeypatch):
    assert "CUDAExecutionProvider" not in ort.get_available_providers()  # this machine
    assert state_device(CUDA1) == ("cpu", 0)
    assert state_device(["CUDAExecutionProvider"]) == ("cpu", 0)
    assert state_device(None) == ("cpu", 0)
    monkeypatch.setattr(ort, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert state_device(CUDA1) == ("cuda", 1)
    assert state_device(["CPUExecutionProvider"]) == ("cpu", 0)


# ------------------------------------------------------------ state and bindings on the device
def test_cuda_state_buffers_and_bound_outputs_are_on_the_device(monkeypatch):
    made = fake_cuda(monkeypatch)
    bound = spy_bindings(monkeypatch)
    sess = TrainingSession(models.mlp_classifier("adam"), providers=CUDA1)
    assert sess._store.device == ("cuda", 1)
    state = list(sess.state_info)
    # the initial values: copied onto the device (new_buffer)
    assert all(made.get(id(sess._store._current[n])) == ("cuda", 1) for n in state)
    sess.initialize()
    losses = [float(sess.train_step(feeds(seed=s))["loss"]) for s in range(4)]
    assert all(np.isfinite(losses))
    # every buffer the state has been in since: made on the device (empty_like)
    assert len(buffers(sess)) > len(state)
    assert all(made.get(id(v)) == ("cuda", 1) for v in buffers(sess))
    assert set(made.values()) == {("cuda", 1)}
    # every update_binding output bound to a device buffer, and the state
    # inputs read from them; fetched outputs (loss) come back as numpy (CPU)
    outputs = [(name, v) for io, name, v in bound if io == "output"]
    inputs = [(name, v) for io, name, v in bound if io == "input"]
    algorithm = sess._programs.algorithms[0]
    assert {name for name, _ in outputs} >= set(algorithm.bound_values)
    assert "loss" not in {name for name, _ in outputs}
    assert all(made.get(id(v)) == ("cuda", 1) for _, v in outputs + inputs)
    assert {name for name, _ in inputs} >= set(algorithm.state_inputs)
    # inference reads the device buffers too, and load_state writes new ones there
    n = len(bound)
    sess.run({"X": feeds()["X"]})
    read = {name: v for io, name, v in bound[n:] if io == "input"}
    assert set(read) == {"W1", "b1", "W2", "b2"}
    assert all(made.get(id(v)) == ("cuda", 1) for v in read.values())
    sess.load_state({"W1": np.zeros((4, 8), np.float32)})
    assert made.get(id(sess._store._current["W1"])) == ("cuda", 1)
    # the same data flow as on CPU: the (CPU-backed) run trains identically
    monkeypatch.undo()
    cpu = TrainingSession(models.mlp_classifier("adam"), fused_kernels=False)
    cpu.initialize()
    assert losses == [float(cpu.train_step(feeds(seed=s))["loss"]) for s in range(4)]


def test_empty_like_and_new_buffer_pass_the_device(monkeypatch):
    from onnxtrain.runtime.executor import empty_like, new_buffer

    made = fake_cuda(monkeypatch)
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    buf = new_buffer(arr, ("cuda", 3))
    assert made[id(buf)] == ("cuda", 3)
    arr[0, 0] = 99.0  # a copy, not a view
    assert buf.numpy()[0, 0] == 0.0
    out = empty_like(buf, ("cuda", 3))
    assert made[id(out)] == ("cuda", 3)
    assert out.shape() == [2, 3] and out.data_type() == "tensor(float)"
    cpu = new_buffer(arr, ("cpu", 0))
    assert id(cpu) not in made and id(empty_like(cpu, ("cpu", 0))) not in made


# ------------------------------------------------------------ fused kernels
def test_kernel_choice_keeps_the_standard_program_off_cpu():
    # fused_kernels=True off CPU is refused at construction:
    # tests/runtime/test_fused_kernels.py::test_fused_kernels_true_is_refused_off_cpu
    sess = TrainingSession(models.mlp_classifier("adam"), fused_kernels=False)
    program = sess._programs.algorithms[0]
    for fused in (None, True):
        run = execute(program, ALGORITHM, ExecOptions(fused, device_of(CUDA1)[0]))
        assert run.model is program.model and run.library is None
        assert "CPU" in run.note


def test_cuda_session_runs_the_standard_program(monkeypatch):
    fake_cuda(monkeypatch)
    sess = TrainingSession(models.mlp_classifier("adam"), providers=CUDA1)
    sess.train_step(feeds())
    program = sess._programs.algorithms[0]
    assert sess.programs(executed=True)[program.label] is program.model
    assert "CPU provider only" in sess.fused_kernels_note


# ------------------------------------------------------------ CUDA asked, none there
@pytest.mark.parametrize("providers", [CUDA1, ["CUDAExecutionProvider"]])
def test_missing_cuda_falls_back_to_cpu_bit_for_bit(providers):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = TrainingSession(models.mlp_classifier("adam"), providers=providers)
        sess.initialize()
        got = [sess.train_step(feeds(seed=s)) for s in range(5)]
        pred = sess.run({"X": feeds()["X"]})
    assert any("CUDAExecutionProvider" in str(w.message) for w in caught)  # onnxruntime says so
    real = {tuple(ex._sess.get_providers()) for ex in sess._runner.executors}
    assert real == {("CPUExecutionProvider",)}
    assert {device_of(list(r)) for r in real} == {("cpu", 0)} == {sess._store.device}
    assert all(isinstance(v, ort.OrtValue) and v.device_name().lower() == "cpu" for v in buffers(sess))

    cpu = TrainingSession(models.mlp_classifier("adam"), providers=["CPUExecutionProvider"])
    cpu.initialize()
    want = [cpu.train_step(feeds(seed=s)) for s in range(5)]
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in g:
            np.testing.assert_array_equal(g[k], w[k])
    np.testing.assert_array_equal(pred["logits"], cpu.run({"X": feeds()["X"]})["logits"])
    for name, value in cpu.state.items():
        np.testing.assert_array_equal(sess.state[name], value, err_msg=name)
