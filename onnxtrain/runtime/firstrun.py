"""The first run's fresh memory, faulted in on another core while the session is built.

A session's first training step costs more than the next ones: onnxruntime's
arena grows into memory this process has never touched, and the step's
spare state buffers are new too.  Every such page costs a fault, which a
virtual machine's host backs at first touch (docs/performance.md, rounds 17,
23 and 27: W6's first step took 51,000 faults, a steady step none).  The
session is built on one core; the other is idle until the first run.

Where it is safe and pays (the CPU provider, onnxtrain's own session options,
a model under ``LARGE_MODEL_BYTES``, no data-parallel communicator,
``ONNXTRAIN_PREFAULT`` not 0), a session's ``FirstRun``:

- has its programs allocate from one onnxruntime arena of the process (an
  environment allocator, ``session.use_env_allocators``), which keeps what
  it was given until the process ends: a later session reuses the pages an
  earlier one faulted in;
- looks up how much anonymous memory the first run of the same model took
  last time (a ``firstrun`` entry of the startup cache, under a digest of
  the model's names and shapes, ``shape_key``) and, on a thread, faults that
  much of the arena in while the session is being built;
- then faults the step's spare state buffers in on the same thread, until
  the first run begins: the run writes the rest itself (a thread faulting
  beside the run's own threads would only slow it);
- measures its first training run (the growth of the process's anonymous
  memory, less the spares the thread left) and records it where no record
  exists, or where the run still grew by more than an eighth of what was
  faulted in ahead.

The first run waits for the arena's filling (one run of onnxruntime).  A
record only sizes what is faulted in:
a stale or wrong one (the model trained with another batch size) costs
memory or leaves faults, never a different result.
"""

from __future__ import annotations

import os
import platform
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ..core import diskcache
from ..core.env import env_switch
from ..io.model import ModelLike, load
from ..io.tensors import memory_limit, stored_bytes
from . import ortcache
from .executor import LARGE_MODEL_BYTES, as_numpy, device_of
from .options import Recipe

#: 0 (or false/no/off) turns the shared arena and its faulting off.
ENV = "ONNXTRAIN_PREFAULT"
#: One byte is written per page of this size (the smallest onnxruntime's systems use).
PAGE_BYTES = 4096
#: Bytes touched between two looks at whether the first run has begun.
TOUCH_BYTES = 4 << 20
#: At most this share of the machine's memory is ever faulted in ahead.
MAX_SHARE = 0.25
#: A first run that grows by more than 1/RECORD_AGAIN of what was faulted in ahead is recorded again.
RECORD_AGAIN = 8

_NOTHING = nullcontext()
_lock = threading.Lock()
#: Whether the shared arena is registered: None, not tried yet.
_arena: bool | None = None
#: The largest size faulted into the shared arena so far (it keeps its memory).
_faulted = 0
#: Sessions that used the shared arena so far (only the first one's run is measured).
_users = 0
#: ``expected``: [(the key a first run is also recorded under, the thread filling the arena for it)].
_expected: list[tuple[bytes, threading.Thread | None]] = []


def wanted(providers: Sequence[Any] | None, session_options: Any, data_parallel: bool) -> bool:
    """Whether a session of these settings uses the shared arena: the CPU
    provider, onnxtrain's own session options, not data-parallel (nor
    ``memory="lean"``, which runs the data-parallel cut); ``ONNXTRAIN_PREFAULT`` decides last."""
    switch = env_switch(ENV, "use 1 (fault a first run's memory in ahead) or 0")
    cpu = device_of(list(providers) if providers else None)[0] == "cpu"
    return cpu and session_options is None and not data_parallel and switch is not False


@contextmanager
def expected(source: Any, described: str, on: bool) -> Iterator[None]:
    """While a session of a model to be built from ``source`` (an inference
    model: a ModelProto or a path; ``described``: the build's options) is
    made (``build.training_session``): the first training program's
    session is made, and the arena filled, at once for the first run the
    last such session recorded under them, on the thread the session's
    ``FirstRun`` then takes over, and its first run is recorded under them
    too.  The builder's time is the thread's head start."""
    key = _source_key(source, described) if on else None
    if key is None or not shared_arena():
        yield
        return
    entry = diskcache.read("firstrun", key) if diskcache.enabled() else None
    thread = None
    if entry is not None:
        diskcache.count("firstrun.expected")
        thread = threading.Thread(target=_run_all, args=(_ahead_jobs(entry[0]),), name="onnxtrain-first-run")
        thread.start()
    with _lock:
        _expected[:] = [(key, thread)]
    try:
        yield
    finally:
        with _lock:
            _expected.clear()


def _source_key(source: Any, described: str) -> bytes | None:
    """``expected``'s key: a ModelProto's ``shape_key``, or a file's path, size and time."""
    if isinstance(source, onnx.ModelProto):
        basis = shape_key(source, LARGE_MODEL_BYTES)
    elif isinstance(source, (str, os.PathLike)):
        try:
            st = os.stat(source)
        except OSError:
            return None
        basis = f"{os.path.abspath(source)}:{st.st_size}:{st.st_mtime_ns}".encode()
    else:
        basis = None
    return None if basis is None else diskcache.make_key("firstrun", basis, described)


def load_faulting_ahead(model: ModelLike, on: bool) -> tuple[onnx.ModelProto, Path | None, FirstRun]:
    """``io.model.load(model)``, and the ``FirstRun`` of a session of it,
    begun before loading a ModelProto (a path or bytes: once parsed)."""
    first = FirstRun.begin(model, on) if isinstance(model, onnx.ModelProto) else None
    proto, base = load(model)
    return proto, base, first if first is not None else FirstRun.begin(proto, on)


def shared_arena() -> bool:
    """Register the process's shared CPU arena once; False where onnxruntime
    refuses.  (onnxruntime takes the registration of an application's own
    CPU arena, before or after, without a word: its sessions that ask for
    the environment's allocators and onnxtrain's then share one.)"""
    global _arena
    with _lock:
        if _arena is None:
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            try:  # kSameAsRequested: what is faulted in ahead is one block of that size
                ort.create_and_register_allocator(info, ort.OrtArenaCfg({"arena_extend_strategy": 1}))
                _arena = True
            except Exception:
                _arena = False
        return _arena


def shape_key(model: onnx.ModelProto, large_from: int) -> bytes | None:
    """A digest of what sizes a model's first run: the names, types and
    dims of its graphs' initializers, inputs and outputs, and its node
    counts; None for a model of ``large_from`` bytes of initializers or
    more, or one that cannot be read so (``load`` reports what is wrong)."""
    try:
        parts = [ort.__version__, platform.machine(), os.environ.get("ONNXTRAIN_THREADS", "")]
        nbytes = 0
        graphs = [model.graph] + [g for ti in model.training_info for g in (ti.algorithm, ti.initialization)]
        for g in graphs:
            parts.append(f"graph {len(g.node)}")
            for vi in list(g.input) + list(g.output):
                dims = [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
                parts.append(f"{vi.name}:{vi.type.tensor_type.elem_type}:{dims}")
            for t in g.initializer:
                parts.append(f"{t.name}:{t.data_type}:{list(t.dims)}")
                nbytes += stored_bytes(t) or 0
        if nbytes >= large_from:
            return None
        return diskcache.make_key("firstrun", "\n".join(parts))
    except Exception:
        return None


def anon_bytes() -> int | None:
    """The process's resident anonymous memory (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class FirstRun:
    """One session's faulting ahead and the measure of its first run (see the module)."""

    def __init__(self, on: bool = False, key: bytes | None = None) -> None:
        #: Whether the session's programs use the shared arena.
        self.on = on
        self.key = key
        #: Bytes the record asked to fault into the arena (None: no record).
        self.recorded: int | None = None
        #: Where the first run is recorded too (``expected``).
        self.also: bytes | None = None
        self._thread: threading.Thread | None = None
        self._touching: Touching | None = None
        self._measure = False
        #: The sessions the record names (``note``), and those this session noted.
        self._sessions: Any = None
        self._noted: list[tuple[bytes, Recipe]] | None = None

    @classmethod
    def begin(cls, model: onnx.ModelProto, on: bool, large_from: int = LARGE_MODEL_BYTES) -> FirstRun:
        """Start faulting in what the last first run of ``model`` took, where ``on``."""
        key = shape_key(model, large_from) if on else None
        if key is None or not shared_arena():
            return cls()
        global _users
        cached = diskcache.enabled()  # (off: no record read or written, the arena still shared)
        first = cls(True, key)
        entry = diskcache.read("firstrun", key) if cached else None
        if cached:
            diskcache.count("firstrun.miss" if entry is None else "firstrun.hit")
        with _lock:
            _users += 1
            first._measure = cached and _users == 1
            if _expected:  # (a filling begun before the model was built: this one waits for it)
                first.also, first._thread = _expected.pop()
        if entry is not None:
            first.recorded = int(entry[0].get("anon_bytes", 0))
            first._sessions = entry[0].get("sessions")
            # (a thread begun before the build made the session ahead already, and it
            # may be taken by now: made again, it would only hold the first run up)
            jobs = _ahead_jobs(entry[0])
            first._submit(_run_all, jobs[-1:] if first.also is not None else jobs)
        return first

    def note(self, ahead: list[tuple[bytes, Recipe]]) -> None:
        """The first training program's sessions: the entry of each one's
        optimized form and its options' recipe (``Executor.ahead``, a list
        the executor extends as it makes them), which its first run
        records, so that the next session of the model makes them ahead
        (the first note counts)."""
        if ahead and self._noted is None:
            self._noted = ahead

    def touch(self, buffers: Sequence[Any]) -> None:
        """Fault in ``buffers`` (CPU OrtValues or arrays nobody reads yet) on
        the thread, which holds them until it is done."""
        if buffers:
            self._touching = Touching(list(buffers))
            self._submit(self._touching.run)

    def wait(self) -> None:
        """Before any run: the buffers' touching stops where it is (the run
        faults in the rest as it writes them; two threads faulting beside
        the run's own would only slow it), and the arena's filling, one
        run of onnxruntime, ends."""
        thread = self._thread
        if thread is None:  # (every run asks: nothing to do after the first)
            return
        if self._touching is not None:
            self._touching.stop.set()
        thread.join()
        self._thread = None

    def measured(self, training: bool) -> AbstractContextManager[None]:
        """Around a run: the first training run's growth of anonymous memory
        is recorded, where no earlier session of this process used the
        shared arena (whose pages it would reuse), and there was no record
        or the run outgrew it (``RECORD_AGAIN``).  Any other run: nothing
        (no context made on a step's path)."""
        return self._measuring() if training and self._measure else _NOTHING

    @contextmanager
    def _measuring(self) -> Iterator[None]:
        self._measure = False
        before = anon_bytes()
        yield
        after = anon_bytes()
        if before is None or after is None:
            return
        # (the spares' pages the thread left are the run's own growth, not the arena's)
        left = self._touching.left if self._touching is not None else 0
        grown, ahead = after - before - left, self.recorded or 0
        # With pages faulted in ahead, a run that still grew by an eighth of
        # them needed more (a cold start's record is low: its first run reuses
        # what lowering freed); the rest of a run's growth is not the arena's.
        more = grown > 0 and (not ahead or grown * RECORD_AGAIN > ahead)
        # (recorded again where the sessions to make ahead changed, too)
        noted = None if self._noted is None else [[key.hex(), recipe.as_list()] for key, recipe in self._noted]
        if more or (noted is not None and noted != self._sessions):
            record = {"anon_bytes": ahead + grown if more else ahead, "sessions": noted}
            for key in (self.key, self.also):
                if key is not None:
                    diskcache.write("firstrun", key, record, b"")

    def _submit(self, job: Callable[..., None], *args: Any) -> None:
        """Run ``job(*args)`` on a thread of its own, after the jobs before it
        (best effort: a failure only leaves the pages to the run)."""
        before = self._thread

        def run() -> None:
            if before is not None:
                before.join()
            _quietly(job, *args)

        thread = threading.Thread(target=run, name="onnxtrain-first-run")
        thread.start()
        self._thread = thread


def _ahead_jobs(record: dict) -> list[Callable[[], None]]:
    """What a record asks of the thread, in order: the first training
    program's sessions made (``ortcache.make_ahead``; they are needed
    first), then the arena filled."""
    jobs = [partial(_fault_arena, int(record.get("anon_bytes", 0)))]
    sessions = record.get("sessions")
    made = [s for s in map(_recorded_session, sessions) if s is not None] if isinstance(sessions, list) else []
    if made:
        jobs.insert(0, partial(ortcache.make_ahead, made))
    return jobs


def _recorded_session(recorded: Any) -> tuple[bytes, Recipe] | None:
    """A record's [entry key in hex, recipe list], read (None: damaged)."""
    if not (isinstance(recorded, list) and len(recorded) == 2 and isinstance(recorded[0], str)):
        return None
    recipe = Recipe.from_list(recorded[1])
    try:
        return None if recipe is None else (bytes.fromhex(recorded[0]), recipe)
    except ValueError:
        return None


def _run_all(jobs: Sequence[Callable[[], None]]) -> None:
    """Each of ``jobs`` in order, each best effort (``_quietly``)."""
    for job in jobs:
        _quietly(job)


def _quietly(job: Callable[..., None], *args: Any) -> None:
    """``job(*args)``, best effort: a failure only leaves the pages to the run."""
    try:
        job(*args)
    except Exception:
        pass


def _fault_arena(nbytes: int) -> None:
    """Have the shared arena hold ``nbytes`` (above what it was given
    before) of pages already faulted in: a run of a one-node program whose
    output, allocated there and written whole, is freed at once."""
    global _faulted
    with _lock:
        more = min(nbytes, int(memory_limit() * MAX_SHARE)) - _faulted
        if more < (1 << 20):
            return
        _faulted += more
    filled = _filler().run_with_ort_values(["y"], {"n": ort.OrtValue.ortvalue_from_numpy(
        np.array([more // 4], np.int64))})
    del filled


_filler_session: list = []
_filler_lock = threading.Lock()


def _filler() -> ort.InferenceSession:
    """A session of ``ConstantOfShape`` on the shared arena, made once."""
    with _filler_lock:
        if not _filler_session:
            _filler_session.append(_make_filler())
        return _filler_session[0]


def _make_filler() -> ort.InferenceSession:
    value = onnx.helper.make_tensor("v", onnx.TensorProto.FLOAT, [1], [0.0])
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("ConstantOfShape", ["n"], ["y"], value=value)], "fill",
        [onnx.helper.make_tensor_value_info("n", onnx.TensorProto.INT64, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 11)], ir_version=7)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.add_session_config_entry("session.use_env_allocators", "1")
    so.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


class Touching:
    """Writes one byte per page of each buffer (their values are not read
    before a run writes them), ``TOUCH_BYTES`` at a time, until
    ``stop`` is set; ``left``: the bytes of pages not reached.  It holds
    the buffers, which keeps each one's memory while its numpy view is
    written."""

    def __init__(self, buffers: list[Any]) -> None:
        self.buffers = buffers
        self.stop = threading.Event()
        self.left = sum(as_numpy(b).nbytes for b in buffers)

    def run(self) -> None:
        buffers, self.buffers = self.buffers, []  # (held until this returns)
        for b in buffers:
            data = as_numpy(b).reshape(-1).view(np.uint8)
            for at in range(0, len(data), TOUCH_BYTES):
                if self.stop.is_set():
                    return
                chunk = data[at:at + TOUCH_BYTES]
                chunk[::PAGE_BYTES] = 0
                self.left -= len(chunk)
