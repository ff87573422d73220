"""onnxtrain's own onnxruntime session options: the defaults, the wait
policy per program, and ``Recipe``, the settled choices that make one
program's options again, in this process or the next (``ortcache.ahead``)."""

from __future__ import annotations

import os
import threading
from dataclasses import astuple, dataclass
from typing import Any

import onnx
import onnxruntime as ort

from ..core.env import env_switch

#: "0": idle intra-op threads block instead of spinning, "1": they spin, in
#: every program (default: chosen per program, ``spins``).
SPINNING_ENV = "ONNXTRAIN_SPINNING"
#: The ops after which a program's idle intra-op threads block rather than spin (``spins``).
BLOCKING_OPS = frozenset({"Conv", "ConvTranspose", "FusedConv", "QLinearConv", "ConvInteger"})


def spins(model: onnx.ModelProto) -> bool:
    """Whether a program's idle intra-op threads should spin (onnxruntime's
    ``session.intra_op.allow_spinning``): yes, unless it holds a convolution
    (``BLOCKING_OPS``).

    Measured (docs/performance.md, *Spinning per program*): spinning saves
    the wake-up of the pool's thread before each of the many small parallel
    kernels of an MLP, an RNN or a decoder (W1, W4, W7 faster by 15-30%,
    L1 and W6 level); a convolutional step spends its time in long
    convolution kernels, beside which a spinning idle thread takes a core
    from the thread that works (W2, W5 slower by 10-40% with spinning).
    ``ONNXTRAIN_SPINNING`` overrides the choice for every program.

    >>> from onnx import helper
    >>> g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"])], "g", [], [])
    >>> spins(helper.make_model(g)), spins(helper.make_model(helper.make_graph([], "h", [], [])))
    (False, True)
    """
    return not any(n.op_type in BLOCKING_OPS for n in model.graph.node)


def default_session_options(threads: int | None = None, spinning: bool | None = None) -> ort.SessionOptions:
    """Session options used unless the caller passes its own.

    - graph optimizations: ORT_ENABLE_ALL (constant folding, fusions such as
      Gemm+activation, layout transforms);
    - intra-op threads: ``threads``, else the ``ONNXTRAIN_THREADS`` environment
      variable, else onnxruntime's default (one per physical core);
    - one inter-op thread and sequential execution: a training program is a
      long chain of dependent kernels, parallel branches rarely pay;
    - the CPU memory arena and memory pattern planning stay on (the shapes of a
      training loop repeat, so buffers are reused from step to step);
    - idle intra-op threads spin as ``spinning`` says (the ``Executor``
      passes ``spins(model)``: not in convolutional programs; None:
      onnxruntime's default, they spin), unless ``ONNXTRAIN_SPINNING`` is
      set (1 or 0), which decides for every program; a machine shared with
      other busy processes may prefer blocking waits.
    """
    return _options(threads if threads is not None else _env_threads(), _env_spinning(spinning))


def _env_threads() -> int:
    env = os.environ.get("ONNXTRAIN_THREADS")
    return int(env) if env else 0


def _env_spinning(spinning: bool | None) -> bool | None:
    spin = env_switch(SPINNING_ENV, "use 1 (idle threads spin) or 0 (they block)")
    return spinning if spin is None else spin


def _options(threads: int, spinning: bool | None) -> ort.SessionOptions:
    """``default_session_options`` of settled values (0 threads: onnxruntime's default)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if spinning is not None:
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    # Errors come back as ExecutionError with onnxruntime's message: its own
    # logger would print them to stderr a second time.
    so.log_severity_level = 4
    return so


#: Session options that already have a custom-op library, by id (kept alive here).
_registered: dict[tuple[int, str], ort.SessionOptions] = {}
_registered_lock = threading.Lock()


def register_library(so: ort.SessionOptions, path: str) -> None:
    """Register a custom-op library once per SessionOptions object."""
    with _registered_lock:
        key = (id(so), path)
        if _registered.get(key) is not so:
            so.register_custom_ops_library(path)
            _registered[key] = so


@dataclass(frozen=True)
class Recipe:
    """What makes an ``Executor``'s own options for one program, every
    choice settled (the environment read once): the same recipe makes the
    same options, in another thread or a later process.  ``library``: the
    custom-op library the session registers (not part of ``options``)."""

    threads: int
    spinning: bool | None
    mem_pattern: bool
    shared_arena: bool
    library: str | None

    @classmethod
    def of(cls, model: onnx.ModelProto, mem_pattern: bool, shared_arena: bool, library: str | None) -> Recipe:
        """The recipe of a program ``model``'s session (``spins`` it, unless the environment says)."""
        return cls(_env_threads(), _env_spinning(spins(model)), mem_pattern, shared_arena, library)

    def options(self) -> ort.SessionOptions:
        so = _options(self.threads, self.spinning)
        so.enable_mem_pattern = self.mem_pattern
        if self.shared_arena:  # (the process's arena: ``runtime.firstrun``)
            so.add_session_config_entry("session.use_env_allocators", "1")
        return so

    def as_list(self) -> list[Any]:
        """JSON-ready; ``from_list`` reads it back."""
        return list(astuple(self))

    @classmethod
    def from_list(cls, values: Any) -> Recipe | None:
        """The recipe ``as_list`` wrote, or None for anything else (a damaged record)."""
        if not isinstance(values, list) or len(values) != 5:
            return None
        threads, spinning, mem_pattern, shared_arena, library = values
        ok = (type(threads) is int and (spinning is None or type(spinning) is bool) and type(mem_pattern) is bool
              and type(shared_arena) is bool and (library is None or isinstance(library, str)))
        return cls(threads, spinning, mem_pattern, shared_arena, library) if ok else None
