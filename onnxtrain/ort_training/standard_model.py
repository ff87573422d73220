"""The standard ONNX training model behind ``Module`` and ``Optimizer``.

ONNX Runtime training splits a step into ``module(x, y)`` (forward, backward,
gradients added into buffers until ``lazy_reset_grad()``) and
``optimizer.step()`` (the update from those buffers).  ``training_model`` builds
one TrainingInfoProto model with the same split, from a **forward model**
(inputs: the user inputs then the parameters; first output: the loss):

- main graph: the forward model, parameters as initializers, plus the state
  the two algorithms share (initializers no node of it reads): the gradient
  buffers ``<p>@grad``, the flag ``@lazy_reset_grad``, the learning rate,
  the step count and the optimizer moments ``<p>@momentum0/1``;
- training_info[0] ("module"): ``g = Gradient(xs=trainable, zs=user inputs,
  y=loss)``; ``buffer = reset ? g : buffer + g``; ``reset = false``;
- training_info[1] ("optimizer"): optional global-norm clipping of the
  buffers, then the update of every trainable parameter, ``step + 1``.

Training-mode BatchNormalization updates its running mean and variance in
training_info[0] (``running``: each statistic, a state variable, bound to
the node output holding its new value), which the eval model then reads.

Update rules (``cfg.kind``), with g the summed gradient, as 1.19.2's kernels:

- SGD:   p <- p - lr g;
- AdamW (Hugging Face form, ``adam_mode=1``), t = step + 1:
  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;
  p <- p - lr_t m / (sqrt(v) + eps), lr_t = lr sqrt(1 - b2^t) / (1 - b1^t)
  (lr without bias correction);  then p <- p - lr wd p (decay after the update);
- clipping: g <- g * min(1, max_norm / (||g||_2 + 1e-6)) over all gradients.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..core.emitter import Emitter
from ..core.names import NameGen
from ..optim.rules import apply
from ..optim.transforms import clip_by_global_norm
from ..optim.updates import adam_step_size

PREVIEW = "ai.onnx.preview.training"
RESET = "@lazy_reset_grad"
LR = "@learning_rate"
STEP = "@step"
#: metadata key of the optimizer settings in the optimizer models we write
OPTIMIZER_KEY = "ort_training.optimizer"


def grad_name(p: str) -> str:
    return f"{p}@grad"


def moment_name(p: str, i: int) -> str:
    return f"{p}@momentum{i}"


@dataclass
class OptimizerConfig:
    """What an optimizer model describes."""

    kind: str = "AdamW"              # "AdamW" or "SGD"
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.0
    bias_correction: bool = True
    max_norm: float | None = None    # ClipGradNorm

    @property
    def moments(self) -> int:
        return 2 if self.kind == "AdamW" else 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def emitter(taken: set[str] | NameGen, opset: int, dtypes: dict[str, int], hint: str) -> Emitter:
    """An emitter for one of these graphs: fresh names that avoid ``taken``."""
    names = taken if isinstance(taken, NameGen) else NameGen(taken)
    return Emitter(opset, names, dtypes, hint=hint)


def adamw_update(e: Emitter, cfg: OptimizerConfig, lr: str, t: str, p: str, grad: str, m0: str, m1: str
                 ) -> tuple[str, str, str]:
    """One AdamW update (see the module docstring): the rule ``Adam`` with
    the bias correction in ``p``'s element type (``lr`` and ``t``, step + 1,
    already of it) and eps as given, then ``DecayAfter`` with s = lr wd."""
    et = e.dtype(p)
    b1, b2 = cfg.betas
    step_size = lr
    if cfg.bias_correction:
        step_size, _ = adam_step_size(e, lr, t, b1, b2, et)
    scalars = {"b1": e.const(b1, dtype=et), "c1": e.const(1 - b1, dtype=et), "b2": e.const(b2, dtype=et),
               "c2": e.const(1 - b2, dtype=et), "eps": e.const(cfg.eps, dtype=et), "step": step_size}
    out = apply(e, "Adam", {**scalars, "p": p, "g": grad, "m": m0, "v": m1})
    p_new = out["p_new"]
    if cfg.weight_decay:
        s = e.Mul(lr, e.const(cfg.weight_decay, dtype=et))
        p_new = apply(e, "DecayAfter", {"s": s, "p": p_new})["p_new"]
    return p_new, out["m_new"], out["v_new"]


def _vi(name: str, arr_or_dtype, shape=None) -> onnx.ValueInfoProto:
    if isinstance(arr_or_dtype, np.ndarray):
        dtype, shape = arr_or_dtype.dtype, list(arr_or_dtype.shape)
    else:
        dtype = np.dtype(arr_or_dtype)
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(dtype), shape)


def _bind(ti: onnx.TrainingInfoProto, graph: onnx.GraphProto, key: str, value: str,
          like: np.ndarray) -> None:
    graph.output.append(_vi(value, like))
    ti.update_binding.add(key=key, value=value)


def training_model(forward: onnx.ModelProto, values: dict[str, np.ndarray],
                   trainable: Sequence[str], optimizer: OptimizerConfig | None,
                   extra_state: dict[str, np.ndarray] | None = None,
                   fused: bool = False, running: Mapping[str, str] | None = None) -> onnx.ModelProto:
    """The TrainingInfoProto model (see the module docstring).

    ``values``: every parameter (graph inputs of ``forward`` or initializers)
    with its value, running statistics included; ``trainable``: those that
    get gradients; ``extra_state``: start values of the shared state
    (gradient buffers, moments, step, lr) by name, zeros / defaults
    otherwise; ``running``: statistic -> the value that updates it
    (``models.running_statistics``).

    ``fused=False`` (Module's layout): the main graph holds only the state
    and the forward pass sits in training_info[0], so that training_info[1]
    (the optimizer) needs no feeds.  ``fused=True`` (``import_ort``'s): the
    main graph is the forward model (inference and evaluation work as for any
    training model) and one training_info applies the optimizer to the
    gradient of the batch directly, without buffers."""
    forward = _with_parameters(forward, values)
    loss = forward.graph.output[0].name
    params = set(values)
    user_inputs = [i.name for i in forward.graph.input]
    state = _shared_state(values, trainable, optimizer, extra_state, fused)
    taken = _taken_names(forward, state)

    model = onnx.ModelProto()
    model.CopyFrom(forward)
    main = model.graph
    ti = model.training_info.add()
    ti.algorithm.name = "module_step"
    if not fused:  # the forward pass moves into training_info[0]
        _move_forward(main, ti.algorithm, params)
    main.initializer.extend(numpy_helper.from_array(v, n) for n, v in state.items())

    opset = _opsets(forward)[""]
    dtypes = {n: helper.np_dtype_to_tensor_dtype(np.asarray(v).dtype) for n, v in {**values, **state}.items()}
    names = NameGen(taken)
    e = emitter(names, opset, dtypes, "module")
    grads = e.op("Gradient", list(trainable) + user_inputs, outputs=len(trainable), domain=PREVIEW,
                 xs=list(trainable), zs=user_inputs, y=loss)
    grads = [grads] if isinstance(grads, str) else grads
    for p, gr in zip(trainable, grads):
        e.dtypes[gr] = dtypes[p]
    if not fused:  # gradients summed into the buffers
        for p, gr in zip(trainable, grads):
            new = e.Where(RESET, gr, e.Add(grad_name(p), gr))
            _bind(ti, ti.algorithm, grad_name(p), new, values[p])
        _bind(ti, ti.algorithm, RESET, e.const(False, dtype=np.bool_), state[RESET])
    running = dict(running or {})
    for stat, new in running.items():  # the forward pass's own update
        _bind(ti, ti.algorithm, stat, e.Identity(new), values[stat])
    if not fused:
        ti.algorithm.node.extend(e.nodes)
        ti = model.training_info.add()
        ti.algorithm.name = "optimizer_step"
        e = emitter(names, opset, dtypes, "optimizer")
        grads = [grad_name(p) for p in trainable]
    updates = _updates(e, optimizer, trainable, grads) if optimizer is not None else {}
    # identity bindings keep every parameter and setting a state variable
    for name in [*(n for n in values if n not in running),
                 *(k for k in state if k not in (RESET,) and "@grad" not in k)]:
        value = updates.get(name) or e.Identity(name)
        _bind(ti, ti.algorithm, name, value, values.get(name, state.get(name)))
    ti.algorithm.node.extend(e.nodes)

    del model.opset_import[:]
    for domain, version in _opsets(forward).items():
        model.opset_import.add(domain=domain, version=version)
    model.opset_import.add(domain=PREVIEW, version=1)
    model.ir_version = max(model.ir_version, 8)
    return model


def _taken_names(forward: onnx.ModelProto, state: dict[str, np.ndarray]) -> set[str]:
    """Every name the model and its shared state use (fresh names avoid them); a state
    variable named like a value of the model is refused."""
    taken = {v for n in forward.graph.node for v in (*n.input, *n.output)} | {
        i.name for i in forward.graph.input} | {t.name for t in forward.graph.initializer}
    clash = sorted(taken & set(state))
    if clash:
        raise ValueError(f"the model already has a value named {clash[0]!r}")
    return taken | set(state)


def _move_forward(main: onnx.GraphProto, algo: onnx.GraphProto, params: set[str]) -> None:
    """Move the forward pass from ``main`` into ``algo``, leaving ``main`` (named "state") the
    parameters' initializers alone."""
    algo.node.extend(main.node)
    algo.input.extend(main.input)
    algo.output.extend(main.output)
    algo.value_info.extend(main.value_info)
    algo.initializer.extend(t for t in main.initializer if t.name not in params)
    kept = [t for t in main.initializer if t.name in params]
    for field in ("node", "input", "output", "value_info", "initializer"):
        main.ClearField(field)
    main.initializer.extend(kept)
    main.name = "state"


def _with_parameters(forward: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``forward`` whose parameters are initializers holding ``values``."""
    out = onnx.ModelProto()
    out.CopyFrom(forward)
    graph = out.graph
    kept = [i for i in graph.input if i.name not in values]
    del graph.input[:]
    graph.input.extend(kept)
    others = [t for t in graph.initializer if t.name not in values]
    del graph.initializer[:]
    graph.initializer.extend(others)
    graph.initializer.extend(numpy_helper.from_array(np.asarray(values[n]), n) for n in values)
    return out


def _shared_state(values, trainable, optimizer, extra_state, fused) -> dict[str, np.ndarray]:
    state: dict[str, np.ndarray] = {}
    for p in trainable:
        if not fused:
            state[grad_name(p)] = np.zeros_like(values[p])
        for i in range(optimizer.moments if optimizer is not None else 0):
            state[moment_name(p, i)] = np.zeros_like(values[p])
    if not fused:
        state[RESET] = np.array(False)
    state[LR] = np.array(0.001, np.float32)
    state[STEP] = np.array(0, np.int64)
    for name, value in (extra_state or {}).items():
        if name in state:
            state[name] = np.asarray(value, state[name].dtype).reshape(state[name].shape)
    return state


def _updates(e: Emitter, optimizer: OptimizerConfig, trainable: Sequence[str], grads: list[str]
             ) -> dict[str, str]:
    """The new value of every parameter, moment and the step."""
    updates: dict[str, str] = {}
    if not trainable:
        return updates
    et = e.dtype(trainable[0])
    if optimizer.max_norm is not None:
        grads = clip_by_global_norm(e, grads, e.const(float(optimizer.max_norm), dtype=et), et)
    lr = e.Cast(LR, to=et)
    t = e.Cast(e.Add(STEP, e.scalar_int(1)), to=et)
    for p, gr in zip(trainable, grads):
        if optimizer.kind == "SGD":
            updates[p] = apply(e, "SGD", {"lr": lr, "p": p, "g": gr})["p_new"]
        else:
            m0, m1 = moment_name(p, 0), moment_name(p, 1)
            updates[p], updates[m0], updates[m1] = adamw_update(e, optimizer, lr, t, p, gr, m0, m1)
    updates[STEP] = e.Add(STEP, e.scalar_int(1))
    return updates


def _opsets(forward: onnx.ModelProto) -> dict[str, int]:
    """The forward model's opsets that its nodes use (default domain at least 13)."""
    used = {n.domain for n in forward.graph.node}
    out = {o.domain: o.version for o in forward.opset_import
           if o.domain in used or o.domain in ("", "ai.onnx")}
    out[""] = max(out.pop("ai.onnx", 0), out.get("", 0), 13)
    return out
