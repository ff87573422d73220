"""What the passes of ``pipeline`` work on: one program's graph, built inside
its model, and what the passes learn along the way (``Lowering``), and what
the program is made from (``Request``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import onnx
from onnx import helper

from ..core.graph import PREVIEW_DOMAIN
from ..core.names import NameGen
from ..io.model import TrainingModel, copy_graph, uses_preview_ops

#: Default-domain opset given to programs of models that import none.
DEFAULT_OPSET = 17

#: The kinds of program (``pipeline.PASS_LISTS`` has one pass list each),
#: which are also their roles in a ``programs.ProgramSet``.
INFERENCE, ALGORITHM, FORWARD, UPDATE, INITIALIZATION, EVALUATE = (
    "inference", "algorithm", "forward", "update", "initialization", "evaluate")


@dataclass(frozen=True)
class Request:
    """What a program is made from besides the model: ``index``, the
    training_info of an algorithm, initialization or evaluate program; for
    ``evaluate`` the ``outputs`` kept (the loss, the prediction) and the
    training-mode copy's prediction read as the main graph's ``prediction``;
    for the data-parallel halves the rank-local state (``local``) and the
    values reduced instead of the gradients (``reduce``; None: the gradients)."""

    index: int = 0
    outputs: tuple[str, ...] = ()
    prediction: str | None = None
    train_prediction: str | None = None
    local: tuple[str, ...] = ()
    reduce: tuple[str, ...] | None = None


@dataclass
class Lowering:
    """What the passes work on: one program's graph and what they share.

    The first step of a pass list (where the graph comes from) calls
    ``start``; the graph is then built in place inside ``model``."""

    tm: TrainingModel
    label: str
    request: Request = field(default_factory=Request)
    graph: onnx.GraphProto = field(default_factory=onnx.GraphProto)
    #: State variables held by the graph (as initializers, or left out by ``start``).
    state_here: set[str] = field(default_factory=set)
    opset_imports: list[onnx.OperatorSetIdProto] = field(default_factory=list)
    names: NameGen = field(default_factory=NameGen)
    #: Names defined before the first node (inputs and initializers).
    available: list[str] = field(default_factory=list)
    #: Whether the graph holds ai.onnx.preview.training ops to lower.
    training_ops: bool = False
    #: Every value a top-level Gradient node defined: output -> the x it differentiates
    #: by (filled by ``expand_gradient_nodes``; the data-parallel cut reduces them).
    gradients: dict[str, str] = field(default_factory=dict)
    #: The y of every top-level Gradient node (filled by ``expand_gradient_nodes``).
    differentiated: list[str] = field(default_factory=list)
    #: The model whose graph ``graph`` is, if any: ``to_model`` fills it in
    #: instead of copying the graph into a new one.
    model: onnx.ModelProto | None = field(default=None, repr=False)
    #: The data-parallel cut of this algorithm (``split.Cut``), once made.
    cut: Any = field(default=None, repr=False)
    #: On a half of a cut: what runs between the halves (``split.Between``).
    between: Any = field(default=None, repr=False)

    def start(self, graph: onnx.GraphProto | None, state_left_out: set[str] | frozenset[str] = frozenset()
              ) -> None:
        """Make a copy of ``graph`` this program's graph, inside its model,
        without the data of its state initializers (they become inputs fed
        from the session's buffers: copying them would double the memory of
        a large model).  ``state_left_out``: state variables whose
        initializers the caller already left out of ``graph``.  ``graph``
        None: the caller built the graph in ``model`` (a new ModelProto it
        set), every state initializer left out."""
        tm = self.tm
        if graph is None:
            state_here = set(state_left_out)
        else:
            state_here = {
                name
                for name in [t.name for t in graph.initializer] + [t.values.name for t in graph.sparse_initializer]
                if name in tm.state
            } | set(state_left_out)
            self.model = onnx.ModelProto()
            copy_graph(graph, exclude_initializers=state_here, into=self.model.graph)
        self.graph = self.model.graph
        self.state_here = state_here
        opset_imports = list(tm.proto.opset_import)
        if not any(o.domain in ("", "ai.onnx") for o in opset_imports):
            # Lowered Gradient/optimizer ops are default-domain ops; models that
            # import only ai.onnx.preview.training (ONNX's own test cases) get one.
            opset_imports.append(helper.make_opsetid("", DEFAULT_OPSET))
        self.opset_imports = opset_imports
        self.training_ops = uses_preview_ops(self.graph)

    def copy(self, graph: onnx.GraphProto, label: str | None = None) -> Lowering:
        """The same lowering over another graph (a part of this one), sharing the names."""
        low = Lowering(self.tm, label or self.label, self.request, graph, set(self.state_here),
                       list(self.opset_imports))
        low.names, low.gradients = self.names, dict(self.gradients)
        low.training_ops = uses_preview_ops(graph)
        low.available = [i.name for i in graph.input] + [t.name for t in graph.initializer]
        low.available += [t.values.name for t in graph.sparse_initializer]
        return low

    def fork(self) -> Lowering:
        """A copy of this lowering whose graph (a copy, inside a model of its
        own) the passes may change without touching this one."""
        model = onnx.ModelProto()
        model.graph.CopyFrom(self.graph)
        low = self.copy(model.graph)
        low.model = model
        return low

    def set_nodes(self, nodes: list[onnx.NodeProto]) -> None:
        del self.graph.node[:]
        self.graph.node.extend(nodes)


def to_model(low: Lowering) -> onnx.ModelProto:
    """The lowered graph as a model: no preview import, the IR version capped."""
    proto = low.tm.proto
    imports = [o for o in low.opset_imports if o.domain != PREVIEW_DOMAIN]
    if low.model is not None and low.model.graph is low.graph:
        # The graph was built inside its model (``Lowering.start``): no copy.
        # The fields helper.make_model sets:
        model = low.model
        model.ir_version = onnx.IR_VERSION
        model.opset_import.extend(imports)
        model.producer_name = "onnxtrain"
        low.model = None  # handed out
    else:
        model = helper.make_model(low.graph, opset_imports=imports, producer_name="onnxtrain")
    # The training model's IR version (the runtime caps it to what its
    # onnxruntime loads: ``runtime.executor.MAX_IR_VERSION``).
    model.ir_version = max(proto.ir_version, 4) if proto.ir_version else 8
    model.functions.extend(proto.functions)
    return model


def as_model(low: Lowering) -> onnx.ModelProto:
    """A copy of the program as it stands (for a check), its state variables
    declared as inputs where a pass has not yet made them so."""
    proto = low.tm.proto
    model = helper.make_model(low.graph, opset_imports=list(low.opset_imports), producer_name="onnxtrain")
    model.ir_version = max(proto.ir_version, 4) if proto.ir_version else 8
    model.functions.extend(proto.functions)
    defined = {i.name for i in low.graph.input} | {t.name for t in low.graph.initializer}
    defined |= {t.values.name for t in low.graph.sparse_initializer}
    for name in sorted(low.state_here - defined):
        var = low.tm.state[name]
        model.graph.input.append(helper.make_tensor_value_info(name, var.elem_type, list(var.shape)))
    return model
