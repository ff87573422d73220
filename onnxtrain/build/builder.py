"""``training_model``: any inference model -> a standard, self-contained ONNX training model.

The result is plain ONNX (IR 10, ``ai.onnx.preview.training`` v1): any runtime
that implements TrainingInfoProto can train it.  Its parts:

- the **main graph**, the inference graph as given (with ``accumulate=k > 1``
  it also holds, as initializers no node reads, the state shared by the two
  TrainingInfoProtos: the gradient sums and the counters; the spec lets an
  algorithm read only the main graph and itself);
- per TrainingInfoProto an **algorithm**:
  forward pass (a training-mode copy where the model has Dropout or
  BatchNormalization) -> loss -> ``Gradient(xs = trainable params,
  zs = data inputs + target, y = loss)`` -> [mean over accumulated
  gradients] -> [global-norm clipping] -> optimizer with lr * schedule(step)
  -> ``step + 1``; every new value goes back through ``update_binding``;
- per TrainingInfoProto an **initialization** graph that resets every state
  variable it owns (params to their values as Constants, optimizer state to
  its fill value, counters to 0): ``initialize()`` is a fresh start.

Large zero-filled state (moments, momentum buffers, gradient sums: at least
``SPARSE_ZERO_BYTES``) is an empty ``sparse_initializer`` of its graph, not
dense zeros: a sparse tensor with no values is zero everywhere, so the model
does not grow by the size of its optimizer state.

``accumulate = k`` gives two TrainingInfoProtos, driven by the cycle
``[0] * (k - 1) + [1]`` (metadata ``onnxtrain.cycle``):

- training_info[0] adds its gradient into the sums ``<param>.grad_accum``;
- training_info[1] applies the optimizer to (sums + its gradient) / n.

update_binding keys must be unique across TrainingInfoProtos, so [1] cannot
write the sums back to zero.  Instead ``accum.step`` records which update the
sums belong to: [0] restarts them when ``accum.step != step``, and [1] uses
them only when ``accum.step == step``, with n = ``accum.count`` + 1.  Any
order of calls is thus well defined, and the cycle gives the mean of k
gradients.  BatchNormalization running statistics are bound by [0] only (the
same uniqueness rule), so they move on the k - 1 accumulation batches.

Metadata (JSON values) tells the fit loop how to drive the model:
``onnxtrain.inputs``, ``onnxtrain.target``, ``onnxtrain.loss``,
``onnxtrain.prediction``, ``onnxtrain.task``, ``onnxtrain.cycle``,
``onnxtrain.trainable``, ``onnxtrain.optimizer_state``, where
BatchNormalization statistics are trained, ``onnxtrain.batchnorm_var``
and, with ``recompute=``, ``onnxtrain.recompute``.

>>> import numpy as np
>>> from onnx import TensorProto, helper, numpy_helper
>>> g = helper.make_graph(
...     [helper.make_node("MatMul", ["X", "W"], ["Y"])], "linear",
...     [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
...     [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
...     [numpy_helper.from_array(np.ones((2, 1), np.float32), "W")])
>>> m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
>>> from onnxtrain.build import SGD
>>> tm = training_model(m, loss="mse", optimizer=SGD(lr=0.1))
>>> [n.op_type for n in tm.training_info[0].algorithm.node if n.domain]
['Gradient']
>>> [b.key for b in tm.training_info[0].update_binding]
['W', 'step']
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .. import mapped, storage
from .. import recompute as _recompute
from ..emitter import Emitter, np_dtype
from ..graph import PREVIEW_DOMAIN, graph_names, infer_types, opset_version
from ..metadata import replace_metadata
from ..storage import tensor_bytes
from ..tensors import all_tensors
from ..model import ModelLike, load
from ..names import NameGen
from . import adapt as _adapt
from . import lora as _lora
from . import losses as _losses
from . import optimizers as _optimizers
from .lora import LoRA
from .losses import Loss
from .optimizers import Adam, Optimizer
from .parameters import choose_trainable, untie_shared_initializers
from .schedules import Schedule
from .train_forward import resolve_batchnorm_var, training_forward

#: IR version of the built model (TrainingInfoProto needs >= 7).
IR_VERSION = 10
MAX_IR_VERSION = 13
#: Oldest default-domain opset the builder emits for (axes-as-input ReduceSum,
#: Dropout's training_mode input, SoftmaxCrossEntropyLoss, LogSoftmax on any axis).
MIN_OPSET = 13

INT64 = TensorProto.INT64
F64 = TensorProto.DOUBLE
#: Zero-filled state the builder creates (optimizer moments, momentum buffers,
#: gradient sums) of at least this many bytes is stored as an empty sparse
#: initializer (``SparseTensorProto`` with no values, ``dims`` the full shape):
#: its value is zero all the same, the initialization graph resets it with
#: ConstantOfShape, and the model does not carry its dense zeros.  Smaller
#: tensors stay dense initializers.
SPARSE_ZERO_BYTES = 64 * 1024


# ------------------------------------------------------------------ state
@dataclass
class StateSpec:
    """A variable the training model keeps: where it lives and how it starts.

    ``home`` is "main" or the index of the TrainingInfoProto whose algorithm
    graph holds its initializer; ``reset_by`` the index whose initialization
    graph resets it.  ``initial`` is the starting tensor (params, running
    statistics) or None for a fill value."""

    name: str
    elem_type: int
    shape: tuple[int, ...]
    home: str | int
    reset_by: int
    initial: onnx.TensorProto | None = None
    fill: float = 0.0
    existing: bool = False  # already an initializer of the main graph

    def start_value(self) -> np.ndarray:
        if self.initial is not None:
            return mapped.to_array(self.initial)
        return np.full(self.shape, self.fill, dtype=np_dtype(self.elem_type))

    def value_info(self, name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, self.elem_type, list(self.shape))

    def sparse_zero(self) -> bool:
        """Whether the initializer is an empty sparse tensor (``SPARSE_ZERO_BYTES``):
        new state (not a copy of a tensor) that starts at +0.0, not a scalar."""
        if self.initial is not None or self.existing or not self.shape:
            return False
        if self.fill != 0 or math.copysign(1.0, self.fill) < 0:
            return False  # a nonzero fill, or -0.0 (whose bits are not zeros)
        nbytes = math.prod(self.shape) * np.dtype(np_dtype(self.elem_type)).itemsize
        return nbytes >= SPARSE_ZERO_BYTES

    def add_initializer(self, graph: onnx.GraphProto) -> None:
        """Add the initializer of this state variable to ``graph``: dense, or
        an empty sparse tensor for large zero-filled state (``sparse_zero``)."""
        if not self.sparse_zero():
            graph.initializer.append(numpy_helper.from_array(self.start_value(), self.name))
            return
        values = onnx.TensorProto(name=self.name, data_type=self.elem_type, dims=[0])
        indices = onnx.TensorProto(data_type=INT64, dims=[0])
        graph.sparse_initializer.append(
            onnx.SparseTensorProto(values=values, indices=indices, dims=list(self.shape))
        )


@dataclass
class Plan:
    """Everything decided before any node is emitted."""

    proto: onnx.ModelProto
    opset: int
    dtypes: dict[str, int]
    shapes: dict[str, Any]
    data_inputs: list[str]
    prediction: str
    target: onnx.ValueInfoProto
    loss: Loss
    loss_name: str
    optimizer: Optimizer
    schedule: Schedule | None
    clip_grad_norm: float | None
    accumulate: int
    train_mode: bool
    params: list[str]
    #: "biased" (ONNX) or "unbiased" (PyTorch) running_var update.
    batchnorm_var: str = "biased"
    #: Whether some algorithm updates BatchNormalization running statistics.
    running_stats: bool = False
    #: Tensor types the main graph declares (value_info and outputs), by name.
    declared: dict[str, onnx.ValueInfoProto] = field(default_factory=dict)
    #: Every name used in the main graph or given out for the model; each
    #: algorithm graph draws its own fresh names from a NameGen over these.
    taken: set[str] = field(default_factory=set)
    names: NameGen = field(default_factory=NameGen)
    state: dict[str, StateSpec] = field(default_factory=dict)
    #: param -> {slot -> state variable name}
    slots: dict[str, dict[str, str]] = field(default_factory=dict)
    step: str = ""
    accum: dict[str, str] = field(default_factory=dict)  # param -> gradient sum
    accum_count: str = ""
    accum_step: str = ""
    #: Per algorithm: the training-mode copy's prediction, where there is a copy.
    train_predictions: dict[int, str] = field(default_factory=dict)
    #: With accumulate > 1: the gradient sums (sums + this batch's gradient)
    #: the final algorithm divides, which data-parallel training reduces
    #: across ranks once per optimizer step (metadata ``onnxtrain.data_parallel``).
    reduce_points: list[str] = field(default_factory=list)
    #: The LoRA description (``lora.apply``), metadata ``onnxtrain.lora``; None without LoRA.
    lora: dict[str, Any] | None = None
    #: State variables holding the base learning rate and the clipping threshold
    #: (TrainingSession.learning_rate / clip_grad_norm set them between steps).
    lr_state: str = ""
    #: The rate the update uses (lr * schedule(step)) and the algorithm computing it.
    lr_value: str = ""
    lr_algorithm: int = 0
    clip_state: str = ""
    #: The activation recompute option (``onnxtrain.recompute``), None when off.
    recompute: Any = None

    @property
    def final(self) -> int:
        """Index of the TrainingInfoProto that updates the parameters."""
        return 0 if self.accumulate == 1 else 1

    def fresh(self, hint: str) -> str:
        """A model-wide fresh name."""
        name = self.names.fresh(hint)
        self.taken.add(name)
        return name

    def add_state(self, hint: str, var: StateSpec) -> str:
        var.name = self.fresh(hint)
        self.state[var.name] = var
        return var.name


# ------------------------------------------------------------------ public entry
def training_model(
    model: ModelLike,
    loss: str | Loss | Callable = "cross_entropy",
    target: str = "target",
    output: str | None = None,
    optimizer: Optimizer = Adam(lr=1e-3),
    trainable: Sequence[str] | Callable[[str], bool] | None = None,
    schedule: Schedule | None = None,
    clip_grad_norm: float | None = None,
    accumulate: int = 1,
    train_mode: bool = True,
    batchnorm_var: str = "auto",
    lora: LoRA | None = None,
    recompute: Any = None,
) -> onnx.ModelProto:
    """A standard ONNX training model that trains ``model`` (which is not modified).

    The result is self-contained when its tensors add up to less than 256 MiB
    (``storage.SPILL_FROM``).  A larger model keeps its weights in the files
    they were mapped from (``onnxtrain.mapped``: the source's external data,
    or a spill file): pass it to ``TrainingSession`` or write it with
    ``onnxtrain.storage.write_model``, which stream them; ``onnx.save`` would
    write absolute paths other tools refuse.

    ``loss``: a name ("mse", "l1", "huber", "cross_entropy", "bce_with_logits",
    "nll"), a loss object, or ``fn(emit, prediction, target) -> loss name``.
    ``target``: name of the new target input.  ``output``: the main-graph
    output the loss reads (default: the first floating-point one; a
    cross-entropy on a probability output that ``adapt`` gave logits reads
    those, see ``adapt.loss_output``).  ``optimizer``: build.SGD,
    build.Adagrad, build.Adam or build.AdamW (torch's update rules).
    ``trainable``: None (the parameters of the main graph, see below), a
    list of names (any floating-point initializer but BatchNormalization
    statistics and Dropout settings), or a predicate name -> bool applied to
    the default set.  ``schedule``: build.cosine,
    build.step_decay or build.linear_warmup, computed in the graph from the
    step counter.  ``clip_grad_norm``: scale all gradients by
    min(1, c / (||g||_2 + 1e-6)) over their global norm.  ``accumulate``: k
    micro-batches per update (two TrainingInfoProtos).  ``train_mode``: run
    Dropout / BatchNormalization in training mode inside the algorithm.
    ``batchnorm_var``: how training-mode BatchNormalization updates
    running_var: "biased" (the ONNX rule, biased batch variance),
    "unbiased" (PyTorch's, the batch variance times n / (n - 1), n values
    per channel) or "auto" (unbiased when ``producer_name`` is "pytorch",
    biased otherwise); the choice is recorded as ``onnxtrain.batchnorm_var``.
    ``lora``: build.LoRA(rank, alpha, targets, dropout) freezes the targeted
    MatMul/Gemm weights and trains low-rank adapters ``W.lora_A``,
    ``W.lora_B`` instead (see ``lora``); then only the adapters train by
    default and ``trainable=`` adds others (biases, norms, heads), and
    ``TrainingSession.export(path)`` writes the merged inference model.
    ``recompute``: trade compute for activation memory by recomputing
    forward values in the backward pass instead of keeping them (recorded
    as ``onnxtrain.recompute``, applied by the session when it expands the
    Gradient node; losses and updates are unchanged, see
    ``onnxtrain.recompute``): None or False (off), "elementwise"
    (recompute cheap ops, e.g. Gelu or LayerNormalization outputs, from
    values the backward keeps anyway), "blocks" (checkpoints at the narrow
    points of the forward pass, e.g. a transformer's residual stream, as
    many as minimize the estimated peak; every segment but the last is
    recomputed just before its backward: about one extra forward pass), an
    int k (the same with at most k balanced segments) or a list of
    main-graph value names (exactly those checkpoints).

    The default trainable set (``trainable=None``): every floating-point
    initializer is trained unless it is a **constant**: a 0-d scalar
    (exporters store attention scales, mask fill values, GELU coefficients
    and exponents that way), an additive mask (only zeros and fills <= -1e9
    or -inf, as in causal masks), or an initializer whose every use is a setting
    slot (BatchNormalization statistics, Dropout ratio, Pow exponent, Clip
    bounds, a one-element fill of Where, Pad/OneHot values, shape-like,
    axes and index inputs, comparisons, non-differentiable ops, casts to
    non-float types).  Weights and biases of any shape are trained, a [1]
    bias included.  ``parameter_choices(model)`` lists the choice and its
    reason (``onnxtrain inspect`` prints it); a warning is issued when a
    choice looks doubtful (a trained one-element initializer that is not a
    bias, an initializer used both as a setting and as a weight).
    Identity copies of a shared initializer (the TorchScript exporter stores
    equal initializers once, e.g. every BatchNorm weight of one width) get
    their own initializer first, so they train separately as in the source
    model; the main graph computes the same.
    """
    plan = _plan(model, loss, target, output, optimizer, trainable, schedule, clip_grad_norm,
                 accumulate, train_mode, batchnorm_var, lora, recompute)
    proto = plan.proto
    _add_main_state(plan)
    for index in range(plan.accumulate if plan.accumulate == 1 else 2):
        ti = proto.training_info.add()
        _Algorithm(plan, index).build(ti)
        _initialization(plan, index, ti)
    _set_imports(proto)
    _set_metadata(plan)
    # A model under SPILL_FROM is returned self-contained, as any onnx tool
    # expects; a larger one keeps its weights in their (mapped) files, which
    # TrainingSession and storage.write_model read without a copy.
    # (Only external tensors can be placeholders: most models have none,
    # and then one walk of the tensors settles it.)
    if any(t.data_location == TensorProto.EXTERNAL for t in all_tensors(proto)) and (
        tensor_bytes(proto) < storage.SPILL_FROM
    ):
        proto = storage.materialized(proto)
    return proto


# ------------------------------------------------------------------ planning
def _plan(model, loss, target, output, optimizer, trainable, schedule, clip_grad_norm,
          accumulate, train_mode, batchnorm_var="auto", lora=None, recompute=None) -> Plan:
    """Check every argument and decide the names and the state variables."""
    recompute_spec = _recompute.normalize(recompute)
    proto = _adapt.adapt(_inference_copy(model))
    opset = _default_opset(proto)
    untie_shared_initializers(proto.graph)
    lora_info = _lora.apply(proto, lora)[1] if lora is not None else None
    loss_obj = _losses.resolve(loss)
    optimizer = _optimizers.resolve(optimizer)
    if schedule is not None and not isinstance(schedule, Schedule):
        raise TypeError(
            "schedule must be None, build.cosine(...), build.step_decay(...) or "
            f"build.linear_warmup(...), not {type(schedule).__name__}"
        )
    if clip_grad_norm is not None and not (
        isinstance(clip_grad_norm, (int, float)) and not isinstance(clip_grad_norm, bool)
        and clip_grad_norm > 0
    ):
        raise ValueError(f"clip_grad_norm must be None or a number > 0, got {clip_grad_norm!r}")
    if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
        raise ValueError(f"accumulate must be an integer >= 1, got {accumulate!r}")

    main = proto.graph
    dtypes, shapes = infer_types(main, proto.opset_import)
    taken = graph_names(main)
    prediction = _adapt.loss_output(proto, output, loss_obj)
    _recompute.check_checkpoints(recompute_spec, main, prediction)
    pred_type = dtypes.get(prediction)
    _losses.check_prediction_type(pred_type, prediction)
    if pred_type is None:
        raise ValueError(f"cannot determine the element type of output {prediction!r}")
    loss_obj = loss_obj.for_model(main, prediction, shapes.get(prediction))
    target_vi = _target_input(loss_obj, target, pred_type, shapes.get(prediction), taken)
    taken.add(target)

    if lora_info is None:
        params = choose_trainable(main, trainable)
    else:
        params = _lora.trainable_params(main, lora_info, trainable)
    bn_var = resolve_batchnorm_var(batchnorm_var, proto)
    plan = Plan(
        proto=proto, opset=opset, dtypes=dtypes, shapes=shapes,
        data_inputs=_data_inputs(main), prediction=prediction, target=target_vi,
        loss=loss_obj, loss_name="", optimizer=optimizer, schedule=schedule,
        clip_grad_norm=float(clip_grad_norm) if clip_grad_norm is not None else None,
        accumulate=accumulate, train_mode=bool(train_mode), params=params,
        taken=taken, names=NameGen(taken), batchnorm_var=bn_var,
        declared=_declared_types(main), lora=lora_info, recompute=recompute_spec,
    )
    plan.loss_name = plan.fresh("loss")  # the same name in every algorithm graph
    _plan_state(plan)
    return plan


def _declared_types(main: onnx.GraphProto) -> dict[str, onnx.ValueInfoProto]:
    """value_info and outputs of the main graph that give a tensor's type and shape."""
    out = {}
    for vi in list(main.value_info) + list(main.output):
        t = vi.type
        if t.WhichOneof("value") == "tensor_type" and t.tensor_type.elem_type and t.tensor_type.HasField("shape"):
            out[vi.name] = vi
    return out


def _inference_copy(model: ModelLike) -> onnx.ModelProto:
    source, _ = load(model)
    if source.training_info:
        raise ValueError(
            "the model already has training_info; training_model expects an inference model "
            "(export it with TrainingSession.export(path) first)"
        )
    proto = onnx.ModelProto()
    proto.CopyFrom(source)
    return proto


def _default_opset(proto: onnx.ModelProto) -> int:
    """The default-domain opset the builder works at (refused below MIN_OPSET)."""
    version = opset_version(proto.opset_import)
    if version == 0:
        raise ValueError("the model does not import the default ONNX domain")
    if version < MIN_OPSET:
        raise ValueError(
            f"the model imports the default ONNX domain at opset {version}; the builder "
            f"needs opset >= {MIN_OPSET} (convert it first with "
            f"onnx.version_converter.convert_version(model, {MIN_OPSET}))"
        )
    return version


def _target_input(
    loss: Loss, target: str, pred_type: int, pred_shape: Any, taken: set[str]
) -> onnx.ValueInfoProto:
    if not isinstance(target, str) or not target:
        raise ValueError(f"target must be a non-empty name, got {target!r}")
    if target in taken:
        raise ValueError(
            f"target name {target!r} is already used in the main graph; pick another with target=..."
        )
    elem, shape = loss.target_type(pred_type, pred_shape)
    return helper.make_tensor_value_info(target, elem, None if shape is None else list(shape))


def _data_inputs(main: onnx.GraphProto) -> list[str]:
    """Main-graph inputs that are not initializers (IR 3 style inputs are parameters)."""
    inits = {t.name for t in main.initializer} | {t.values.name for t in main.sparse_initializer}
    return [i.name for i in main.input if i.name not in inits]


def _plan_state(plan: Plan) -> None:
    """Name and place every state variable."""
    main = plan.proto.graph
    inits = {t.name: t for t in main.initializer}
    k, final = plan.accumulate, plan.final
    for p in plan.params:
        t = inits[p]
        plan.state[p] = StateSpec(p, t.data_type, tuple(t.dims), "main", final, initial=t, existing=True)
    for p in plan.params:
        var = plan.state[p]
        plan.slots[p] = {}
        for slot, fill in plan.optimizer.slots():
            plan.slots[p][slot] = plan.add_state(
                f"{p}.{slot}", StateSpec("", var.elem_type, var.shape, final, final, fill=fill)
            )
    shared = "main" if k > 1 else 0
    plan.step = plan.add_state("step", StateSpec("", INT64, (), shared, final))
    if k > 1:
        for p in plan.params:
            var = plan.state[p]
            plan.accum[p] = plan.add_state(
                f"{p}.grad_accum", StateSpec("", var.elem_type, var.shape, "main", 0)
            )
        plan.accum_count = plan.add_state("accum.count", StateSpec("", INT64, (), "main", 0))
        plan.accum_step = plan.add_state("accum.step", StateSpec("", INT64, (), "main", 0))


def _add_main_state(plan: Plan) -> None:
    """New state variables that live in the main graph become its initializers."""
    for var in plan.state.values():
        if var.home == "main" and not var.existing:
            var.add_initializer(plan.proto.graph)


# ------------------------------------------------------------------ algorithm
class _Algorithm:
    """The algorithm graph and update_binding of training_info[index]."""

    def __init__(self, plan: Plan, index: int) -> None:
        self.plan = plan
        self.index = index
        self.e = Emitter(plan.opset, NameGen(plan.taken), dict(plan.dtypes))
        for var in plan.state.values():
            self.e.dtypes[var.name] = var.elem_type
        self.outputs: list[onnx.ValueInfoProto] = []
        #: Types of values shape inference cannot derive (Gradient's outputs).
        self.value_info: list[onnx.ValueInfoProto] = []
        self.bindings: list[tuple[str, str]] = []
        self.loss_type = plan.dtypes[plan.prediction]

    def build(self, ti: onnx.TrainingInfoProto) -> None:
        plan = self.plan
        prediction, running_stats = self.forward()
        if prediction != plan.prediction:
            plan.train_predictions[self.index] = prediction
        loss = self.loss(prediction)
        grads = self.gradients(loss)
        if self.index == 0:
            plan.running_stats = plan.running_stats or bool(running_stats)
            for key, value in running_stats:
                self.bind(key, value)
        if self.index != plan.final:
            self.accumulate_into_sums(grads)
        else:
            if plan.accumulate > 1:
                grads = self.mean_with_sums(grads)
            if plan.clip_grad_norm is not None:
                grads = self.clip(grads)
            self.optimizer_step(grads)
            self.count_step()
        self.graph(ti.algorithm)
        for key, value in self.bindings:
            ti.update_binding.add(key=key, value=value)

    # -- bookkeeping
    def bind(self, key: str, value: str) -> None:
        """Bind state variable ``key`` to ``value`` (declared as an algorithm output)."""
        plan = self.plan
        if key in plan.state:
            vi = plan.state[key].value_info(value)
        else:  # a running statistic: an initializer of the main graph
            t = next(t for t in plan.proto.graph.initializer if t.name == key)
            vi = helper.make_tensor_value_info(value, t.data_type, list(t.dims))
        self.outputs.append(vi)
        self.bindings.append((key, value))

    def graph(self, graph: onnx.GraphProto) -> None:
        """Fill the (empty) algorithm graph ``graph`` in place: what
        ``helper.make_graph`` makes, without a copy of every node."""
        plan = self.plan
        loss_vi = helper.make_tensor_value_info(plan.loss_name, self.loss_type, [])
        _fill_graph(
            graph, self.e.nodes, f"training_info[{self.index}].algorithm", [plan.target],
            [loss_vi] + self.outputs, value_info=self.value_info,
        )
        for var in plan.state.values():
            if var.home == self.index:
                var.add_initializer(graph)

    # -- stages
    def forward(self) -> tuple[str, list[tuple[str, str]]]:
        """The prediction the loss reads: the main graph's, or that of a
        training-mode copy when Dropout/BatchNormalization are on its path."""
        plan = self.plan
        if not plan.train_mode:
            return plan.prediction, []
        prediction, stats, value_info = training_forward(
            self.e, plan.proto.graph, plan.prediction, plan.opset, self.copied_type,
            plan.batchnorm_var,
        )
        self.value_info.extend(value_info)
        return prediction, stats

    def copied_type(self, original: str, new: str) -> onnx.ValueInfoProto | None:
        """The value_info of ``original`` (declared in the main graph, else
        inferred) under the name ``new``; None when nothing is known."""
        plan = self.plan
        declared = plan.declared.get(original)
        if declared is not None:
            vi = onnx.ValueInfoProto()
            vi.CopyFrom(declared)
            vi.name = new
            return vi
        elem = plan.dtypes.get(original)
        if elem is None:
            return None
        shape = plan.shapes.get(original)
        dims = None if shape is None else [d if isinstance(d, (int, str)) else None for d in shape]
        return helper.make_tensor_value_info(new, elem, dims)

    def loss(self, prediction: str) -> str:
        plan = self.plan
        self.e.hint = "loss"
        self.e.dtypes.setdefault(plan.target.name, plan.target.type.tensor_type.elem_type)
        value = plan.loss.emit(self.e, prediction, plan.target.name)
        self.e.op("Identity", [value], outputs=[plan.loss_name])
        self.loss_type = self.e.dtypes.get(value, plan.dtypes[plan.prediction])
        return plan.loss_name

    def gradients(self, loss: str) -> list[str]:
        """d loss / d param for every trainable parameter (one Gradient node)."""
        plan = self.plan
        zs = plan.data_inputs + [plan.target.name]
        names = [self.e.names.fresh(f"{p}.grad") for p in plan.params]
        self.e.hint = "gradient"
        self.e.op(
            "Gradient", plan.params + zs, outputs=names, domain=PREVIEW_DOMAIN,
            xs=plan.params, zs=zs, y=loss,
        )
        for p, g in zip(plan.params, names):
            self.e.dtypes[g] = plan.state[p].elem_type
            self.value_info.append(plan.state[p].value_info(g))
        return names

    def accumulate_into_sums(self, grads: Sequence[str]) -> None:
        """sums = (accum.step == step ? sums : 0) + g;  count likewise + 1;  accum.step = step."""
        plan, e = self.plan, self.e
        e.hint = "accumulate"
        current = e.Equal(plan.accum_step, plan.step)
        for p, g in zip(plan.params, grads):
            kept = e.Where(current, plan.accum[p], e.const(0.0, like=g))
            self.bind(plan.accum[p], e.Add(kept, g))
        count = e.Where(current, plan.accum_count, e.scalar_int(0))
        self.bind(plan.accum_count, e.Add(count, e.scalar_int(1)))
        self.bind(plan.accum_step, e.Identity(plan.step))

    def mean_with_sums(self, grads: Sequence[str]) -> list[str]:
        """g_mean = (sums + g) / (count + 1) when the sums belong to this update, else g."""
        plan, e = self.plan, self.e
        e.hint = "accumulate"
        current = e.Equal(plan.accum_step, plan.step)
        n = e.Add(e.Where(current, plan.accum_count, e.scalar_int(0)), e.scalar_int(1))
        out = []
        for p, g in zip(plan.params, grads):
            kept = e.Where(current, plan.accum[p], e.const(0.0, like=g))
            total = e.Add(kept, g)
            plan.reduce_points.append(total)
            out.append(e.Div(total, e.Cast(n, to=e.dtype(g))))
        return out

    def hyperparameter(self, hint: str, value: float) -> str:
        """A 0-D float64 state variable of this algorithm graph, reset to
        ``value`` by this TrainingInfoProto's initialization_binding (which is
        what makes it state per IR.md) and bound by no update: a setting the
        session can change between steps without rebuilding anything, saved
        with a checkpoint and read by the step like any other state."""
        plan, e = self.plan, self.e
        name = e.names.fresh(hint)
        plan.taken.add(name)
        plan.state[name] = StateSpec(name, F64, (), self.index, self.index, fill=float(value))
        e.dtypes[name] = F64
        return name

    def clip(self, grads: Sequence[str]) -> list[str]:
        """g *= min(1, c / (||g||_2 + 1e-6)), the norm over all gradients
        (torch.nn.utils.clip_grad_norm_), computed in float64.  The threshold
        c is a state variable (``hyperparameter``; metadata
        ``onnxtrain.clip_grad_norm``), settable through
        ``TrainingSession.clip_grad_norm``."""
        e = self.e
        e.hint = "clip"
        self.plan.clip_state = self.hyperparameter("clip_grad_norm", self.plan.clip_grad_norm)
        squares = [e.Cast(e.reduce("ReduceSumSquare", g, None, keepdims=False), to=F64) for g in grads]
        norm = e.Sqrt(e.sum_all(squares))
        coef = e.Div(self.plan.clip_state, e.Add(norm, e.const(1e-6, dtype=F64)))
        coef = e.Min(coef, e.const(1.0, dtype=F64))
        return [e.Mul(g, e.cast_to(coef, e.dtype(g))) for g in grads]

    def learning_rate(self) -> str:
        """lr * schedule(step) as a 0-D float64.

        The base rate lr is a state variable (a 0-D float64 initializer of
        this algorithm graph, reset to ``optimizer.lr`` by this
        TrainingInfoProto's initialization_binding, which is what makes it
        state per IR.md), not a Constant: ``TrainingSession.learning_rate``
        changes it between steps without rebuilding, it is saved with a
        checkpoint, and the step reads it like any other state (one commit).
        Metadata ``onnxtrain.learning_rate`` names it."""
        plan, e = self.plan, self.e
        e.hint = "lr"
        lr = plan.lr_state = self.hyperparameter("lr", plan.optimizer.lr)
        plan.lr_algorithm = self.index
        if plan.schedule is None:
            plan.lr_value = lr
            return lr
        plan.lr_value = e.Mul(lr, plan.schedule.emit(e, plan.step))
        return plan.lr_value

    def optimizer_step(self, grads: Sequence[str]) -> None:
        plan = self.plan
        lr = self.learning_rate()
        self.e.hint = "optimizer"
        state = {
            slot: [plan.slots[p][slot] for p in plan.params] for slot, _ in plan.optimizer.slots()
        }
        new_params, new_state = plan.optimizer.update(self.e, lr, plan.step, plan.params, grads, state)
        for p, value in zip(plan.params, new_params):
            self.bind(p, value)
        for slot, values in new_state.items():
            for p, value in zip(plan.params, values):
                self.bind(plan.slots[p][slot], value)

    def count_step(self) -> None:
        e = self.e
        e.hint = "counter"
        self.bind(self.plan.step, e.Add(self.plan.step, e.scalar_int(1)))


# ------------------------------------------------------------------ initialization
def _initialization(plan: Plan, index: int, ti: onnx.TrainingInfoProto) -> None:
    """The graph that resets the state variables training_info[index] owns."""
    owned = [var for var in plan.state.values() if var.reset_by == index]
    if index == 0:
        owned += _running_stat_vars(plan, ti)
    names = NameGen(v.name for v in owned)
    e = Emitter(plan.opset, names, hint="init")
    outputs, binding = [], []
    #: (node index, starting tensor) of the Constants whose value is filled in last.
    fills: list[tuple[int, onnx.TensorProto]] = []
    for var in owned:
        if var.initial is not None:
            fills.append((len(e.nodes), var.initial))
        value = _initial_value(e, var, names.fresh(f"{var.name}.initial"))
        outputs.append(var.value_info(value))
        binding.append((var.name, value))
    graph = ti.initialization
    _fill_graph(graph, e.nodes, f"training_info[{index}].initialization", [], outputs)
    # The starting values are copied once, straight into their place in the
    # model (their Constants were emitted with the type and dims only).
    for position, initial in fills:
        value = graph.node[position].attribute[0].t
        value.CopyFrom(initial)  # bit for bit, whatever the storage field
        value.ClearField("name")
    for key, value in binding:
        ti.initialization_binding.add(key=key, value=value)


def _running_stat_vars(plan: Plan, ti: onnx.TrainingInfoProto) -> list[StateSpec]:
    """BatchNormalization statistics bound by this TrainingInfoProto, as state to reset."""
    inits = {t.name: t for t in plan.proto.graph.initializer}
    out = []
    for b in ti.update_binding:
        if b.key in inits and b.key not in plan.state:
            t = inits[b.key]
            out.append(StateSpec(b.key, t.data_type, tuple(t.dims), "main", 0, initial=t, existing=True))
    return out


def _initial_value(e: Emitter, var: StateSpec, out: str) -> str:
    """A Constant holding the starting value (ConstantOfShape for a fill of a tensor)."""
    if var.initial is not None:
        # The type and dims only: ``_initialization`` copies the data in place.
        value = onnx.TensorProto(data_type=var.initial.data_type, dims=var.initial.dims)
        e.op("Constant", [], outputs=[out], value=value)
    elif not var.shape:
        e.op("Constant", [], outputs=[out], value=numpy_helper.from_array(var.start_value()))
    else:
        fill = numpy_helper.from_array(np.asarray([var.fill], dtype=np_dtype(var.elem_type)))
        e.op("ConstantOfShape", [e.ints(var.shape)], outputs=[out], value=fill)
    return out


def _fill_graph(
    graph: onnx.GraphProto,
    nodes: Sequence[onnx.NodeProto],
    name: str,
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    value_info: Sequence[onnx.ValueInfoProto] = (),
) -> None:
    """``graph.CopyFrom(helper.make_graph(nodes, name, inputs, outputs,
    value_info=value_info))`` for an empty ``graph``, with one copy of the
    nodes instead of two."""
    graph.node.extend(nodes)
    graph.name = name
    graph.input.extend(inputs)
    graph.output.extend(outputs)
    graph.value_info.extend(value_info)


# ------------------------------------------------------------------ model-level
def _set_imports(proto: onnx.ModelProto) -> None:
    """Import ai.onnx.preview.training v1 and set the IR version."""
    if not any(o.domain == PREVIEW_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(PREVIEW_DOMAIN, 1))
    needed = helper.find_min_ir_version_for(list(proto.opset_import), ignore_unknown=True)
    proto.ir_version = min(max(IR_VERSION, needed), MAX_IR_VERSION)


def _set_metadata(plan: Plan) -> None:
    """What the fit loop needs to drive the model, as JSON values."""
    k = plan.accumulate
    entries = {
        "inputs": plan.data_inputs,
        "target": plan.target.name,
        "loss": plan.loss_name,
        "prediction": plan.prediction,
        "task": plan.loss.task,
        "cycle": [0] if k == 1 else [0] * (k - 1) + [1],
        "trainable": plan.params,
        "optimizer_state": [name for name, var in plan.state.items() if not var.existing],
        # The training-mode copy's prediction in each algorithm (evaluate swaps
        # it for the main graph's inference-mode prediction).
        "train_prediction": {str(i): name for i, name in plan.train_predictions.items()},
        # The base learning rate's state variable and value (TrainingSession.learning_rate).
        "learning_rate": {"state": plan.lr_state, "base": float(plan.optimizer.lr)},
        # For the label check before training: the classes C (None: unknown),
        # their axis in the prediction and the label that is skipped.
        "classes": _classes(plan),
    }
    if plan.schedule is not None:
        # The tensor of training_info[algorithm].algorithm holding the rate the update
        # uses, lr * schedule(step) (TrainingSession.current_learning_rate).
        entries["learning_rate"].update(value=plan.lr_value, algorithm=plan.lr_algorithm)
    if plan.clip_state:
        # The clipping threshold's state variable (TrainingSession.clip_grad_norm).
        entries["clip_grad_norm"] = {"state": plan.clip_state, "base": plan.clip_grad_norm}
    if plan.lora is not None:
        # What export needs to merge the adapters (lora.merge).
        entries["lora"] = plan.lora
    if k > 1:
        # Data-parallel training (TrainingSession(comm=...)): the gradient sums
        # stay on each rank (DDP's no_sync) and the final algorithm reduces the
        # sums it divides, once per optimizer step (onnxtrain.split).
        entries["data_parallel"] = {
            "local": [plan.accum[p] for p in plan.params],
            "reduce": {str(plan.final): list(plan.reduce_points)},
        }
    if plan.recompute is not None:
        # Activation recompute, applied when a session lowers the algorithms.
        entries["recompute"] = plan.recompute
    if plan.running_stats:
        # How training-mode BatchNormalization updates running_var (only where it does).
        entries["batchnorm_var"] = plan.batchnorm_var
    replace_metadata(plan.proto, entries)


def _classes(plan: Plan) -> dict[str, Any] | None:
    """{"count": C or None, "axis": 1 or -1, "ignore_index": n or None} for a
    class-index loss (CrossEntropy, NLL), else None: what the fit loop checks
    labels against before the first step."""
    loss = plan.loss
    axis = getattr(loss, "class_axis", None)
    if axis not in (1, -1):
        return None
    shape = plan.shapes.get(plan.prediction)
    count = None
    if shape and len(shape) >= 2:
        dim = shape[axis]
        count = int(dim) if isinstance(dim, (int, np.integer)) and dim > 0 else None
    ignore = getattr(loss, "ignore_index", None)
    return {"count": count, "axis": axis, "ignore_index": None if ignore is None else int(ignore)}
