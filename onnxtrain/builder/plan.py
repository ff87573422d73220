"""What the builder decides before it writes a graph: the state variables it
adds (``StateSpec``) and the whole plan of a training model (``Plan``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..core.emitter import np_dtype
from ..core.names import NameGen
from ..io import mapped
from .losses import Loss
from .optimizers import Optimizer
from .schedules import Schedule

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
class Layout:
    """The state variables, named and placed before the plan is made: what
    the chain's ``init`` decides (``transforms``).  ``taken``: every name
    used in the main graph or given out for the model."""

    params: list[str]
    #: Index of the TrainingInfoProto that updates the parameters.
    final: int
    taken: set[str]
    names: NameGen = field(init=False)
    state: dict[str, StateSpec] = field(default_factory=dict)
    #: param -> {slot -> state variable name}
    slots: dict[str, dict[str, str]] = field(default_factory=dict)
    step: str = ""
    accum: dict[str, str] = field(default_factory=dict)  # param -> gradient sum
    accum_count: str = ""
    accum_step: str = ""

    def __post_init__(self) -> None:
        self.names = NameGen(self.taken)

    def fresh(self, hint: str) -> str:
        """A model-wide fresh name."""
        name = self.names.fresh(hint)
        self.taken.add(name)
        return name

    def add_state(self, hint: str, var: StateSpec) -> str:
        var.name = self.fresh(hint)
        self.state[var.name] = var
        return var.name


@dataclass(frozen=True)
class Plan:
    """Everything decided before any node is emitted; nothing writes to it
    after (what emitting learns is ``Learned``)."""

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
    #: The state variables the chain keeps (``Layout``): ``state``, ``slots``,
    #: ``step``, ``accum``, ``accum_count``, ``accum_step``.
    layout: Layout
    #: "biased" (ONNX) or "unbiased" (PyTorch) running_var update.
    batchnorm_var: str = "biased"
    #: Tensor types the main graph declares (value_info and outputs), by name.
    declared: dict[str, onnx.ValueInfoProto] = field(default_factory=dict)
    #: The LoRA description (``lora.apply``), metadata ``onnxtrain.lora``; None without LoRA.
    lora: dict[str, Any] | None = None
    #: The activation recompute option (``onnxtrain.recompute``), None when off.
    recompute: Any = None
    #: The update chain (``builder.transforms``): what each algorithm does with its gradients.
    chain: tuple[Any, ...] = ()

    @property
    def final(self) -> int:
        """Index of the TrainingInfoProto that updates the parameters."""
        return 0 if self.accumulate == 1 else 1

    @property
    def taken(self) -> frozenset[str]:
        """Every name used in the main graph or given out for the model; each
        algorithm graph draws its own fresh names from a NameGen over these."""
        return frozenset(self.layout.taken)

    @property
    def state(self) -> dict[str, StateSpec]:
        return self.layout.state

    @property
    def slots(self) -> dict[str, dict[str, str]]:
        return self.layout.slots

    @property
    def step(self) -> str:
        return self.layout.step

    @property
    def accum(self) -> dict[str, str]:
        return self.layout.accum

    @property
    def accum_count(self) -> str:
        return self.layout.accum_count

    @property
    def accum_step(self) -> str:
        return self.layout.accum_step


@dataclass(frozen=True)
class Learned:
    """What ``Algorithm.build`` learns while it emits training_info[index]'s
    algorithm graph (the builder's metadata is made of it)."""

    index: int
    #: The training-mode copy's prediction, where there is a copy.
    train_prediction: str = ""
    #: Whether it updates BatchNormalization running statistics.
    running_stats: bool = False
    #: The 0-D float64 settings it keeps as state (``Algorithm.hyperparameter``).
    hyperparameters: tuple[StateSpec, ...] = ()
    #: The state variable holding the base learning rate, and the rate the
    #: update uses (lr * schedule(step)).
    lr_state: str = ""
    lr_value: str = ""
    #: The state variable holding a schedule's total taken from the run (cosine()).
    schedule_total: str = ""
    #: The state variable holding the clipping threshold.
    clip_state: str = ""
    #: With accumulate > 1: the gradient sums (sums + this batch's gradient)
    #: the final algorithm divides, which data-parallel training reduces
    #: across ranks once per optimizer step (metadata ``onnxtrain.data_parallel``).
    reduce_points: tuple[str, ...] = ()
