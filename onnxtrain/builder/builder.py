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
BatchNormalization statistics are trained, ``onnxtrain.batchnorm_var``,
with ``recompute=``, ``onnxtrain.recompute`` and, for a model given as a
path, ``onnxtrain.source`` (that file's absolute path).

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

import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..core.graph import PREVIEW_DOMAIN, graph_names, infer_types, opset_version, upstream_values
from ..core.protos import all_tensors
from ..io import storage
from ..io.metadata import recompute_option, replace_metadata, set_metadata
from ..io.model import ModelLike, load
from ..io.storage import tensor_bytes
from . import adapt as _adapt
from . import lora as _lora
from . import losses as _losses
from . import optimizers as _optimizers
from .algorithm import Algorithm, initialization_graph
from .cache import BuiltModels
from .folding import warn_if_folded
from .lora import LoRA
from .losses import Loss
from .optimizers import Adam, Optimizer
from .parameters import choose_trainable
from .plan import Layout, Learned, Plan, StateSpec
from .schedules import Schedule
from .ties import untie_shared_initializers
from .train_forward import resolve_batchnorm_var
from .transforms import chain_for

#: IR version of the built model (TrainingInfoProto needs >= 7).
IR_VERSION = 10
MAX_IR_VERSION = 13
#: Oldest default-domain opset the builder emits for (axes-as-input ReduceSum,
#: Dropout's training_mode input, SoftmaxCrossEntropyLoss, LogSoftmax on any axis).
MIN_OPSET = 13


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
    they were mapped from (``onnxtrain.io.mapped``: the source's external data,
    or a spill file): pass it to ``TrainingSession`` or write it with
    ``onnxtrain.io.storage.write_model``, which stream them; ``onnx.save`` would
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
    ``onnxtrain.lower.recompute``): None or False (off), "elementwise"
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
    Parameters an exporter stored in one initializer (TorchScript's
    Identity copies, e.g. every BatchNorm weight of one width; dynamo's
    equal weights, e.g. a fresh Llama's RMSNorm weights, told apart by its
    node records) get their own initializer first, so they train separately
    as in the source model (``ties``); the main graph computes the same.

    The answer is kept in the startup cache (``onnxtrain.builder.cache``;
    ``ONNXTRAIN_PROGRAM_CACHE=0`` turns it off): the same model, options and
    code give it back without building, bit for bit.
    """
    return _built(model, dict(
        loss=loss, target=target, output=output, optimizer=optimizer, trainable=trainable,
        schedule=schedule, clip_grad_norm=clip_grad_norm, accumulate=accumulate,
        train_mode=train_mode, batchnorm_var=batchnorm_var, lora=lora, recompute=recompute))


def held_training_model(model: ModelLike, **options: Any) -> onnx.ModelProto:
    """``training_model(model, **options)`` for a ``TrainingSession`` to take
    at once (``build.training_session``): from the startup cache, its large
    weights come in the files ``io.storage.hold`` makes (as the session would
    hold them), put there from the inference model's data without passing
    through the built model's protobuf.  Such a model names files of this
    process, which go when the session that holds them does: it is not one
    to save with ``onnx.save``."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"training_model() got an unexpected keyword argument {unknown[0]!r}")
    return _built(model, {k: options.get(k, default) for k, default in _OPTIONS.items()}, held=True)


#: training_model's options and their defaults, in its order (the cache key's).
_OPTIONS = {k: p.default for k, p in inspect.signature(training_model).parameters.items() if k != "model"}


def _built(model: ModelLike, options: dict[str, Any], held: bool = False) -> onnx.ModelProto:
    """``training_model`` of ``options`` (every one of its parameters), from
    the startup cache where it has the answer (``held``: see ``held_training_model``)."""
    # A ModelProto is hashed as given: an entry of its key is for a model
    # that loaded and built before (``BuiltModels``).  Anything else is parsed.
    loaded = None if isinstance(model, onnx.ModelProto) else _inference_source(model)
    path = os.path.abspath(os.fspath(model)) if isinstance(model, (str, os.PathLike)) else None
    cache = BuiltModels(model if loaded is None else loaded, path, options)
    built = cache.lookup(held)
    if built is not None:
        return built
    source = _inference_source(model) if loaded is None else loaded
    with cache.recording():
        plan = _plan(source if source is not model else _copy(source), **options)
        proto = plan.proto
        _add_main_state(plan)
        learned: list[Learned] = []
        for index in range(plan.accumulate if plan.accumulate == 1 else 2):
            ti = proto.training_info.add()
            learned.append(Algorithm(plan, index, learned).build(ti))
            initialization_graph(plan, learned[-1], ti)
        _set_imports(proto)
        _set_metadata(plan, learned)
        if path is not None:
            # The file it was built from (genai.export names it when it is not the base's).
            set_metadata(proto, "source", path)
        # A model under SPILL_FROM is returned self-contained, as any onnx tool
        # expects; a larger one keeps its weights in their (mapped) files, which
        # TrainingSession and storage.write_model read without a copy.
        # (Only external tensors can be placeholders: most models have none,
        # and then one walk of the tensors settles it.)
        if any(t.data_location == TensorProto.EXTERNAL for t in all_tensors(proto)) and (
            tensor_bytes(proto) < storage.SPILL_FROM
        ):
            proto = storage.materialized(proto)
    cache.store(proto)
    return proto


# ------------------------------------------------------------------ planning
def _plan(source, loss, target, output, optimizer, trainable, schedule, clip_grad_norm,
          accumulate, train_mode, batchnorm_var="auto", lora=None, recompute=None) -> Plan:
    """Check every argument and decide the names and the state variables
    (``source``: the inference model, ours to change)."""
    recompute_spec = recompute_option(recompute)
    warn_if_folded(source, stacklevel=4)  # at the caller of training_model
    proto = _adapt.adapt(source)
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
    _check_checkpoints(recompute_spec, main, prediction)
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
    layout = Layout(params, 0 if accumulate == 1 else 1, taken)
    loss_name = layout.fresh("loss")  # the same name in every algorithm graph
    chain = chain_for(optimizer, schedule, clip_grad_norm, accumulate)
    _plan_state(layout, main, chain)
    return Plan(
        proto=proto, opset=opset, dtypes=dtypes, shapes=shapes,
        data_inputs=_data_inputs(main), prediction=prediction, target=target_vi,
        loss=loss_obj, loss_name=loss_name, optimizer=optimizer, schedule=schedule,
        clip_grad_norm=float(clip_grad_norm) if clip_grad_norm is not None else None,
        accumulate=accumulate, train_mode=bool(train_mode), params=params,
        layout=layout, batchnorm_var=bn_var,
        declared=_declared_types(main), lora=lora_info, recompute=recompute_spec, chain=chain,
    )


def _check_checkpoints(spec: Any, graph: onnx.GraphProto, prediction: str) -> None:
    """Refuse recompute checkpoint names that are not values on the path to ``prediction``."""
    if not isinstance(spec, dict) or "checkpoints" not in spec:
        return
    producer = {o: n for n in graph.node for o in n.output if o}
    upstream = upstream_values(producer, [prediction])
    for name in spec["checkpoints"]:
        if name not in producer:
            raise ValueError(
                f"recompute: checkpoint {name!r} is not a value computed by the main graph")
        if name not in upstream:
            raise ValueError(
                f"recompute: checkpoint {name!r} is not on the path to the output {prediction!r}")


def _declared_types(main: onnx.GraphProto) -> dict[str, onnx.ValueInfoProto]:
    """value_info and outputs of the main graph that give a tensor's type and shape."""
    out = {}
    for vi in list(main.value_info) + list(main.output):
        t = vi.type
        if t.WhichOneof("value") == "tensor_type" and t.tensor_type.elem_type and t.tensor_type.HasField("shape"):
            out[vi.name] = vi
    return out


def _inference_source(model: ModelLike) -> onnx.ModelProto:
    """The inference model, loaded and checked (``model`` itself when it is
    a ModelProto that needed no spilling: the caller's, never changed)."""
    source, _ = load(model)
    if source.training_info:
        raise ValueError(
            "the model already has training_info; training_model expects an inference model "
            "(export it with TrainingSession.export(path) first)"
        )
    return source


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
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


def _plan_state(layout: Layout, main: onnx.GraphProto, chain: tuple[Any, ...]) -> None:
    """Name and place every state variable: the parameters, then what the
    update keeps (the optimizer's slots and the step counter), then the state
    of the other transforms of the chain."""
    inits = {t.name: t for t in main.initializer}
    for p in layout.params:
        t = inits[p]
        layout.state[p] = StateSpec(p, t.data_type, tuple(t.dims), "main", layout.final, initial=t, existing=True)
    *gradient_transforms, update = chain
    update.init(layout)
    for transform in gradient_transforms:
        transform.init(layout)


def _add_main_state(plan: Plan) -> None:
    """New state variables that live in the main graph become its initializers."""
    for var in plan.state.values():
        if var.home == "main" and not var.existing:
            var.add_initializer(plan.proto.graph)


# ------------------------------------------------------------------ model-level
def _set_imports(proto: onnx.ModelProto) -> None:
    """Import ai.onnx.preview.training v1 and set the IR version."""
    if not any(o.domain == PREVIEW_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(PREVIEW_DOMAIN, 1))
    needed = helper.find_min_ir_version_for(list(proto.opset_import), ignore_unknown=True)
    proto.ir_version = min(max(IR_VERSION, needed), MAX_IR_VERSION)


def _set_metadata(plan: Plan, learned: list[Learned]) -> None:
    """What the fit loop needs to drive the model, as JSON values (from the
    plan and what each algorithm ``learned``)."""
    k = plan.accumulate
    # The chain's clipping, rate and update run in the final algorithm.
    final = learned[plan.final]
    entries = {
        "inputs": plan.data_inputs,
        "target": plan.target.name,
        "loss": plan.loss_name,
        "prediction": plan.prediction,
        "task": plan.loss.task,
        "cycle": [0] if k == 1 else [0] * (k - 1) + [1],
        "trainable": plan.params,
        "optimizer_state": [name for name, var in plan.state.items() if not var.existing]
        + [h.name for one in learned for h in one.hyperparameters],
        # The training-mode copy's prediction in each algorithm (evaluate swaps
        # it for the main graph's inference-mode prediction).
        "train_prediction": {str(one.index): one.train_prediction for one in learned if one.train_prediction},
        # The base learning rate's state variable and value (TrainingSession.learning_rate).
        "learning_rate": {"state": final.lr_state, "base": float(plan.optimizer.lr)},
        # For the label check before training: the classes C (None: unknown),
        # their axis in the prediction and the label that is skipped.
        "classes": _classes(plan),
    }
    if plan.schedule is not None:
        # The tensor of training_info[algorithm].algorithm holding the rate the update
        # uses, lr * schedule(step) (TrainingSession.current_learning_rate).
        entries["learning_rate"].update(value=final.lr_value, algorithm=final.index)
        # The schedule, for messages, and where fit sets a total taken from the run.
        entries["schedule"] = {"spec": plan.schedule.spec, "algorithm": final.index}
        if final.schedule_total:
            entries["schedule"].update(state=final.schedule_total,
                                       warmup=int(getattr(plan.schedule, "warmup", 0)))
    if final.clip_state:
        # The clipping threshold's state variable (TrainingSession.clip_grad_norm).
        entries["clip_grad_norm"] = {"state": final.clip_state, "base": plan.clip_grad_norm}
    if plan.lora is not None:
        # What export needs to merge the adapters (lora.merge).
        entries["lora"] = plan.lora
    if k > 1:
        # Data-parallel training (TrainingSession(comm=...)): the gradient sums
        # stay on each rank (DDP's no_sync) and the final algorithm reduces the
        # sums it divides, once per optimizer step (onnxtrain.lower.split).
        entries["data_parallel"] = {
            "local": [plan.accum[p] for p in plan.params],
            "reduce": {str(plan.final): list(final.reduce_points)},
        }
    if plan.recompute is not None:
        # Activation recompute, applied when a session lowers the algorithms.
        entries["recompute"] = plan.recompute
    if learned[0].running_stats:
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
