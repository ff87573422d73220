"""The program pipeline: one declared pass list per kind of program, from
where its graph comes from to the standard-op model a session runs.

``PASS_LISTS`` holds the list of every kind (its first step makes the graph):

================  =============================================================
kind              steps
================  =============================================================
inference         main_graph, FRONT, BACK                    (``run``, ``predict``)
algorithm         combine, FRONT, BACK                       (``train_step``)
forward           combine, FRONT, cut_forward, BACK          (data-parallel half A)
update            combine, FRONT, cut_update, BACK           (data-parallel half B)
initialization    initialization_graph, FRONT, BACK          (``initialize``)
evaluate          loss_graph, FRONT, BACK                    (``evaluate_batch``)
================  =============================================================

Where the graph comes from: the main graph M; the *combination* M ⊕ A_i of
the main graph and an algorithm (``combine``); an initialization graph I_i;
or M ⊕ A_i pruned to the loss (``loss_graph``).  Then

- FRONT makes it standard ops: ``state_to_inputs`` (state initializers
  become graph inputs, fed from the state), ``exact_quantized_products``
  (MatMulNBits with trained scales: accuracy_level 4 -> 1),
  ``batch_shared_products`` (a layer's LoRA down-projections, one product),
  ``expand_gradient_nodes`` (Gradient nodes become backward graphs),
  ``recompute_activations`` (where the model asks), ``lower_optimizer_nodes``
  (Adam / Momentum / Adagrad become calls of the update rules);
- the data-parallel cut (``split``) takes the forward + backward half or
  the update half of the algorithm;
- BACK tidies what runs: ``fuse_gemm_updates``, ``sort_and_prune``
  (topological order, no node no output needs), ``elide_output_identities``,
  ``shield_batch_norm_inputs``, ``refuse_preview_ops``,
  ``prune_unused_initializers``;

and ``lowering.to_model`` wraps the result without the preview import, its
IR version capped.  What onnxruntime then runs of a training program is
made by the *executed* lists (``executed.EXECUTED``: the kernel choice with
the optimizer, decoder and NCHWc kernels, lean memory's scratch outputs,
the in-place plan), which the runner executes.

``lower`` runs the lists of one source: steps the lists share at their
start run once (a data-parallel algorithm's combine and FRONT serve its
whole program and both halves; each branch but the last works on a copy).
Every program a list makes is SSA and topologically sorted; with checks on
(``check=True``, the tests' setting, or ``ONNXTRAIN_CHECK_PASSES=1``) that
holds after every step, and so do the step's own postcondition
(``POSTCONDITIONS``) and onnx.checker (``checks``); ``checks.PassError``
says which step broke what.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import onnx
from onnx import helper

from ..autodiff import expand_gradients, is_gradient
from ..core.graph import (
    PREVIEW_DOMAIN,
    batch_norm_training,
    node_inputs,
    opset_version,
    outer_references,
    overridable_inputs,
    prune,
    subgraphs,
    toposort,
)
from ..core.names import NameGen
from ..errors import TrainingModelError
from ..io.combine import combined_graph
from ..io.metadata import recompute_spec
from ..io.model import TrainingModel, uses_preview_ops
from ..kernels.fuse import fuse_gemm_updates as _fuse_gemm
from ..optim import lower_optimizers
from . import recompute, shared_products
from .checks import check_condition, check_sound, check_valid, checking, step_name
from .lowering import (
    ALGORITHM,
    EVALUATE,
    FORWARD,
    INFERENCE,
    INITIALIZATION,
    UPDATE,
    Lowering,
    Request,
    as_model,
)
from .split import cut_forward, cut_update

#: A step of a pass list: changes the lowering in place (None), or returns
#: the lowering the list goes on with (a half of the data-parallel cut).
Step = Callable[[Lowering], "Lowering | None"]


# --------------------------------------------------------------- graphs in
def _state_of(tm: TrainingModel, graphs: Iterable[onnx.GraphProto]) -> set[str]:
    """The state variables that are initializers (dense or sparse) of ``graphs``."""
    return {
        name
        for g in graphs
        for name in [t.name for t in g.initializer] + [t.values.name for t in g.sparse_initializer]
        if name in tm.state
    }


def main_graph(low: Lowering) -> None:
    """The main graph M (the inference program)."""
    low.start(low.tm.proto.graph)


def initialization_graph(low: Lowering) -> None:
    """The initialization graph I of ``training_info[request.index]``."""
    low.start(low.tm.proto.training_info[low.request.index].initialization)


def combine(low: Lowering) -> None:
    """M ⊕ A of ``training_info[request.index]``, built in the program's model
    without the state initializers (they become inputs: copying their data
    would double the memory)."""
    tm, index = low.tm, low.request.index
    ti = tm.proto.training_info[index]
    state = _state_of(tm, (tm.proto.graph, ti.algorithm))
    low.model = onnx.ModelProto()
    combined_graph(tm.proto, index, exclude_initializers=state, into=low.model.graph)
    low.start(None, state)


def loss_graph(low: Lowering) -> None:
    """M ⊕ A of ``training_info[request.index]`` pruned to ``request.outputs``
    (the loss, and the prediction).

    The Gradient and optimizer nodes are dead here, and so are the inputs
    and state (moments, counters) only they read, which are dropped so that
    the program is fed just what the forward pass needs.  Evaluation is
    inference: a loss that reads a training-mode copy of the forward pass
    (``request.train_prediction``: Dropout/BatchNormalization active) reads
    the main graph's ``request.prediction`` instead, and the copy is pruned away."""
    tm, request = low.tm, low.request
    ti = tm.proto.training_info[request.index]
    state = _state_of(tm, (tm.proto.graph, ti.algorithm))
    low.model = onnx.ModelProto()
    graph = combined_graph(tm.proto, request.index, exclude_initializers=state, into=low.model.graph)
    outputs = list(request.outputs)
    by_name = {o.name: o for o in graph.output}
    kept_outputs = [by_name[n] for n in outputs]
    del graph.output[:]
    graph.output.extend(kept_outputs)
    train_prediction, prediction = request.train_prediction, request.prediction
    if train_prediction and prediction:
        for node in graph.node:
            if train_prediction in node.input:
                node.input[:] = [prediction if i == train_prediction else i for i in node.input]
    live = prune(list(graph.node), outputs)
    del graph.node[:]
    graph.node.extend(live)
    used = set(outputs)
    for node in live:
        used.update(node_inputs(node))
    for fld, name_of in (("input", lambda v: v.name), ("initializer", lambda t: t.name),
                         ("sparse_initializer", lambda t: t.values.name)):
        items = [x for x in getattr(graph, fld) if name_of(x) in used]
        del getattr(graph, fld)[:]
        getattr(graph, fld).extend(items)
    low.start(None, state & used)


# ------------------------------------------------------------------ passes
def state_to_inputs(low: Lowering) -> None:
    """Replace state initializers by graph inputs of the same type and shape."""
    g, tm, state_here = low.graph, low.tm, low.state_here
    declared = {i.name for i in g.input}
    kept = [t for t in g.initializer if t.name not in state_here]
    kept_sparse = [t for t in g.sparse_initializer if t.values.name not in state_here]
    del g.initializer[:]
    g.initializer.extend(kept)
    del g.sparse_initializer[:]
    g.sparse_initializer.extend(kept_sparse)
    for name in sorted(state_here, key=list(tm.state).index):
        var = tm.state[name]
        vi = helper.make_tensor_value_info(name, var.elem_type, list(var.shape))
        if name in declared:
            for existing in g.input:
                if existing.name == name:
                    existing.CopyFrom(vi)
        else:
            g.input.append(vi)
    low.available = [i.name for i in g.input] + [t.name for t in g.initializer]
    low.available += [t.values.name for t in g.sparse_initializer]
    low.names = NameGen.from_graph(g)  # fresh names avoid every name in the graph


#: The accuracy level the programs give a MatMulNBits node whose scales come
#: at run time: onnxruntime (1.32) computes accuracy_level 4 (activations
#: rounded to int8) wrongly when the scales are not a constant initializer
#: (tests/autodiff/test_grad_contrib.py keeps a canary); level 1 is the float
#: product of A and the dequantized weights, exact to float32 rounding.
EXACT_NBITS_LEVEL = 1


def runtime_scaled_nbits(nodes: Iterable[onnx.NodeProto], constant: set[str]) -> list[onnx.NodeProto]:
    """The MatMulNBits nodes at accuracy_level 4 whose scales are not in
    ``constant`` (the names of the constant initializers): trained state,
    an input or a computed value."""
    return [n for n in nodes
            if n.op_type == "MatMulNBits" and n.domain == "com.microsoft" and len(n.input) > 2
            and n.input[2] not in constant
            and any(a.name == "accuracy_level" and a.i == 4 for a in n.attribute)]


def exact_quantized_products(low: Lowering) -> None:
    """Run every MatMulNBits node whose scales come at run time (trained
    scales: state variables, inputs here) at ``EXACT_NBITS_LEVEL`` instead of
    accuracy_level 4.  The programs only: the model, and so every export of
    it, keeps its nodes as they were (``note_exact_quantized_products`` says so)."""
    g = low.graph
    constant = {t.name for t in g.initializer} - overridable_inputs(g)
    for node in runtime_scaled_nbits(g.node, constant):
        for a in node.attribute:
            if a.name == "accuracy_level":
                a.i = EXACT_NBITS_LEVEL


def note_exact_quantized_products(tm: TrainingModel) -> None:
    """Say in one warning which MatMulNBits nodes the programs of ``tm`` run
    at ``EXACT_NBITS_LEVEL`` (``exact_quantized_products``), if any."""
    proto = tm.proto
    constant = set()
    for g in [proto.graph] + [ti.algorithm for ti in proto.training_info]:
        constant |= {t.name for t in g.initializer} - overridable_inputs(g)
    constant -= set(tm.state)
    nodes = [n for g in [proto.graph] + [ti.algorithm for ti in proto.training_info]
             for n in runtime_scaled_nbits(g.node, constant)]
    if nodes:
        warnings.warn(
            f"{len(nodes)} MatMulNBits node(s) with trained scales (the first: "
            f"{nodes[0].name or nodes[0].output[0]!r}) run at accuracy_level {EXACT_NBITS_LEVEL} "
            "(the float product) instead of 4 in this session: onnxruntime computes accuracy_level "
            "4 wrongly when the scales are not constant; exported models keep accuracy_level 4",
            UserWarning, stacklevel=4)


def batch_shared_products(low: Lowering) -> None:
    """Before the gradients: narrow products sharing a left operand (a layer's
    LoRA adapters) become one (``shared_products``)."""
    if low.training_ops:
        shared_products.batch(low.graph, opset_version(low.opset_imports) or 1, low.names)


def expand_gradient_nodes(low: Lowering) -> None:
    if low.training_ops:
        for node in low.graph.node:
            if is_gradient(node):
                xs = next((list(a.strings) for a in node.attribute if a.name == "xs"), [])
                for out, x in zip(node.output, xs):
                    if out:
                        low.gradients[out] = x.decode()
                low.differentiated += [a.s.decode() for a in node.attribute if a.name == "y"]
        # (where activations are recomputed, a fused forward that keeps nothing stays)
        expand_gradients(low.graph, low.opset_imports, low.names, low.available,
                         low.tm.proto.functions, replace_forward=recompute_spec(low.tm.proto) is None)


def recompute_activations(low: Lowering) -> None:
    """Recompute saved activations in the backward pass, as the model's
    metadata ``onnxtrain.recompute`` asks (``onnxtrain.lower.recompute``)."""
    if low.differentiated:
        spec = recompute_spec(low.tm.proto)
        if spec is not None:
            g = low.graph
            fixed = low.state_here | {t.name for t in g.initializer}
            data = [i.name for i in g.input if i.name not in fixed]
            recompute.apply(g, spec, low.differentiated, low.names, low.opset_imports, data,
                            low.tm.proto.functions)


def lower_optimizer_nodes(low: Lowering) -> None:
    if low.training_ops:
        lower_optimizers(low.graph, low.opset_imports, low.names)


def fuse_gemm_updates(low: Lowering) -> None:
    if low.training_ops:  # updates come from lowered optimizers only
        _fuse_gemm(low.graph, low.opset_imports)


def sort_and_prune(low: Lowering) -> None:
    outputs = [o.name for o in low.graph.output]
    nodes = list(low.graph.node)
    kept = prune(toposort(nodes, low.available, where=low.label), outputs)
    if len(kept) != len(nodes) or any(a is not b for a, b in zip(kept, nodes)):
        low.set_nodes(kept)  # (rewriting the node list copies every node: only when it changed)


def elide_output_identities(low: Lowering) -> None:
    """Drop ``b = Identity(a)`` where b is a graph output, by letting a's
    producer write b directly (onnxruntime keeps such Identities: one kernel
    and one copy per step each, e.g. for a loss or a bound update).

    Only when a is an intermediate value: produced by a node of this graph,
    not a graph input, initializer or output, and not read by a subgraph."""
    g = low.graph
    nodes = list(g.node)
    outputs = {o.name for o in g.output}
    fixed = {i.name for i in g.input} | {t.name for t in g.initializer}
    fixed |= {t.values.name for t in g.sparse_initializer} | outputs
    producer = {o: n for n in nodes for o in n.output if o}
    captured: set[str] = set()
    for n in nodes:
        for sub in subgraphs(n):
            captured |= outer_references(sub)
    rename: dict[str, str] = {}
    kept = []
    for n in nodes:
        if (
            n.op_type == "Identity"
            and n.domain in ("", "ai.onnx")
            and n.output[0] in outputs
            and n.input[0] in producer
            and n.input[0] not in fixed
            and n.input[0] not in captured
            and n.input[0] not in rename
        ):
            rename[n.input[0]] = n.output[0]
            continue
        kept.append(n)
    if not rename:
        return
    for n in kept:
        for i, name in enumerate(n.input):
            if name in rename:
                n.input[i] = rename[name]
        for i, name in enumerate(n.output):
            if name in rename:
                n.output[i] = rename[name]
    keep_vi = [vi for vi in g.value_info if vi.name not in rename]
    del g.value_info[:]
    g.value_info.extend(keep_vi)
    low.set_nodes(kept)


def shield_batch_norm_inputs(low: Lowering) -> None:
    """Give every training-mode BatchNormalization a private copy of its
    mean/var inputs when they are graph inputs or initializers.

    onnxruntime 1.31 writes the running statistics into the buffers of those
    inputs when the running_mean/running_var outputs are not graph outputs.
    Fed from state, that would change the committed state before the step
    commits (and under a concurrent ``run()``).  The copy is Max(v, v): a
    per-channel vector, which onnxruntime neither aliases nor removes (it does
    both to Identity)."""
    g, names = low.graph, low.names
    opset = opset_version(low.opset_imports)
    fixed = {i.name for i in g.input} | {t.name for t in g.initializer}
    out: list[onnx.NodeProto] = []
    changed = False
    for n in g.node:
        if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx"):
            if batch_norm_training(n, opset):
                for k in (3, 4):
                    if len(n.input) > k and n.input[k] in fixed:
                        copy = names.fresh(f"{n.input[k]}/bn_private")
                        out.append(helper.make_node("Max", [n.input[k], n.input[k]], [copy],
                                                    name=names.fresh("bn_private_copy")))
                        n.input[k] = copy
                        changed = True
        out.append(n)
    if changed:
        low.set_nodes(out)


def refuse_preview_ops(low: Lowering) -> None:
    if uses_preview_ops(low.graph):
        left = sorted({n.op_type for n in low.graph.node if n.domain == PREVIEW_DOMAIN})
        raise TrainingModelError(f"unsupported ai.onnx.preview.training ops {left}")


def prune_unused_initializers(low: Lowering) -> None:
    g = low.graph
    used: set[str] = {o.name for o in g.output}
    for n in g.node:
        used.update(node_inputs(n))
    declared = {i.name for i in g.input}
    kept = [t for t in g.initializer if t.name in used or t.name in declared]
    if len(kept) != len(g.initializer):
        del g.initializer[:]
        g.initializer.extend(kept)


# ------------------------------------------------------------- the lists
#: FRONT: the graph becomes standard ops (see the module docstring).
FRONT: tuple[Step, ...] = (
    state_to_inputs,
    exact_quantized_products,
    batch_shared_products,
    expand_gradient_nodes,
    recompute_activations,
    lower_optimizer_nodes,
)
#: BACK: what runs is tidied (on each half of a data-parallel cut too).
BACK: tuple[Step, ...] = (
    fuse_gemm_updates,
    sort_and_prune,
    elide_output_identities,
    shield_batch_norm_inputs,
    refuse_preview_ops,
    prune_unused_initializers,
)

#: The pass list of every kind of program, in the order its steps run; the
#: first makes the graph (see the module docstring).
PASS_LISTS: dict[str, tuple[Step, ...]] = {
    INFERENCE: (main_graph, *FRONT, *BACK),
    ALGORITHM: (combine, *FRONT, *BACK),
    FORWARD: (combine, *FRONT, cut_forward, *BACK),
    UPDATE: (combine, *FRONT, cut_update, *BACK),
    INITIALIZATION: (initialization_graph, *FRONT, *BACK),
    EVALUATE: (loss_graph, *FRONT, *BACK),
}

#: The first steps of the lists: where a program's graph comes from.
SOURCES = frozenset({main_graph, combine, initialization_graph, loss_graph})
#: Steps that only read the lowering and return another one (a half of the
#: cut; None where the algorithm needs no such half): a branch that starts
#: with one needs no copy.
READ_ONLY = frozenset({cut_forward, cut_update})


# ------------------------------------------------------- postconditions
def _no_gradient_left(low: Lowering) -> str | None:
    left = [n.name or n.output[0] for n in low.graph.node if is_gradient(n)]
    return f"Gradient node {left[0]!r} is still there" if left else None


def _state_is_fed(low: Lowering) -> str | None:
    inputs = {i.name for i in low.graph.input}
    inits = {t.name for t in low.graph.initializer} | {t.values.name for t in low.graph.sparse_initializer}
    wrong = sorted((low.state_here - inputs) | (low.state_here & inits))
    return f"state variable {wrong[0]!r} is not a graph input alone" if wrong else None


def _no_dead_node(low: Lowering) -> str | None:
    nodes = list(low.graph.node)
    live = prune(nodes, [o.name for o in low.graph.output])
    if len(live) == len(nodes):
        return None
    dead = next(n for n in nodes if all(n is not m for m in live))
    return f"node {dead.name or dead.op_type!r} computes nothing an output needs"


def _no_preview_op(low: Lowering) -> str | None:
    return "an ai.onnx.preview.training op is left" if uses_preview_ops(low.graph) else None


def _every_initializer_read(low: Lowering) -> str | None:
    g = low.graph
    used = {o.name for o in g.output} | {i.name for i in g.input}
    for n in g.node:
        used.update(node_inputs(n))
    unread = [t.name for t in g.initializer if t.name not in used]
    return f"initializer {unread[0]!r} is read by nothing" if unread else None


#: What holds after each of these steps besides SSA and topological order:
#: a problem found, or None.
POSTCONDITIONS: dict[Step, Callable[[Lowering], str | None]] = {
    state_to_inputs: _state_is_fed,
    expand_gradient_nodes: _no_gradient_left,
    sort_and_prune: _no_dead_node,
    refuse_preview_ops: _no_preview_op,
    prune_unused_initializers: _every_initializer_read,
}


# ------------------------------------------------------------- the engine
def lower(tm: TrainingModel, label: str, kinds: Iterable[str], request: Request | None = None,
          check: bool | None = None) -> dict[str, Lowering]:
    """Run the pass lists of ``kinds`` (``PASS_LISTS``) for one program
    source; the lowering each ends with, by kind (a kind whose half the
    algorithm does not need is left out).  Steps the lists share at their
    start run once.  Each result is SSA and sorted (``checks.check_sound``);
    with ``check`` (``checks.checking``) every step's postconditions are
    checked as well."""
    done: dict[str, Lowering] = {}
    lists = [(kind, PASS_LISTS[kind]) for kind in kinds]
    _walk(Lowering(tm, label, request or Request()), lists, 0, done, checking(check))
    for low in done.values():
        check_sound(low.graph, f"{low.label}, after its pass list", low.state_here)
    return done


def _walk(low: Lowering, lists: list[tuple[str, tuple[Step, ...]]], at: int,
          done: dict[str, Lowering], check: bool) -> None:
    """Run ``lists`` from step ``at`` on ``low`` (a tree walk over their shared starts)."""
    while True:
        going = [(kind, steps) for kind, steps in lists if len(steps) > at]
        for kind, steps in lists:
            if len(steps) == at:
                done[kind] = low.fork() if going else low
        if not going:
            return
        branches: dict[Step, list[tuple[str, tuple[Step, ...]]]] = {}
        for kind, steps in going:
            branches.setdefault(steps[at], []).append((kind, steps))
        if len(branches) > 1:
            last = len(branches) - 1
            for i, (step, group) in enumerate(branches.items()):
                branch = low if i == last or step in READ_ONLY else low.fork()
                _walk(branch, group, at, done, check)
            return
        (step,) = branches
        low = _run_step(step, low, check)
        if low is None:
            return  # (a half the algorithm does not need)
        lists = going
        at += 1


def _run_step(step: Step, low: Lowering, check: bool) -> Lowering | None:
    """``step`` on ``low`` (with ``check``, its postconditions checked); the
    lowering to go on with."""
    try:
        result = step(low)
    except TrainingModelError as exc:
        if step in SOURCES or step in READ_ONLY:
            raise  # (their messages name the place themselves)
        raise type(exc)(f"{low.label}: {exc}") from exc
    if step in READ_ONLY:
        if result is None:
            return None
        low = result
    if check:
        where = f"{low.label}, after {step_name(step)}"
        check_sound(low.graph, where, low.state_here)
        condition = POSTCONDITIONS.get(step)
        if condition is not None:
            check_condition(condition(low), where)
        check_valid(as_model(low), where)
    return low


# ------------------------------------------------------------------ export
def drop_unused_initializers(graph: onnx.GraphProto) -> None:
    """Initializers no node, subgraph or output reads (training-only state a
    builder parked in the main graph, e.g. gradient accumulators)."""
    used = {o.name for o in graph.output} | {i.name for i in graph.input}
    for node in graph.node:
        used.update(node_inputs(node))
    kept = [t for t in graph.initializer if t.name in used]
    if len(kept) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept)


def inference_export(model: onnx.ModelProto) -> onnx.ModelProto:
    """The passes of an exported inference model (training_info already
    dropped, state written, LoRA adapters merged): unused initializers
    dropped, the preview import dropped when no op needs it."""
    drop_unused_initializers(model.graph)
    if not uses_preview_ops(model.graph):
        imports = [o for o in model.opset_import if o.domain != PREVIEW_DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(imports)
    return model

