"""The algorithm and initialization graphs the builder writes: forward pass,
loss, gradients, then the plan's chain of transforms (``builder.transforms``:
accumulation, clipping, the rate and its schedule, the optimizer update)
(``Algorithm``), and the graphs that reset the state it adds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..core.emitter import Emitter, np_dtype
from ..core.graph import PREVIEW_DOMAIN
from ..core.names import NameGen
from .plan import F64, Learned, Plan, StateSpec
from .train_forward import training_forward
from .transforms import Step


# ------------------------------------------------------------------ algorithm
class Algorithm:
    """The algorithm graph and update_binding of training_info[index]; ``earlier``:
    what the algorithms before it learned (their settings' names are taken)."""

    def __init__(self, plan: Plan, index: int, earlier: Sequence[Learned] = ()) -> None:
        self.plan = plan
        self.index = index
        settings = [h for learned in earlier for h in learned.hyperparameters]
        self.e = Emitter(plan.opset, NameGen(plan.taken | {h.name for h in settings}), dict(plan.dtypes))
        for var in [*plan.state.values(), *settings]:
            self.e.dtypes[var.name] = var.elem_type
        #: What emitting learns (``build`` returns it).
        self.learned = Learned(index)
        self.outputs: list[onnx.ValueInfoProto] = []
        #: Types of values shape inference cannot derive (Gradient's outputs).
        self.value_info: list[onnx.ValueInfoProto] = []
        self.bindings: list[tuple[str, str]] = []
        self.loss_type = plan.dtypes[plan.prediction]

    def build(self, ti: onnx.TrainingInfoProto) -> Learned:
        """Emit the algorithm graph into ``ti``; what it learned doing so."""
        plan = self.plan
        prediction, running_stats = self.forward()
        if prediction != plan.prediction:
            self.learn(train_prediction=prediction)
        loss = self.loss(prediction)
        grads = self.gradients(loss)
        if self.index == 0:
            self.learn(running_stats=bool(running_stats))
            for key, value in running_stats:
                self.bind(key, value)
        step: Step | None = Step(grads)
        for transform in plan.chain:  # builder.transforms: accumulation, clipping, rate, optimizer
            step = transform.update(self, step)
            if step is None:
                break
        self.graph(ti.algorithm)
        for key, value in self.bindings:
            ti.update_binding.add(key=key, value=value)
        return self.learned

    # -- bookkeeping
    def learn(self, **learned: object) -> None:
        """Record what emitting learned (fields of ``Learned``)."""
        self.learned = replace(self.learned, **learned)

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
        fill_graph(
            graph, self.e.nodes, f"training_info[{self.index}].algorithm", [plan.target],
            [loss_vi] + self.outputs, value_info=self.value_info,
        )
        for var in [*plan.state.values(), *self.learned.hyperparameters]:
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

    def hyperparameter(self, hint: str, value: float) -> str:
        """A 0-D float64 state variable of this algorithm graph, reset to
        ``value`` by this TrainingInfoProto's initialization_binding (which is
        what makes it state per IR.md) and bound by no update: a setting the
        session can change between steps without rebuilding anything, saved
        with a checkpoint and read by the step like any other state."""
        e = self.e
        name = e.names.fresh(hint)
        setting = StateSpec(name, F64, (), self.index, self.index, fill=float(value))
        self.learn(hyperparameters=self.learned.hyperparameters + (setting,))
        e.dtypes[name] = F64
        return name


# ------------------------------------------------------------------ initialization
def initialization_graph(plan: Plan, learned: Learned, ti: onnx.TrainingInfoProto) -> None:
    """The graph that resets the state variables training_info[index] owns
    (``learned``: what its algorithm learned, the settings it keeps included)."""
    index = learned.index
    owned = [var for var in [*plan.state.values(), *learned.hyperparameters] if var.reset_by == index]
    if index == 0:
        owned += running_stat_vars(plan, ti)
    names = NameGen(v.name for v in owned)
    e = Emitter(plan.opset, names, hint="init")
    outputs, binding = [], []
    #: (node index, starting tensor) of the Constants whose value is filled in last.
    fills: list[tuple[int, onnx.TensorProto]] = []
    for var in owned:
        if var.initial is not None:
            fills.append((len(e.nodes), var.initial))
        value = initial_value(e, var, names.fresh(f"{var.name}.initial"))
        outputs.append(var.value_info(value))
        binding.append((var.name, value))
    graph = ti.initialization
    fill_graph(graph, e.nodes, f"training_info[{index}].initialization", [], outputs)
    # The starting values are copied once, straight into their place in the
    # model (their Constants were emitted with the type and dims only).
    for position, initial in fills:
        value = graph.node[position].attribute[0].t
        value.CopyFrom(initial)  # bit for bit, whatever the storage field
        value.ClearField("name")
    for key, value in binding:
        ti.initialization_binding.add(key=key, value=value)


def running_stat_vars(plan: Plan, ti: onnx.TrainingInfoProto) -> list[StateSpec]:
    """BatchNormalization statistics bound by this TrainingInfoProto, as state to reset."""
    inits = {t.name: t for t in plan.proto.graph.initializer}
    out = []
    for b in ti.update_binding:
        if b.key in inits and b.key not in plan.state:
            t = inits[b.key]
            out.append(StateSpec(b.key, t.data_type, tuple(t.dims), "main", 0, initial=t, existing=True))
    return out


def initial_value(e: Emitter, var: StateSpec, out: str) -> str:
    """A Constant holding the starting value (ConstantOfShape for a fill of a tensor)."""
    if var.initial is not None:
        # The type and dims only: ``initialization_graph`` copies the data in place.
        value = onnx.TensorProto(data_type=var.initial.data_type, dims=var.initial.dims)
        e.op("Constant", [], outputs=[out], value=value)
    elif not var.shape:
        e.op("Constant", [], outputs=[out], value=numpy_helper.from_array(var.start_value()))
    else:
        fill = numpy_helper.from_array(np.asarray([var.fill], dtype=np_dtype(var.elem_type)))
        e.op("ConstantOfShape", [e.ints(var.shape)], outputs=[out], value=fill)
    return out


def fill_graph(
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
