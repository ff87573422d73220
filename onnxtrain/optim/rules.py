"""Update rules: the per-tensor arithmetic of each optimizer, written once.

An update rule is the elementwise part of one optimizer step: a few scalar
operands (one element each, in the parameter's element type: learning
rates, moment decays, bias corrections, computed once per step by whoever
applies the rule) and, per parameter, its value, its gradient and its
state in; its new value and new state out.  Its ``body`` emits standard ONNX
ops through an ``Emitter``; it is the one description every user applies
with ``apply``: the builder's optimizers (``builder/optimizers.py``), the
spec ops of ``ai.onnx.preview.training`` (``optim/spec_ops.py``) and ONNX
Runtime training's models (``ort_training/standard_model.py``).

**Calls.**  The nodes one ``apply`` emits form a *call*: each is named
``onnxtrain.rule/<rule>/<variant>/<dtype>/<call>/<k>`` (``k``: its place in
the body).  A program keeps those names through every pass, so
``find_calls`` finds each call again by name alone and checks it against the
rule's own body, emitted once more over the formal operand names: the same
ops in the same order, the same operands wherever the body repeats one, and
no reader outside the call of a value inside it.  Where a rule names a fused
kernel (``FusedKernel``), ``kernels.fuse.fuse_rule_calls`` replaces each
intact call by that kernel: no arithmetic is matched, and a new rule with a
kernel is fused without a line of the rewrite changing.  A call some pass
changed (the Gemm fusion folds a ``WeightDecay`` call into a Gemm) no longer
matches its body and keeps its standard ops.

Standard programs are plain ONNX of the default domain: a call is ordinary
nodes with particular names, never a function or a custom op.

>>> from onnxtrain.core.emitter import Emitter
>>> from onnxtrain.core.names import NameGen
>>> e = Emitter(17, NameGen(["lr", "p", "g"]), {"lr": 1, "p": 1, "g": 1})
>>> out = apply(e, "SGD", {"lr": "lr", "p": "p", "g": "g"}, {"p_new": "p2"})
>>> [(n.op_type, n.name) for n in e.nodes]
[('Mul', 'onnxtrain.rule/SGD/-/float32/c/0'), ('Sub', 'onnxtrain.rule/SGD/-/float32/c/1')]
>>> [(c.rule.name, c.outputs) for c in find_calls(e.nodes, ["p2"])]
[('SGD', {'p_new': 'p2'})]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..core.emitter import Emitter, np_dtype
from ..core.names import NameGen

#: The first part of the name of every node of a call.
PREFIX = "onnxtrain.rule"

#: A rule's body: (emitter, operands present by name) -> outputs by name.
Body = Callable[[Emitter, Mapping[str, str]], Mapping[str, str]]


@dataclass(frozen=True)
class FusedKernel:
    """The op of the kernel library (``onnxtrain/kernels``) that computes a
    rule in one pass: ``<op>F32`` / ``<op>F64`` of ``ai.onnxtrain.kernels``.

    It takes ``scalars`` (names of the rule's operands, in the kernel's
    order), then per tensor the rule's ``tensors`` (``tensors_first``: the
    tensors, then the scalars), and gives per tensor the rule's ``outputs``.
    ``multi_tensor``: its tensors are variadic, so one node may update many.  ``decay``: the scalar slot through which the
    kernel adds ``nc * x`` to the gradient itself, taking in the
    ``WeightDecay`` call that feeds the rule's ``g``.  ``defaults``: values
    of optional operands the kernel needs where a call lacks them."""

    op: str
    scalars: tuple[str, ...]
    multi_tensor: bool = False
    decay: str | None = None
    defaults: Mapping[str, float] = field(default_factory=dict)
    tensors_first: bool = False


@dataclass(frozen=True, eq=False)
class UpdateRule:
    """One update rule (see the module docstring); rules compare and hash by identity."""

    name: str
    #: Operands of one element, in order (the kernel may order them otherwise).
    scalars: tuple[str, ...]
    #: Per-parameter operands: the parameter, its gradient, then its state.
    tensors: tuple[str, ...]
    #: Per-parameter results: the new parameter, then the new state.
    outputs: tuple[str, ...]
    body: Body
    #: Operands a call may leave out (the body then skips what they do).
    optional: tuple[str, ...] = ()
    #: Operands of type int64 (all others have the parameter's element type).
    integer: tuple[str, ...] = ()
    kernel: FusedKernel | None = None

    @property
    def operands(self) -> tuple[str, ...]:
        return self.scalars + self.tensors

    @property
    def typed_by(self) -> str:
        """The operand whose element type is the rule's."""
        return next(o for o in (*self.tensors, *self.scalars) if o not in self.integer)


#: Every rule, by name (``optim/updates.py`` registers onnxtrain's own).
RULES: dict[str, UpdateRule] = {}


def update_rule(name: str, scalars: Sequence[str], tensors: Sequence[str], outputs: Sequence[str],
                optional: Sequence[str] = (), integer: Sequence[str] = (),
                kernel: FusedKernel | None = None) -> Callable[[Body], UpdateRule]:
    """Register the decorated body as rule ``name`` (see ``UpdateRule``)."""

    def register_body(body: Body) -> UpdateRule:
        rule = UpdateRule(name, tuple(scalars), tuple(tensors), tuple(outputs), body, tuple(optional),
                          tuple(integer), kernel)
        register(rule)
        return rule

    return register_body


def register(rule: UpdateRule) -> None:
    """Add ``rule`` to ``RULES``; a name is registered once."""
    if "/" in rule.name or not rule.name:
        raise ValueError(f"update rule name {rule.name!r}: expected a non-empty name without '/'")
    if rule.name in RULES:
        raise ValueError(f"update rule {rule.name!r} is registered twice")
    unknown = [o for o in (*rule.optional, *rule.integer) if o not in rule.operands]
    if rule.kernel is not None:
        unknown += [s for s in rule.kernel.scalars if s not in rule.operands and s != rule.kernel.decay]
    if unknown:
        raise ValueError(f"update rule {rule.name!r}: {unknown} are not among its operands {rule.operands}")
    RULES[rule.name] = rule


@contextmanager
def registered(rule: UpdateRule) -> Iterator[UpdateRule]:
    """``rule`` registered for the duration of a ``with`` block (tests, experiments)."""
    register(rule)
    try:
        yield rule
    finally:
        RULES.pop(rule.name, None)


def _rule(rule: str | UpdateRule) -> UpdateRule:
    if isinstance(rule, UpdateRule):
        return rule
    try:
        return RULES[rule]
    except KeyError:
        raise ValueError(f"no update rule named {rule!r}; known: {sorted(RULES)}") from None


# ------------------------------------------------------------------ emitting
def apply(e: Emitter, rule: str | UpdateRule, operands: Mapping[str, str | None],
          outputs: Mapping[str, str] | None = None) -> dict[str, str]:
    """Emit one call of ``rule`` over ``operands`` (name -> tensor; None or
    '' for an optional operand left out); returns its outputs by name.
    ``outputs`` names some of them ('' or absent: a fresh name)."""
    rule = _rule(rule)
    given = {k: v for k, v in operands.items() if v}
    unknown = sorted(set(given) - set(rule.operands))
    missing = [o for o in rule.operands if o not in given and o not in rule.optional]
    if unknown or missing:
        raise ValueError(f"update rule {rule.name!r} takes operands {list(rule.operands)} "
                         f"(optional: {list(rule.optional)}); unknown {unknown}, missing {missing}")
    et = e.dtype(given[rule.typed_by])
    start = len(e.nodes)
    result = dict(rule.body(e, given))
    nodes = e.nodes[start:]
    for name, value in result.items():
        if value in given.values():
            raise ValueError(f"update rule {rule.name!r}: output {name!r} passes an operand through; "
                             "every output must be computed by the body")
    for out, name in (outputs or {}).items():
        if name:
            _rename(nodes, result[out], name)
            e.dtypes[name] = e.dtypes.get(result[out], et)
            result[out] = name
    variant = ".".join(o for o in rule.optional if o in given) or "-"
    call = e.names.fresh(f"{PREFIX}/{rule.name}/{variant}/{np_dtype(et).name}/c")
    for k, node in enumerate(nodes):
        node.name = f"{call}/{k}"
    e.names.reserve(n.name for n in nodes)
    return result


def _rename(nodes: Sequence[onnx.NodeProto], old: str, new: str) -> None:
    for node in nodes:
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = new
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new


@functools.lru_cache(maxsize=None)
def formal_body(rule: UpdateRule, variant: tuple[str, ...], et: int) -> tuple[onnx.NodeProto, ...]:
    """The body of ``rule`` over its formal operand names (those of
    ``variant``'s optional ones included), for element type ``et``."""
    present = [o for o in rule.operands if o not in rule.optional or o in variant]
    dtypes = {o: (TensorProto.INT64 if o in rule.integer else et) for o in present}
    e = Emitter(17, NameGen(rule.operands), dtypes, hint="formal")
    outputs = rule.body(e, {o: o for o in present})
    for name in rule.outputs:
        if outputs.get(name) not in {o for n in e.nodes for o in n.output}:
            raise ValueError(f"update rule {rule.name!r}: its body gives no computed {name!r}")
    constants = [n for n in e.nodes if n.op_type in ("Constant", "ConstantOfShape")]
    if constants:
        raise ValueError(f"update rule {rule.name!r}: its body emits a Constant; numbers are operands "
                         "(the fused kernel reads them)")
    for node in e.nodes:
        node.name = ""
    return tuple(e.nodes) + (_outputs_node(rule, outputs),)


def _outputs_node(rule: UpdateRule, outputs: Mapping[str, str]) -> onnx.NodeProto:
    """A marker holding the formal outputs in ``rule.outputs`` order (not a node of the body)."""
    return helper.make_node("Outputs", [outputs[o] for o in rule.outputs], [])


# ------------------------------------------------------------------ finding
@dataclass(frozen=True)
class Call:
    """One intact call of a rule in a node list."""

    rule: UpdateRule
    variant: tuple[str, ...]
    et: int
    #: Indices of its nodes in the node list, in body order.
    nodes: tuple[int, ...]
    #: Operand name -> the tensor it is (the variant's operands).
    operands: dict[str, str]
    #: Output name -> the tensor written.
    outputs: dict[str, str]


def parse_name(name: str) -> tuple[str, tuple[str, ...], int, str, int] | None:
    """(rule, variant, element type, call, k) of a call's node name, else None."""
    if not name.startswith(PREFIX + "/"):
        return None
    parts = name.split("/")
    if len(parts) != 6 or not parts[5].isdigit():
        return None
    _, rule, variant, dtype, call, k = parts
    try:
        et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    except TypeError:
        return None
    return rule, (() if variant == "-" else tuple(variant.split("."))), et, call, int(k)


def find_calls(nodes: Sequence[onnx.NodeProto], graph_outputs: Sequence[str] = ()) -> list[Call]:
    """Every intact call of a registered rule in ``nodes`` (see the module
    docstring), in the order of their first node.  ``graph_outputs``: names
    read outside ``nodes`` (a value inside a call must not be one)."""
    groups: dict[str, list[tuple[int, int]]] = {}
    heads: dict[str, tuple[str, tuple[str, ...], int]] = {}
    for index, node in enumerate(nodes):
        parsed = parse_name(node.name) if node.name.startswith(PREFIX) else None
        if parsed is None:
            continue
        rule, variant, et, _, k = parsed
        key = node.name.rsplit("/", 1)[0]
        groups.setdefault(key, []).append((k, index))
        heads[key] = (rule, variant, et)
    if not groups:
        return []
    readers: dict[str, set[int]] = {}
    for index, node in enumerate(nodes):
        for name in node.input:
            readers.setdefault(name, set()).add(index)
    outside = set(graph_outputs)
    calls = []
    for key, members in groups.items():
        name, variant, et = heads[key]
        rule = RULES.get(name)
        if rule is None or any(v not in rule.optional for v in variant):
            continue
        members.sort()
        if [k for k, _ in members] != list(range(len(members))):
            continue  # a pass removed or added nodes of the call
        found = _match(rule, variant, et, [nodes[i] for _, i in members])
        if found is None:
            continue
        operands, outputs, inner = found
        indices = tuple(i for _, i in members)
        mine = set(indices)
        if any(v in outside or not readers.get(v, set()) <= mine for v in inner):
            continue  # a value inside the call is read elsewhere: it must stay computed
        calls.append(Call(rule, variant, et, indices, operands, outputs))
    calls.sort(key=lambda c: c.nodes[0])
    return calls


def _match(rule: UpdateRule, variant: tuple[str, ...], et: int, actual: Sequence[onnx.NodeProto]):
    """(operands, outputs, intermediate values) of ``actual`` read as the
    body of ``rule``, or None where it is not that body."""
    try:
        formal = formal_body(rule, variant, et)
    except (ValueError, KeyError):
        return None
    *body, marker = formal
    if len(body) != len(actual):
        return None
    env: dict[str, str] = {}
    produced: list[str] = []
    for f, a in zip(body, actual):
        if (f.op_type != a.op_type or a.domain not in ("", "ai.onnx") or len(f.input) != len(a.input)
                or len(f.output) != len(a.output) or _attributes(f) != _attributes(a)):
            return None
        for fi, ai in zip(f.input, a.input):
            if env.setdefault(fi, ai) != ai:
                return None
        for fo, ao in zip(f.output, a.output):
            if fo in env or not ao:
                return None
            env[fo] = ao
            produced.append(fo)
    operands = {o: env[o] for o in rule.operands if o in env}
    if any(o not in operands for o in rule.operands if o not in rule.optional or o in variant):
        return None
    outputs = {o: env[f] for o, f in zip(rule.outputs, marker.input)}
    finals = set(marker.input)
    inner = [env[f] for f in produced if f not in finals]
    return operands, outputs, inner


def _attributes(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}
