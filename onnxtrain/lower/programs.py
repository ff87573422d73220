"""The executable programs of a training model, and how their feeds are checked.

One program per use, each a plain ONNX model of standard ops made by the
pass list of its kind (``pipeline.PASS_LISTS``):

- ``inference``: the main graph M (``run``, ``predict``);
- ``training_info[i].algorithm``: M ⊕ A_i (``train_step``);
- ``training_info[i].initialization``: I_i (``initialize``);
- ``evaluate(training_info[i])``: M ⊕ A_i pruned to the loss and prediction,
  a forward pass through the model's own loss (``evaluate_batch``);
- for data-parallel training, M ⊕ A_i cut in two (``SplitAlgorithm``):
  forward + backward, then the update from the reduced gradients.

Feed checking lives here too: ``check_feed_names`` (every name known) and
``Program.check_feeds`` (dtype, rank, static sizes, shared symbolic sizes).
``ProgramSet`` holds every program of one model, each built once, and what
each is for (its role), for the session and its runner to share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from ..io.combine import uses_preview_ops
from ..io.model import TrainingModel
from . import program_cache
from .lowering import ALGORITHM, EVALUATE, FORWARD, INFERENCE, INITIALIZATION, UPDATE, Request, to_model
from .pipeline import lower
from .split import Reduced


@dataclass(frozen=True)
class FeedSpec:
    """What one input accepts, precomputed so a step checks feeds cheaply."""

    name: str
    dtype: np.dtype | None
    dims: tuple[int | None, ...] | None  # None: any rank; None entries: any size
    text: str  # e.g. "float32['N', 4]", for messages

    @classmethod
    def of(cls, vi: onnx.ValueInfoProto) -> FeedSpec:
        tt = vi.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)) if tt.elem_type else None
        dims = None
        shown: Any = ""
        if tt.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
            shown = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
        return cls(vi.name, dtype, dims, f"{dtype.name if dtype is not None else '?'}{shown}")

    def check(self, value: Any, caller: str) -> np.ndarray:
        """The feed as a C-contiguous array of the right dtype and rank (or ValueError)."""
        arr = value if value.__class__ is np.ndarray else self._convert(value, caller)
        dtype = arr.dtype
        if dtype.kind == "U" and self.dtype == np.object_:
            # a string tensor fed as numpy text ('<U3'): onnxruntime takes objects
            arr = arr.astype(object)
            dtype = arr.dtype
        if dtype is not self.dtype and dtype != self.dtype and self.dtype is not None:
            raise ValueError(
                f"{caller}: feed {self.name!r} has dtype {arr.dtype}, expected {self.text}"
            )
        dims = self.dims
        if dims is not None and arr.shape != dims:  # (equal: a fully static shape that fits)
            shape = arr.shape
            if len(shape) != len(dims):
                self._bad_shape(shape, caller)
            for axis, size in self.fixed:
                if shape[axis] != size:
                    self._bad_shape(shape, caller)
        if not arr.flags.c_contiguous:
            arr = np.array(arr, order="C")
        return arr

    @property
    def fixed(self) -> tuple[tuple[int, int], ...]:
        """(axis, size) of every statically known dimension."""
        cached = self.__dict__.get("_fixed")
        if cached is None:
            cached = tuple((a, d) for a, d in enumerate(self.dims or ()) if d is not None)
            object.__setattr__(self, "_fixed", cached)
        return cached

    def _convert(self, value: Any, caller: str) -> np.ndarray:
        if isinstance(value, np.ndarray):
            return value
        try:
            return np.asarray(value, dtype=self.dtype)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(
                f"{caller}: feed {self.name!r} cannot be converted to {self.dtype}: {exc}"
            ) from exc

    def _bad_shape(self, shape: tuple, caller: str) -> None:
        raise ValueError(
            f"{caller}: feed {self.name!r} has shape {list(shape)}, expected {self.text}"
        )


@dataclass
class Program:
    """A standard-op ONNX model plus how the session feeds and reads it."""

    label: str
    model: onnx.ModelProto
    #: Inputs the caller must feed: name -> ValueInfoProto.
    feeds: dict[str, onnx.ValueInfoProto] = field(default_factory=dict)
    #: Inputs that have a default (an initializer) and may be fed to override it.
    optional_feeds: dict[str, onnx.ValueInfoProto] = field(default_factory=dict)
    #: State variables read by the program (fed from the session's state).
    state_inputs: list[str] = field(default_factory=list)
    #: Output names in the order the program produces them.
    outputs: list[str] = field(default_factory=list)
    #: (state variable, output) pairs applied after a run.
    bindings: list[tuple[str, str]] = field(default_factory=list)
    #: Checks of the inputs above, and of state variables fed as overrides.
    feed_specs: list[FeedSpec] = field(default_factory=list)
    optional_specs: dict[str, FeedSpec] = field(default_factory=dict)
    state_specs: dict[str, FeedSpec] = field(default_factory=dict)
    #: Outputs a step returns: those no binding consumes, in program order.
    returned: list[str] = field(default_factory=list)
    #: Symbolic dims shared by several feeds: symbol -> [(feed, axis), ...].
    shared_dims: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    #: The binding plan: state variables written, the output each reads (first
    #: binding of an output), and (key, source key) pairs for outputs bound twice.
    bound_keys: tuple[str, ...] = ()
    bound_values: tuple[str, ...] = ()
    bound_copies: tuple[tuple[str, str], ...] = ()
    #: Every state variable a run writes: bound_keys, then the copies' keys.
    target_keys: tuple[str, ...] = ()

    def check_feeds(
        self, feeds: Mapping[str, Any], allow_state_override: bool, caller: str
    ) -> dict[str, np.ndarray]:
        """Checked numpy feeds (state variables come from the store unless
        ``allow_state_override`` lets a feed override one for this call)."""
        out: dict[str, np.ndarray] = {}
        for spec in self.feed_specs:
            try:
                value = feeds[spec.name]
            except KeyError:
                raise ValueError(
                    f"{caller}: missing feed {spec.name!r} (input of {self.label}, "
                    f"expected {spec.text})"
                ) from None
            out[spec.name] = spec.check(value, caller)
        if len(feeds) > len(out):
            for name, spec in self.optional_specs.items():
                if name in feeds:
                    out[name] = spec.check(feeds[name], caller)
            for name, spec in self.state_specs.items():
                if name in feeds:
                    if not allow_state_override:
                        raise ValueError(
                            f"{caller}: {name!r} is a state variable; set it with load_state(), "
                            "not as a feed"
                        )
                    out[name] = spec.check(feeds[name], caller)
        for symbol, places in self.shared_dims.items():
            # Kernels trust the model's shapes: a batch of 8 inputs and 3 labels
            # would make onnxruntime read past the shorter feed.
            sizes = {(n, a): out[n].shape[a] for n, a in places if n in out}
            if len(set(sizes.values())) > 1:
                found = ", ".join(f"{n}[{a}]={v}" for (n, a), v in sizes.items())
                raise ValueError(
                    f"{caller}: feeds disagree on the symbolic dimension {symbol!r}: {found}"
                )
        return out


def check_feed_names(feeds: Mapping[str, Any], known: frozenset[str], inputs: Iterable[str],
                     caller: str) -> None:
    """Refuse a feeds object that is not a mapping, or names nothing in ``known``."""
    try:
        if feeds.keys() <= known:
            return
    except AttributeError:
        raise TypeError(
            f"{caller}: feeds must be a dict of name -> array, not {type(feeds).__name__}"
        ) from None
    unknown = [k for k in feeds if k not in known]
    raise ValueError(
        f"{caller}: unknown feed {unknown[0]!r}; the model's inputs are {sorted(inputs)}"
    )


def build_program(tm: TrainingModel, kind: str, label: str, request: Request | None = None,
                  bindings: list[tuple[str, str]] | None = None, check: bool | None = None) -> Program:
    """The program of ``kind`` (``pipeline.PASS_LISTS``), lowered now."""
    model = to_model(lower(tm, label, [kind], request, check)[kind])
    return program_of(tm, label, model.graph, model, bindings)


def program_of(tm: TrainingModel, label: str, g: onnx.GraphProto, model: onnx.ModelProto,
               bindings: list[tuple[str, str]] | None = None) -> Program:
    """The Program of a lowered graph ``g`` (and its model)."""
    init_names = {t.name for t in g.initializer}
    program = Program(label=label, model=model, bindings=list(bindings or []))
    for vi in g.input:
        if vi.name in tm.state:
            program.state_inputs.append(vi.name)
        elif vi.name in init_names:
            program.optional_feeds[vi.name] = vi
        else:
            program.feeds[vi.name] = vi
    program.outputs = [o.name for o in g.output]
    program.feed_specs = [FeedSpec.of(vi) for vi in program.feeds.values()]
    program.optional_specs = {n: FeedSpec.of(vi) for n, vi in program.optional_feeds.items()}
    for vi in g.input:
        if vi.name in tm.state:
            program.state_specs[vi.name] = FeedSpec.of(vi)
    symbols: dict[str, list[tuple[str, int]]] = {}
    for vi in list(program.feeds.values()) + list(program.optional_feeds.values()):
        tt = vi.type.tensor_type
        if tt.HasField("shape"):
            for axis, d in enumerate(tt.shape.dim):
                if d.HasField("dim_param") and d.dim_param:
                    symbols.setdefault(d.dim_param, []).append((vi.name, axis))
    program.shared_dims = {k: v for k, v in symbols.items() if len(v) > 1}
    bound = {v for _, v in program.bindings}
    program.returned = [o for o in program.outputs if o not in bound]
    first: dict[str, str] = {}
    copies = []
    for key, value in program.bindings:
        if value in first:
            copies.append((key, first[value]))
        else:
            first[value] = key
    program.bound_keys = tuple(first.values())
    program.bound_values = tuple(first)
    program.bound_copies = tuple(copies)
    program.target_keys = program.bound_keys + tuple(k for k, _ in copies)
    return program


def cached_program(tm: TrainingModel, label: str, lower: Any,
                   bindings: list[tuple[str, str]] | None = None) -> Program:
    """The Program of ``label``, its lowered model from the program cache
    (``onnxtrain.lower.program_cache``) or from ``lower()`` (a model, whose errors are
    raised as usual), which is then stored.  ``label`` must name the program
    of ``tm`` exactly: it is part of the key."""
    model = program_cache.program_model(tm, label, lower)
    return program_of(tm, label, model.graph, model, bindings)


def inference_program(tm: TrainingModel, check: bool | None = None) -> Program:
    return cached_program(tm, "inference", lambda: to_model(lower(tm, "inference", [INFERENCE], None, check)[INFERENCE]))


def algorithm_program(tm: TrainingModel, index: int) -> Program:
    return algorithm_programs(tm, index)[0]


@dataclass
class SplitAlgorithm:
    """A training algorithm cut for data-parallel training (``onnxtrain.lower.split``).

    ``a`` binds the rank-local state; its outputs also include ``reduced``
    (the values summed across ranks).  ``b`` (None when nothing needs it)
    reads the reduced gradients and binds the other state.  ``bn`` binds
    reduced BatchNormalization statistics: (state variable, value) pairs.
    ``sums``: the reduced values are gradient sums over local accumulation
    steps (the model named them), not one batch's gradients."""

    label: str
    a: Program
    b: Program | None
    reduced: list[Reduced]
    bn: list[tuple[str, str]]
    sums: bool = False


def algorithm_programs(tm: TrainingModel, index: int, data_parallel: dict | None = None,
                       check: bool | None = None) -> tuple[Program, SplitAlgorithm | None]:
    """The program of ``training_info[index]``, and with ``data_parallel``
    (``{"local": [...], "reduce": [...] or None}``) its cut as well: the
    ``algorithm``, ``forward`` and ``update`` pass lists, whose common start
    (combine and the FRONT passes: autodiff) runs once for the three."""
    ti = tm.proto.training_info[index]
    label = f"training_info[{index}].algorithm"
    bindings = [(e.key, e.value) for e in ti.update_binding]
    if data_parallel is None:
        def build() -> onnx.ModelProto:
            return to_model(lower(tm, label, [ALGORITHM], Request(index), check)[ALGORITHM])

        return cached_program(tm, label, build, bindings), None
    reduce = data_parallel.get("reduce")
    request = Request(index, local=tuple(data_parallel.get("local", ())),
                      reduce=None if reduce is None else tuple(reduce))
    lows = lower(tm, label, [ALGORITHM, FORWARD, UPDATE], request, check)
    whole = to_model(lows[ALGORITHM])
    program = program_of(tm, label, whole.graph, whole, bindings)
    between = lows[FORWARD].between
    a_low = lows[FORWARD]
    a_model = to_model(a_low)
    a = program_of(tm, a_low.label, a_model.graph, a_model, between.local)
    a.returned = list(between.returned_a)
    b = None
    if UPDATE in lows:
        b_low = lows[UPDATE]
        b_model = to_model(b_low)
        b = program_of(tm, b_low.label, b_model.graph, b_model, between.updates)
        b.returned = list(between.returned_b)
    bn = [(r.key, r.name) for r in between.reduced if r.key is not None]
    return program, SplitAlgorithm(label, a, b, between.reduced, bn, sums=reduce is not None)


def initialization_program(tm: TrainingModel, index: int, check: bool | None = None) -> Program | None:
    ti = tm.proto.training_info[index]
    if not ti.HasField("initialization"):
        return None
    bindings = [(e.key, e.value) for e in ti.initialization_binding]
    # Not cached: the cache key leaves initialization graphs out (a builder's
    # holds the initial weights), and they have no training ops to lower.
    return build_program(tm, INITIALIZATION, f"training_info[{index}].initialization", Request(index),
                         bindings, check)


def loss_program(tm: TrainingModel, index: int, loss: str, prediction: str | None = None,
                 train_prediction: str | None = None, check: bool | None = None) -> Program:
    """The evaluation program of algorithm ``index``: its combined graph pruned
    to ``loss`` and ``prediction`` (``pipeline.loss_graph``); binds nothing."""
    outputs = tuple(n for n in (loss, prediction) if n is not None)
    request = Request(index, outputs, prediction, train_prediction)
    return build_program(tm, EVALUATE, f"evaluate(training_info[{index}])", request, [], check)


#: What a program is for (``ProgramSet.role``): its kind, ``INFERENCE``,
#: ``ALGORITHM``, ``FORWARD``, ``UPDATE``, ``INITIALIZATION`` or ``EVALUATE``
#: (``lowering``), whose pass lists made it and whose executed lists the
#: runner runs (``executed.EXECUTED``).
ROLES = (INFERENCE, ALGORITHM, FORWARD, UPDATE, INITIALIZATION, EVALUATE)


class ProgramSet:
    """Every program of one training model, each built once, and its role.

    Built at construction, so that model errors surface there: every
    algorithm (with ``data_parallel``, its cut into a forward and an update
    half as well; each lowers the main graph too) and any initialization
    graph with training ops.  The inference program (what ``run`` and
    ``programs()`` use, not a training step: L1's costs 0.3 s with a cold
    cache), the other initialization programs (only ``initialize()`` runs
    them; a builder's holds its starting values as constants, nothing that
    can fail to lower) and ``evaluate``'s loss programs are built on first
    use.  A model without training_info has only the inference program: it
    is built at once.

    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> from onnxtrain import build
    >>> from onnxtrain.io.model import validate
    >>> graph = helper.make_graph(
    ...     [helper.make_node("MatMul", ["X", "W"], ["Y"])], "linear",
    ...     [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
    ...     [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
    ...     [numpy_helper.from_array(np.ones((3, 1), np.float32), "W")])
    >>> model = build.training_model(helper.make_model(graph), loss="mse", target="T")
    >>> progs = ProgramSet(validate(model), {})
    >>> progs.role(progs.algorithms[0]), sorted(progs.input_names)
    ('algorithm', ['T', 'X'])
    """

    def __init__(self, tm: TrainingModel, metadata: Mapping[str, Any], data_parallel: bool = False,
                 check: bool | None = None) -> None:
        """``metadata``: the model's onnxtrain.* metadata (``io.metadata``): where
        it records a data-parallel cut and a training-mode prediction.
        ``check``: every step of every pass list checked (``lower.checks``; slow: tests)."""
        self.model = tm
        self.check = check
        self._metadata = metadata
        self._roles: dict[int, str] = {}
        self._inference: Program | None = None
        if not tm.training_info:
            self._build_inference()
        built = [algorithm_programs(tm, i, _cut_options(tm, metadata, i) if data_parallel else None, check)
                 for i in range(len(tm.training_info))]
        self.algorithms = [self._add(program, ALGORITHM) for program, _ in built]
        #: Data-parallel: each algorithm cut in two.
        self.splits: list[SplitAlgorithm] = [split for _, split in built if split is not None]
        for split in self.splits:
            self._add(split.a, FORWARD)
            if split.b is not None:
                self._add(split.b, UPDATE)
        self._initializations: list[Program | None] | None = None
        if any(ti.HasField("initialization") and uses_preview_ops(ti.initialization)
               for ti in tm.proto.training_info):
            self._build_initializations()
        self._losses: dict[tuple[int, str, str | None], Program] = {}
        # the inference program's feeds are the main graph's declared inputs that are not state
        names = {i.name for i in tm.proto.graph.input if i.name not in tm.state}
        for p in self.algorithms:
            names |= set(p.feeds) | set(p.optional_feeds)
        #: What the caller may feed: the inputs of any program, and state variables.
        self.input_names = frozenset(names)
        self.known_names = frozenset(names | set(tm.state))

    def _add(self, program: Program, role: str) -> Program:
        self._roles[id(program)] = role
        return program

    @property
    def inference(self) -> Program:
        """The inference program (the main graph), built on first use."""
        return self._inference if self._inference is not None else self._build_inference()

    @property
    def built_inference(self) -> bool:
        return self._inference is not None

    def _build_inference(self) -> Program:
        self._inference = self._add(inference_program(self.model, self.check), INFERENCE)
        return self._inference

    def _build_initializations(self) -> list[Program | None]:
        tm = self.model
        built = [initialization_program(tm, i, self.check) for i in range(len(tm.training_info))]
        for program in built:
            if program is not None:
                self._add(program, INITIALIZATION)
        self._initializations = built
        return built

    @property
    def initializations(self) -> list[Program | None]:
        """The program of each training_info's initialization graph (None where it has none)."""
        built = self._initializations
        return built if built is not None else self._build_initializations()

    @property
    def built_initializations(self) -> list[Program]:
        """The initialization programs built so far (building none)."""
        return [p for p in self._initializations or () if p is not None]

    def role(self, program: Program) -> str:
        """What ``program`` (one of this set's) is for: INFERENCE, ALGORITHM,
        FORWARD or UPDATE (a cut algorithm's halves), INITIALIZATION or EVALUATE."""
        return self._roles[id(program)]

    def loss(self, index: int, loss: str, prediction: str | None = None) -> Program:
        """The loss program of algorithm ``index`` (``loss_program``), built on first use and kept."""
        key = (index, loss, prediction)
        program = self._losses.get(key)
        if program is None:
            returned = self.algorithms[index].returned
            if loss not in returned:
                raise ValueError(f"evaluate: {loss!r} is not an output of algorithm {index} {returned}")
            train_prediction = self._metadata.get("train_prediction", {})
            program = loss_program(self.model, index, loss, prediction, train_prediction.get(str(index)),
                                   self.check)
            self._losses[key] = self._add(program, EVALUATE)
        return program

    def check_names(self, feeds: Mapping[str, Any], caller: str) -> None:
        """``check_feed_names`` against every name this model may be fed."""
        check_feed_names(feeds, self.known_names, self.input_names, caller)

    def checked(self, programs: Sequence[Program], feeds: Mapping[str, Any], caller: str
                ) -> list[dict[str, np.ndarray]]:
        """The names of ``feeds`` checked, then each program's feeds (``Program.check_feeds``,
        no state variable overridden)."""
        check_feed_names(feeds, self.known_names, self.input_names, caller)
        return [p.check_feeds(feeds, False, caller) for p in programs]


def _cut_options(tm: TrainingModel, metadata: Mapping[str, Any], index: int) -> dict:
    """How ``training_info[index]`` is cut for data-parallel training: the
    rank-local state and the values to reduce that the builder recorded
    (metadata ``onnxtrain.data_parallel``)."""
    info = metadata.get("data_parallel")
    info = info if isinstance(info, dict) else {}
    bound = {b.key for b in tm.proto.training_info[index].update_binding}
    local = [n for n in info.get("local", []) if n in bound]
    reduce = (info.get("reduce") or {}).get(str(index))
    return {"local": local, "reduce": list(reduce) if reduce else None}
