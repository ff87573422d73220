"""The only module that imports onnxruntime: compile a program once, run it many times.

- ``Executor``: one compiled onnxruntime session of one program.  ``run`` takes
  and returns numpy arrays; ``run_bound`` is the hot path: state tensors go in
  and out as OrtValues through IOBinding, so a training step copies no state.
- ``new_buffer`` / ``empty_like``: the OrtValues that ``onnxtrain.runtime.state``'s
  StateStore keeps the state variables in.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Container, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ..core.graph import node_inputs, prune
from ..errors import ExecutionError, TrainingModelError
from ..io import mapped, tensors
from ..kernels import nchwc
from . import ortcache
from .options import Recipe, register_library
from .options import default_session_options as default_session_options  # (public here: docs/architecture.md)


def _max_ir_version() -> int:
    """The newest IR version this onnxruntime loads, probed once at import with
    a one-node model (a capability, not a version table: releases keep
    coming).  Between the newest IR that onnx writes and 7 (the first with
    training_info); a probe that loads nothing falls back to 10."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "ir_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    so = ort.SessionOptions()
    so.log_severity_level = 4
    for version in range(onnx.IR_VERSION, 6, -1):
        model.ir_version = version
        try:
            ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        except Exception:  # this IR version is too new for it
            continue
        return version
    return 10


#: Programs are lowered to this IR version before onnxruntime sees them.
MAX_IR_VERSION = _max_ir_version()


#: The NCHWc contrib-op domain of onnxruntime's CPU provider.
NCHWC_DOMAIN = nchwc.DOMAIN
_nchwc_block: int | None = None


def nchwc_block() -> int:
    """The channel block of onnxruntime's NCHWc convolutions on this machine
    (MLAS's: 16 with AVX-512, 8 with AVX2), or 0 where it has none (or one
    below 8).  Read off
    what ReorderInput makes of four channels (it pads channels to the block), on
    first use; the layout of the filters ``nchwc.rewrite`` reorders."""
    global _nchwc_block
    if _nchwc_block is None:
        from onnx import TensorProto, helper

        graph = helper.make_graph(
            [helper.make_node("ReorderInput", ["x"], ["y"], domain=NCHWC_DOMAIN)], "nchwc_probe",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 1, 1])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13),
                                                        helper.make_opsetid(NCHWC_DOMAIN, 1)])
        model.ir_version = min(MAX_IR_VERSION, 8)
        so = ort.SessionOptions()
        so.log_severity_level = 4
        try:
            sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
            (y,) = sess.run(None, {"x": np.ones((1, 4, 1, 1), np.float32)})
            # (4 channels come back as 4 both for a block of 4 and for
            # none, so blocks below 8 are not used)
            block = int(y.shape[1]) if y.ndim == 4 and y.shape[1] >= 8 else 0
        except Exception:  # a build without the NCHWc kernels
            block = 0
        _nchwc_block = block
    return _nchwc_block


def contiguous(arr: np.ndarray) -> np.ndarray:
    """C-contiguous, keeping 0-d arrays 0-d (np.ascontiguousarray would make them 1-d)."""
    return arr if arr.flags.c_contiguous else np.array(arr, order="C")


def available_providers() -> list[str]:
    return list(ort.get_available_providers())


def device_of(providers: Sequence[Any] | None) -> tuple[str, int]:
    """Where state lives for these providers: ('cuda', id) or ('cpu', 0)."""
    for p in providers or ():
        name, opts = (p, {}) if isinstance(p, str) else (p[0], p[1])
        if name == "CUDAExecutionProvider":
            return "cuda", int(opts.get("device_id", 0))
    return "cpu", 0


def state_device(providers: Sequence[Any] | None) -> tuple[str, int]:
    """``device_of`` the providers this onnxruntime has: one it lacks, it skips
    (with a warning) and runs on the next, CPU in the end; so does the state."""
    have = set(ort.get_available_providers())
    return device_of([p for p in providers or () if (p if isinstance(p, str) else p[0]) in have])


#: Weights and state of at least this many bytes make a session's model large
#: (see ``Executor``): memory then matters more than allocation speed.
LARGE_MODEL_BYTES = 2**28
#: Weights and state under this many bytes make a session's model small: its
#: training steps keep onnxruntime's memory pattern (see ``ProgramRunner``).
SMALL_MODEL_BYTES = 2**23
#: Shared (mapped) weights of at least this many bytes in one program turn
#: onnxruntime's weight prepacking off (``Executor._share_mapped``).
PREPACK_LIMIT = int(float(os.environ.get("ONNXTRAIN_PREPACK_LIMIT", 2**28)))
#: id(SessionOptions) -> (the options, {name: OrtValue given as an initializer}).
_shared_names: dict[int, tuple[ort.SessionOptions, dict[str, ort.OrtValue]]] = {}
#: (path, offset, dtype, shape) -> the OrtValue over that mapped range, while in use.
_shared_values: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_shared_lock = threading.Lock()


#: Products whose second input onnxruntime packs once, at session creation, when it is a constant.
_PACKED_PRODUCTS = {("", "MatMul"), ("", "Gemm"), ("com.microsoft", "FusedMatMul")}


def _packed_twice(graph: onnx.GraphProto, shared: Container[str]) -> bool:
    """Whether some shared weight is the packed operand of two products (a
    frozen weight's forward MatMul and its backward Gemm): onnxruntime would
    keep a packed copy of it for each, besides the shared one (issue 36)."""
    seen: set[str] = set()
    for n in graph.node:
        domain = "" if n.domain == "ai.onnx" else n.domain
        if (domain, n.op_type) in _PACKED_PRODUCTS and len(n.input) > 1 and n.input[1] in shared:
            if n.input[1] in seen:
                return True
            seen.add(n.input[1])
    return False


def _config_entry(sess: ort.InferenceSession, key: str, default: str) -> str:
    """A session's config entry, or ``default`` where it was not set."""
    try:
        return sess.get_session_options().get_session_config_entry(key)
    except Exception:  # not set
        return default


def _shared_value(t: onnx.TensorProto) -> ort.OrtValue:
    """One OrtValue per mapped range in the process (over ``mapped.array``)."""
    arr = mapped.array(t)
    key = (*mapped.source(t), arr.dtype.str, arr.shape)
    with _shared_lock:
        value = _shared_values.get(key)
        if value is None:
            value = ort.OrtValue.ortvalue_from_numpy(arr)  # keeps arr (the map) alive
            _shared_values[key] = value
    return value


def _set_default(so: ort.SessionOptions, key: str, value: str) -> None:
    """Set a config entry unless the options have one already."""
    try:
        so.get_session_config_entry(key)
    except Exception:  # not set
        so.add_session_config_entry(key, value)


class Executor:
    """One compiled onnxruntime session of one program."""

    def __init__(
        self,
        model: onnx.ModelProto,
        providers: Sequence[Any] | None = None,
        session_options: ort.SessionOptions | None = None,
        label: str = "program",
        custom_ops_library: str | None = None,
        large: bool = False,
        fold_constants: bool = True,
        mem_pattern: bool = True,
        prune_unfetched: bool = False,
        shared_arena: bool = False,
    ) -> None:
        """``large``: the model's weights and state are large (``LARGE_MODEL_BYTES``
        or more): with default options, onnxruntime's memory pattern is off,
        so a step's temporaries (gradients the size of the weights) are not
        kept twice (the first run's arena blocks, then the planned pattern's).
        The CPU arena stays on: with it off, every large temporary was a fresh
        allocation and fresh pages each step (L2, a 0.5 B LoRA: 16.0 s a step
        against 12.3 s, and a higher peak; docs/performance.md).
        ``fold_constants=False``: onnxruntime's constant folding is off (an
        initialization program's ConstantOfShape would otherwise become a
        second, folded copy of each tensor it fills).  ``mem_pattern=False``:
        with default options, no memory pattern (planned from the first run
        and kept besides the arena's blocks): the choice of a model built to
        save activation memory (``recompute=``), measured in docs/large-models.md.
        ``prune_unfetched``: a run that fetches some outputs only (or none but
        state outputs) runs a second session of the program pruned to those,
        when pruning drops nodes (onnxruntime computes every output of a graph,
        bound or not: a builder's BatchNorm model would run its inference-mode
        forward pass on every step for the outputs nobody fetched); it is
        loaded as this one is, from the cache of optimized forms.
        ``shared_arena``: with default options, onnxruntime allocates from the
        process's shared arena (``runtime.firstrun``).
        With default options, idle threads spin as ``spins(model)`` decides."""
        self.label = label
        if model.ir_version > MAX_IR_VERSION:
            capped = onnx.ModelProto()
            capped.CopyFrom(model)
            capped.ir_version = MAX_IR_VERSION
            model = capped
        own = session_options is None
        recipe = Recipe.of(model, mem_pattern and not large, shared_arena, custom_ops_library) if own else None
        so = recipe.options() if recipe is not None else session_options
        providers = list(providers) if providers else ["CPUExecutionProvider"]
        #: OrtValues over mapped weights, handed to onnxruntime without a copy (kept alive here).
        self.shared: dict[str, ort.OrtValue] = {}
        weights = None  # the shared weights, as the cache of optimized forms names them
        cacheable = True
        if tensors.has_mapped(model):
            model, weights = self._share_mapped(model, so, label, own=own)
            cacheable = weights is not None
        #: (the key of each session's optimized form, the recipe of its options),
        #: in the order made (this program's, then its pruned ones): what a later
        #: process may make ahead (``ortcache.ahead``).
        self.ahead: list[tuple[bytes, Recipe]] = []
        self._recipe = recipe
        try:
            if custom_ops_library:
                register_library(so, custom_ops_library)
            self._sess = self._session(model.SerializeToString(), so, providers, custom_ops_library,
                                       cacheable, weights, fold_constants)
        except Exception as exc:  # onnxruntime raises its own exception types
            raise TrainingModelError(f"{label}: onnxruntime cannot load it: {exc}") from exc
        self.device = device_of(self._sess.get_providers())
        # What a pruned session needs: the model and how this one was made.
        # (not where the options write the optimized model to a file: the pruned
        # session would write over it)
        self._prunable = None
        if prune_unfetched and not so.optimized_model_filepath:
            self._prunable = (model, so, providers, custom_ops_library, fold_constants)
        self._pruned: dict[frozenset, ort.InferenceSession | None] = {}
        self.input_names = [i.name for i in self._sess.get_inputs()]
        self.output_names = [o.name for o in self._sess.get_outputs()]
        self._local = threading.local()

    def _session(self, data: bytes, so: ort.SessionOptions, providers: list, library: str | None,
                 cacheable: bool, weights: ortcache.SharedWeights | None,
                 fold_constants: bool) -> ort.InferenceSession:
        """onnxruntime's session of the serialized program ``data``: the one made
        ahead on another thread (``runtime.firstrun``), or one of onnxruntime's
        optimized form where the cache has it (``cacheable``), or of ``data``.
        Notes in ``ahead`` what a later process may make ahead."""
        disabled = None if fold_constants else ["ConstantFolding"]
        keyed = ortcache.ort_key(data, so, providers, library, self.label,
                                 weights) if cacheable and not disabled else None
        ahead = None if keyed is None or self._recipe is None or weights is not None else (keyed.key, self._recipe)
        if ahead is not None:
            self.ahead.append(ahead)
        # made on another thread from the same entry and recipe, where it was (runtime.firstrun)
        sess = ortcache.ahead(*ahead) if ahead is not None else None
        found = None
        if keyed is not None and sess is None:
            found = ortcache.ort_model(keyed, data, so, library, weights, self._recipe is not None)
        if found is not None and found[0] is not None:
            level = so.graph_optimization_level
            if self._recipe is not None:  # our options: its rewrites are done
                so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            try:
                sess = ort.InferenceSession(found[0], sess_options=so, providers=providers)
            except Exception:  # not trusted: drop it and load the model itself
                found[1]()
            finally:
                so.graph_optimization_level = level
        if sess is None:
            try:
                sess = ort.InferenceSession(data, sess_options=so, providers=providers,
                                            disabled_optimizers=disabled)
            finally:
                if found is not None and found[0] is None:
                    found[1]()  # it saved its optimized form: stored later
        return sess

    def _share_mapped(self, model: onnx.ModelProto, so: ort.SessionOptions, label: str,
                      own: bool) -> tuple[onnx.ModelProto, ortcache.SharedWeights | None]:
        """Hand the model's mapped weights (``onnxtrain.io.mapped``) to onnxruntime
        without copying them, and return the model to compile with the
        weights as the cache of optimized forms names them (``SharedWeights``).

        Each main-graph initializer that is mapped becomes a shared initializer
        (``SessionOptions.add_initializer``) over the process-wide memory map
        of its range, so every program of every session reads the same pages.
        The placeholders keep pointing at the real file (relative to "/"),
        so that onnxruntime's checks of external data pass and anything it
        might read itself is the right data.  Prepacking, which would copy
        each MatMul/Gemm weight into a packed buffer of the same size, is
        turned off when the shared weights reach ``PREPACK_LIMIT`` bytes (see
        docs/large-models.md for its cost), or when one of them would be
        packed twice (``_packed_twice``), unless the session options say
        otherwise."""
        out = onnx.ModelProto()
        out.CopyFrom(model)
        # A main-graph Constant of a mapped value (an initialization graph's
        # starting weights) becomes an initializer, shared like the others.
        constants = [n for n in out.graph.node if n.op_type == "Constant" and n.domain in ("", "ai.onnx")
                     and len(n.attribute) == 1 and n.attribute[0].name == "value"
                     and mapped.is_mapped(n.attribute[0].t)]
        for n in constants:
            t = out.graph.initializer.add()
            t.CopyFrom(n.attribute[0].t)
            t.name = n.output[0]
            out.graph.node.remove(n)
        # Options of our own serve this executor alone; the caller's may serve
        # several programs, which must agree on what each name holds.
        added = {} if own else _shared_names.setdefault(id(so), (so, {}))[1]
        total = 0
        for t in out.graph.initializer:
            if not mapped.is_mapped(t):
                continue
            value = _shared_value(t)
            known = added.get(t.name)
            if known is None:
                so.add_initializer(t.name, value)
                added[t.name] = value
            elif known is not value:
                raise TrainingModelError(
                    f"{label}: these session options already give onnxruntime another tensor "
                    f"named {t.name!r} (from another model); pass fresh session options"
                )
            self.shared[t.name] = value
            total += mapped.source(t)[2]
        weights = ortcache.SharedWeights.of(out, list(self.shared))
        mapped.rooted(out, copy=False)
        _set_default(so, "session.model_external_initializers_file_folder_path", "/")
        if total >= PREPACK_LIMIT or _packed_twice(out.graph, self.shared):
            _set_default(so, "session.disable_prepacking", "1")
        return out, weights

    @property
    def prepacking(self) -> bool:
        """Whether onnxruntime packs this session's constant product weights
        (its ``session.disable_prepacking``; onnxruntime's default: it does)."""
        return _config_entry(self._sess, "session.disable_prepacking", "0") != "1"

    @property
    def spinning(self) -> bool:
        """Whether this session's idle intra-op threads spin (its
        ``session.intra_op.allow_spinning``; onnxruntime's default: they do)."""
        return _config_entry(self._sess, "session.intra_op.allow_spinning", "1") != "0"

    def _pruner(self):
        """What a binding asks for its pruned session (None: never pruned)."""
        return self.pruned_session if self._prunable is not None else None

    def pruned_session(self, outputs: frozenset) -> ort.InferenceSession | None:
        """The session of this program pruned to ``outputs`` (made on first
        use), or None where pruning drops no node or was not asked for."""
        if self._prunable is None:
            return None
        if outputs in self._pruned:
            return self._pruned[outputs]
        model, so, providers, library, fold_constants = self._prunable
        kept = prune(list(model.graph.node), outputs)
        live = {id(n) for n in kept}
        sess = None
        # (dead Constants cost nothing: onnxruntime drops them at load)
        if any(id(n) not in live and n.op_type != "Constant" for n in model.graph.node):
            small = onnx.ModelProto()
            small.CopyFrom(model)
            del small.graph.node[:]
            small.graph.node.extend(kept)
            outs = [o for o in small.graph.output if o.name in outputs]
            del small.graph.output[:]
            small.graph.output.extend(outs)
            used = {i for n in kept for i in node_inputs(n)} | set(outputs)
            inits = [t for t in small.graph.initializer if t.name in used]
            del small.graph.initializer[:]
            small.graph.initializer.extend(inits)
            try:  # (through the cache of optimized forms, as this one: not with weights shared)
                sess = self._session(small.SerializeToString(), so, providers, library, not self.shared,
                                     None, fold_constants)
            except Exception:  # (the full program still runs)
                sess = None
        self._pruned[outputs] = sess
        return sess

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None
    ) -> list[np.ndarray]:
        """Run with numpy feeds and return numpy outputs (in ``output_names`` order)."""
        try:
            return self._sess.run(list(output_names) if output_names else None, dict(feeds))
        except Exception as exc:
            raise ExecutionError(f"{self.label}: onnxruntime failed: {exc}") from exc

    def run_bound(
        self,
        feeds: Mapping[str, np.ndarray],
        state_in: Mapping[str, ort.OrtValue],
        state_out: Mapping[str, ort.OrtValue],
        fetch: Sequence[str],
        to_numpy: bool = True,
    ) -> dict[str, Any]:
        """The hot path: bind numpy feeds, state OrtValues in and out, run once.

        ``state_out`` maps output names to preallocated buffers onnxruntime
        writes into.  The other outputs in ``fetch`` come back as numpy arrays
        (or OrtValues with ``to_numpy=False``).  Bindings are cached per
        thread and per set of state buffers, so with double buffering a step
        rebinds only its feeds and fetched outputs.  A run that asks for no
        output at all is not made: a graph has no effect but its outputs, and
        onnxruntime refuses such a run (a forward pass that feeds no state and
        whose results nobody fetches)."""
        if not fetch and not state_out:
            return {}
        cache: dict = getattr(self._local, "bindings", None)
        if cache is None:
            cache = self._local.bindings = {}
        key = (tuple(map(id, state_in.values())), tuple(map(id, state_out.values())), tuple(fetch))
        entry = cache.get(key)
        if entry is None:
            if len(cache) >= 4:
                cache.clear()
            entry = cache[key] = _Binding(self._sess, state_in, state_out, self._pruner())
        return self._run_entry(entry, feeds, fetch, len(state_out), to_numpy)


    def binding(self, state_in: Mapping[str, ort.OrtValue], state_out: Mapping[str, ort.OrtValue]) -> _Binding:
        """A binding of these state buffers, for a caller that keeps it (a step plan)."""
        return _Binding(self._sess, state_in, state_out, self._pruner())

    def run_binding(self, entry: _Binding, feeds, fetch: Sequence[str], n_state_out: int) -> dict[str, Any]:
        """Run a kept binding (see ``binding``); errors as ``run_bound`` raises them."""
        try:
            return entry.run(feeds, fetch, n_state_out, True)
        except Exception as exc:
            raise ExecutionError(f"{self.label}: onnxruntime failed: {exc}") from exc

    def _run_entry(self, entry: _Binding, feeds, fetch, n_state_out: int, to_numpy: bool) -> dict[str, Any]:
        try:
            return entry.run(feeds, fetch, n_state_out, to_numpy)
        except Exception as exc:
            raise ExecutionError(f"{self.label}: onnxruntime failed: {exc}") from exc


#: A fetched output of at most this many elements whose shape the program
#: declares in full is written into a buffer of its own, bound once, and
#: returned as a copy (``_Binding``).
STATIC_FETCH_ELEMENTS = 1 << 14


class _Binding:
    """One IOBinding with its state buffers bound once.

    Per run only the feeds and fetched outputs are bound.  It talks to
    onnxruntime's C-level binding objects directly where they exist: their
    public Python wrappers add checks (graph capture, reference tracking)
    that cost more than the whole run of a small model.

    A small fetched output of a static declared shape (a loss, a metric)
    gets a buffer of its own, bound once: each run then returns a copy of it,
    without binding the output again and collecting every output's OrtValue
    (onnxruntime checks a written shape against the declared one, so the
    buffer always fits).  Other fetched outputs are bound to a fresh
    allocation every run, since their shapes follow the feeds."""

    _CPU = None

    def __init__(self, sess: ort.InferenceSession, state_in, state_out, pruned=None) -> None:
        #: Executor.pruned_session, for runs that fetch some outputs only (``fewer``); weakly,
        #: as the executor keeps its bindings: a cycle would leave both, with their
        #: onnxruntime sessions, to the cyclic collector (which may run in a forked
        #: child, where destroying a session hangs).
        self.pruned = weakref.WeakMethod(pruned) if pruned is not None else None
        #: The outputs not bound as state: a run that fetches fewer runs a pruned session.
        self.fetchable = len(sess.get_outputs()) - len(state_out) if pruned is not None else 0
        #: Fetched outputs -> these buffers bound to the session pruned to them (False: none);
        #: the last fetch list asked (the runner's, the same object each step) and its answer.
        self.fewer: dict[tuple, _Binding | bool] = {}
        self.last: tuple[Any, _Binding | bool] = (None, False)
        binding = sess.io_binding()
        for name, value in state_in.items():
            binding.bind_ortvalue_input(name, value)
        for name, value in state_out.items():
            binding.bind_ortvalue_output(name, value)
        # Keep the OrtValues alive while cached, so their ids stay unique.
        self.keep = (list(state_in.values()), list(state_out.values()))
        self.state = (state_in, state_out)
        self.state_out_names = list(state_out)
        self.binding = binding
        self.fast = hasattr(binding, "_iobinding") and hasattr(sess, "_sess")
        self.c_binding = binding._iobinding if self.fast else None
        self.c_session = sess._sess if self.fast else None
        self.sess = sess
        self.feeds: dict[str, np.ndarray] = {}
        self.shapes: dict[str, tuple] = {}
        #: Inputs with a default (an initializer that is also a graph input):
        #: onnxruntime binds them as OrtValues only (its numpy binding looks
        #: the name up among the required inputs), and an unfed one must not
        #: keep the value an earlier run fed (``_bind_overrides``).
        self.overridable = frozenset(i.name for i in sess.get_overridable_initializers())
        #: The overridable inputs bound now, with the OrtValues over their feeds.
        self.overrides: dict[str, ort.OrtValue] = {}
        if self.fast and _Binding._CPU is None:
            _Binding._CPU = ort.OrtDevice.make("cpu", 0)._get_c_device()
        #: Output name -> its position among the bound outputs (binding order).
        self.position = {name: i for i, name in enumerate(state_out)}
        #: Output name -> (OrtValue, the numpy array over it), for static small outputs
        #: (made on the first fetch; CPU sessions on the fast path only).
        self.static: dict[str, tuple[ort.OrtValue, np.ndarray]] | None = None
        self.static_bound: set[str] = set()
        #: The last fetch sequence whose outputs are all bound to static buffers.
        self.all_static: Sequence[str] | None = None
        #: onnxruntime binds no string tensor: a program with a string input runs unbound.
        self.unbound = any(i.type == "tensor(string)" for i in sess.get_inputs())

    def _static_outputs(self) -> dict[str, tuple[ort.OrtValue, np.ndarray]]:
        out: dict[str, tuple[ort.OrtValue, np.ndarray]] = {}
        if device_of(self.sess.get_providers())[0] != "cpu":
            return out
        for o in self.sess.get_outputs():
            shape, dtype = o.shape, _NUMPY_OF_ORT.get(o.type)
            if (o.name in self.position or dtype is None or shape is None
                    or not all(isinstance(d, int) and d >= 0 for d in shape)
                    or int(np.prod(shape)) > STATIC_FETCH_ELEMENTS):
                continue
            arr = np.zeros(shape, dtype)
            out[o.name] = (ort.OrtValue.ortvalue_from_numpy(arr), arr)
        return out

    def run(self, feeds, fetch, n_state_out: int, to_numpy: bool) -> dict[str, Any]:
        if self.unbound:
            return self._run_unbound(feeds, fetch, to_numpy)
        if len(fetch) < self.fetchable:  # (some outputs only: the program pruned to them)
            last = self.last
            if last[0] is not fetch:
                last = self.last = (fetch, self._fewer(fetch))
            if last[1]:
                return last[1].run(feeds, fetch, n_state_out, to_numpy)
        # Re-bind fetched outputs: otherwise onnxruntime reuses the previous
        # run's buffer, whose shape is wrong once the batch size changes.
        if self.overridable and (self.overrides or not self.overridable.isdisjoint(feeds)):
            feeds = self._bind_overrides(feeds)
        if self.fast:
            c = self.c_binding
            bound = self.feeds
            rebound = len(feeds) != len(bound)
            for name, arr in feeds.items():
                # The binding points at the array's memory: the same array object
                # with the same shape needs no new binding (staging-buffer loops
                # that np.copyto each batch into one array rebind nothing).
                old = bound.get(name)
                if old is not arr or old.shape != self.shapes.get(name):
                    c.bind_input(name, arr)
                    self.shapes[name] = arr.shape
                    rebound = True
            static = self.static
            if static is None and fetch and to_numpy:
                static = self.static = self._static_outputs()
            if not to_numpy or static is None:
                static = {}
            if fetch and fetch is self.all_static:  # (a program's output list: never changed once built)
                if rebound:
                    self.feeds = dict(feeds)
                self.c_session.run_with_iobinding(c, None)
                return {name: static[name][1].copy() for name in fetch}
            position = self.position
            dynamic = False
            for name in fetch:
                if name in static:
                    if name not in self.static_bound:  # (once: the public binding's checks)
                        self.binding.bind_ortvalue_output(name, static[name][0])
                        self.static_bound.add(name)
                else:
                    c.bind_output(name, self._CPU)
                    self.static_bound.discard(name)
                    dynamic = True
                position.setdefault(name, len(position))
            if rebound:
                self.feeds = dict(feeds)  # the arrays must outlive the binding's use of them
            self.c_session.run_with_iobinding(c, None)
            if not fetch:
                return {}
            if not dynamic:
                if isinstance(fetch, (list, tuple)):
                    self.all_static = fetch  # this very sequence: nothing to bind next time
                return {name: static[name][1].copy() for name in fetch}
            values = c.get_outputs()
            if not to_numpy:
                return {name: values[position[name]] for name in fetch}
            return {name: static[name][1].copy() if name in static else values[position[name]].numpy()
                    for name in fetch}
        else:
            b = self.binding
            for name, arr in feeds.items():
                b.bind_cpu_input(name, arr)
            for name in fetch:
                b.bind_output(name, "cpu")
            self.sess.run_with_iobinding(b)
            if not fetch:
                return {}
            values = b.get_outputs()
        # Outputs come back in binding order: state outputs first, then fetches.
        if to_numpy:
            return {name: values[n_state_out + i].numpy() for i, name in enumerate(fetch)}
        return {name: values[n_state_out + i] for i, name in enumerate(fetch)}

    def _fewer(self, fetch: Sequence[str]) -> _Binding | bool:
        """These buffers bound to the session pruned to the state outputs and
        ``fetch`` (made once; False where pruning drops nothing)."""
        fewer = self.fewer.get(tuple(fetch))
        if fewer is None:
            pruned = self.pruned()
            sess = pruned(frozenset(self.state_out_names).union(fetch)) if pruned is not None else None
            fewer = self.fewer[tuple(fetch)] = False if sess is None else _Binding(sess, *self.state)
            if sess is None and not fetch:  # (nothing pruned for the state alone: nor for more)
                self.fetchable = 0
        return fewer

    def _bind_overrides(self, feeds: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """Bind the fed overridable inputs as OrtValues; the other feeds, to bind as usual.

        An overridable input bound by an earlier run but not fed now would
        keep that run's value: then every input is unbound and bound again
        (the state buffers included), and onnxruntime uses its default."""
        fed = {name: arr for name, arr in feeds.items() if name in self.overridable}
        if not self.overrides.keys() <= fed.keys():
            self.binding.clear_binding_inputs()
            for name, value in self.state[0].items():
                self.binding.bind_ortvalue_input(name, value)
            self.overrides = {}
            self.feeds, self.shapes = {}, {}
        for name, arr in fed.items():
            value = self.overrides.get(name)
            if value is None or value.numpy() is not arr:  # (an OrtValue over the array itself)
                value = ort.OrtValue.ortvalue_from_numpy(arr)
                self.binding.bind_ortvalue_input(name, value)
                self.overrides[name] = value
        return {name: arr for name, arr in feeds.items() if name not in fed}


    def _run_unbound(self, feeds, fetch, to_numpy: bool) -> dict[str, Any]:
        """One run through ``InferenceSession.run`` (string feeds): the state
        OrtValues fed as they are, the new state copied into its buffers
        after the run (every value is read before any is written)."""
        state_in, state_out = self.state
        names = [*state_out, *fetch]
        if not names:
            return {}
        values = self.sess.run(names, {**feeds, **state_in})
        for buffer, value in zip(state_out.values(), values):
            copy_into(buffer, value)
        out = dict(zip(fetch, values[len(state_out):]))
        if to_numpy:
            return out
        return {n: v if v.dtype == object else owned_ortvalue(v) for n, v in out.items()}


# ------------------------------------------------------- state buffers
def new_buffer(arr: np.ndarray, device: tuple[str, int]) -> ort.OrtValue:
    """An OrtValue on ``device`` holding its own copy of ``arr``."""
    kind, index = device
    if kind == "cpu":
        # The OrtValue wraps (and keeps alive) its own copy of the array.
        return ort.OrtValue.ortvalue_from_numpy(np.array(arr, copy=True, order="C"))
    return ort.OrtValue.ortvalue_from_numpy(contiguous(arr), kind, index)


def as_numpy(value: ort.OrtValue | np.ndarray) -> np.ndarray:
    """The numpy array of a CPU OrtValue (a view of its buffer), or ``value`` itself."""
    return value.numpy() if isinstance(value, ort.OrtValue) else np.asarray(value)


def is_ortvalue(value: Any) -> bool:
    """Whether ``value`` is an ``onnxruntime.OrtValue`` (for layers that do not import onnxruntime)."""
    return isinstance(value, ort.OrtValue)


def owned_ortvalue(arr: np.ndarray) -> ort.OrtValue:
    """A CPU OrtValue owning a copy of ``arr`` (one made with
    ``ortvalue_from_numpy`` only borrows the array's memory), of the same
    shape (a 0-d array gives a 0-d OrtValue)."""
    arr = contiguous(np.asarray(arr))
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(arr.shape), arr.dtype)
    value.update_inplace(arr)
    return value


def copy_into(target: ort.OrtValue, arr: np.ndarray) -> None:
    """Copy ``arr`` into the buffer of the OrtValue ``target`` (same shape and type)."""
    target.update_inplace(arr)


def wrap_buffer(arr: np.ndarray) -> ort.OrtValue:
    """A CPU OrtValue over ``arr``'s own memory (no copy): what onnxruntime
    writes into it, numpy sees, and the other way round.  ``arr`` must be
    C-contiguous and outlive the OrtValue's use."""
    if not arr.flags.c_contiguous:
        raise ValueError("wrap_buffer: the array must be C-contiguous")
    return ort.OrtValue.ortvalue_from_numpy(arr)


def empty_like(value: ort.OrtValue, device: tuple[str, int]) -> ort.OrtValue:
    """An uninitialized OrtValue on ``device`` of ``value``'s type and shape."""
    kind, index = device
    dtype = _numpy_type(value.data_type())
    if kind == "cpu":
        return ort.OrtValue.ortvalue_from_numpy(np.empty(value.shape(), dtype=dtype))
    return ort.OrtValue.ortvalue_from_shape_and_type(value.shape(), dtype, kind, index)


_NUMPY_OF_ORT = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
}


def _numpy_type(ort_type: str) -> type:
    try:
        return _NUMPY_OF_ORT[ort_type]
    except KeyError:
        raise TrainingModelError(f"state of type {ort_type} is not supported") from None
