"""The program pipeline: every graph pass between a training model and what
onnxruntime runs, in order, one job each.

A program starts as one graph: the main graph, an initialization graph, or
the *combination* M ⊕ A_i of the main graph and an algorithm (``combine``;
``loss_graph`` further prunes one to the loss for ``evaluate``).
``run_pipeline`` then applies ``PIPELINE`` to a private copy:

1. ``state_to_inputs``        state initializers become graph inputs, fed from the state
   ``exact_quantized_products`` MatMulNBits with trained scales: accuracy_level 4 -> 1
2. ``expand_gradient_nodes``  Gradient nodes become backward graphs (autodiff)
   ``recompute_activations``  where the model asks: saved activations recomputed (recompute)
3. ``lower_optimizer_nodes``  Adam / Momentum / Adagrad become standard ops (optim)
4. ``fuse_gemm_updates``      scaled updates of Gemm products fold into the Gemm (fuse)
5. ``sort_and_prune``         topological order, without nodes no output needs
6. ``elide_output_identities``  producers write graph outputs directly
7. ``shield_batch_norm_inputs`` training-mode BatchNorm gets private mean/var copies
8. ``refuse_preview_ops``     no ai.onnx.preview.training op may be left
9. ``prune_unused_initializers``

and ``to_model`` wraps the result without the preview import, its IR version
capped to what this onnxruntime loads.  ``kernel_choice`` is the last,
optional step: Adam updates fused into one custom kernel each, and a
decoder's elementwise chains and int4 unpacking into library kernels
(``onnxtrain.kernels.llm``), where the kernel library is available
(``onnxtrain.kernels``), in the program onnxruntime runs only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

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
from ..io.model import TrainingModel, combined_graph, copy_graph, uses_preview_ops
from ..kernels import library as kernels
from ..kernels import llm, nchwc
from ..kernels.fuse import KERNEL_DOMAIN
from ..kernels.fuse import fuse_gemm_updates as _fuse_gemm
from ..kernels.fuse import with_fused_kernels as _with_fused_kernels
from ..optim import lower_optimizers
from . import program_cache, recompute

#: Default-domain opset given to programs of models that import none.
DEFAULT_OPSET = 17


def with_fused_kernels(model: onnx.ModelProto, nchwc_block: int = 0) -> tuple[onnx.ModelProto, int]:
    """``fuse.with_fused_kernels``, a decoder's chains (``llm.rewrite``), then
    with ``nchwc_block`` (0: none) the NCHWc rewrite (``nchwc.rewrite``),
    answered from the program cache for the program models it handed out
    (``program_cache.fused_for``)."""

    def compute(m: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
        fused, count = _with_fused_kernels(m)
        fused, decoder = _with_llm_kernels(fused, fused is not m)
        laid, convs = nchwc.rewrite(fused, nchwc_block, KERNEL_DOMAIN)
        return laid, count + decoder + convs

    return program_cache.fused_for(model, compute, variant=nchwc_block)


def _with_llm_kernels(model: onnx.ModelProto, owned: bool) -> tuple[onnx.ModelProto, int]:
    """A decoder's non-product chains as library kernels (``kernels.llm``): in
    place where ``owned`` (a copy made for the kernels), else in a copy made
    only when a chain is there; and how many."""
    if not llm.ANCHORS & {n.op_type for n in model.graph.node}:
        return model, 0
    fused = model
    if not owned:
        fused = onnx.ModelProto()
        fused.CopyFrom(model)
    count = llm.rewrite(fused.graph, list(fused.opset_import), KERNEL_DOMAIN)
    if not count:
        return model, 0
    if not any(o.domain == KERNEL_DOMAIN for o in fused.opset_import):
        fused.opset_import.append(helper.make_opsetid(KERNEL_DOMAIN, 1))
    return fused, count


@dataclass
class Lowering:
    """What the passes work on: one program's graph and what they share."""

    tm: TrainingModel
    label: str
    graph: onnx.GraphProto
    #: State variables held by the graph (as initializers, or left out by the caller).
    state_here: set[str]
    opset_imports: list[onnx.OperatorSetIdProto]
    names: NameGen = field(init=False)
    #: Names defined before the first node (inputs and initializers).
    available: list[str] = field(init=False)
    #: Whether the graph holds ai.onnx.preview.training ops to lower (passes 2-4).
    training_ops: bool = field(init=False)
    #: Every value a top-level Gradient node defined: output -> the x it differentiates
    #: by (filled by ``expand_gradient_nodes``; the data-parallel cut reduces them).
    gradients: dict[str, str] = field(default_factory=dict)
    #: The y of every top-level Gradient node (filled by ``expand_gradient_nodes``).
    differentiated: list[str] = field(default_factory=list)
    #: The model whose graph ``graph`` is, if any: ``to_model`` fills it in
    #: instead of copying the graph into a new one.
    model: onnx.ModelProto | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.names = NameGen(())
        self.available = []
        self.training_ops = uses_preview_ops(self.graph)

    def copy(self, graph: onnx.GraphProto, label: str | None = None) -> Lowering:
        """The same lowering over another graph (a part of this one), sharing the names."""
        low = Lowering(self.tm, label or self.label, graph, set(self.state_here),
                       list(self.opset_imports))
        low.names, low.gradients = self.names, dict(self.gradients)
        low.available = [i.name for i in graph.input] + [t.name for t in graph.initializer]
        low.available += [t.values.name for t in graph.sparse_initializer]
        return low

    def set_nodes(self, nodes: list[onnx.NodeProto]) -> None:
        del self.graph.node[:]
        self.graph.node.extend(nodes)


# --------------------------------------------------------------- graphs in
def combine(tm: TrainingModel, index: int) -> tuple[onnx.GraphProto, set[str]]:
    """M ⊕ A_index without the state initializers (returned as the second
    item: they become inputs, and copying their data would double the memory)."""
    ti = tm.proto.training_info[index]
    state = {
        name
        for g in (tm.proto.graph, ti.algorithm)
        for name in [t.name for t in g.initializer] + [t.values.name for t in g.sparse_initializer]
        if name in tm.state
    }
    return combined_graph(tm.proto, index, exclude_initializers=state), state


def loss_graph(tm: TrainingModel, index: int, outputs: list[str],
               train_prediction: str | None = None, prediction: str | None = None) -> onnx.GraphProto:
    """M ⊕ A_index pruned to ``outputs`` (the loss, and the prediction).

    The Gradient and optimizer nodes are dead here, and so are the inputs
    and state (moments, counters) only they read, which are dropped so that
    the program is fed just what the forward pass needs.  Evaluation is
    inference: a loss that reads a training-mode copy of the forward pass
    (``train_prediction``: Dropout/BatchNormalization active) reads the main
    graph's ``prediction`` instead, and the copy is pruned away."""
    graph = combined_graph(tm.proto, index)
    by_name = {o.name: o for o in graph.output}
    kept_outputs = [by_name[n] for n in outputs]
    del graph.output[:]
    graph.output.extend(kept_outputs)
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
    return graph


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


def expand_gradient_nodes(low: Lowering) -> None:
    if low.training_ops:
        for node in low.graph.node:
            if is_gradient(node):
                xs = next((list(a.strings) for a in node.attribute if a.name == "xs"), [])
                for out, x in zip(node.output, xs):
                    if out:
                        low.gradients[out] = x.decode()
                low.differentiated += [a.s.decode() for a in node.attribute if a.name == "y"]
        expand_gradients(low.graph, low.opset_imports, low.names, low.available,
                         low.tm.proto.functions)


def recompute_activations(low: Lowering) -> None:
    """Recompute saved activations in the backward pass, as the model's
    metadata ``onnxtrain.recompute`` asks (``onnxtrain.lower.recompute``)."""
    if low.differentiated:
        spec = recompute.spec_of(low.tm.proto)
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


#: The passes, in the order they run (see the module docstring).  A
#: data-parallel algorithm is cut in two (``onnxtrain.split``) between the
#: FRONT passes, which make it standard ops, and the BACK ones, which then
#: run on each part.
FRONT: tuple[Callable[[Lowering], None], ...] = (
    state_to_inputs,
    exact_quantized_products,
    expand_gradient_nodes,
    recompute_activations,
    lower_optimizer_nodes,
)
BACK: tuple[Callable[[Lowering], None], ...] = (
    fuse_gemm_updates,
    sort_and_prune,
    elide_output_identities,
    shield_batch_norm_inputs,
    refuse_preview_ops,
    prune_unused_initializers,
)
PIPELINE = FRONT + BACK


def to_model(low: Lowering) -> onnx.ModelProto:
    """The lowered graph as a model: no preview import, the IR version capped."""
    proto = low.tm.proto
    imports = [o for o in low.opset_imports if o.domain != PREVIEW_DOMAIN]
    if low.model is not None and low.model.graph is low.graph:
        # The graph was built inside its model (``lower_front``): no copy.
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


def run_pipeline(tm: TrainingModel, label: str, graph: onnx.GraphProto,
                 state_left_out: Iterable[str] = ()) -> tuple[onnx.GraphProto, onnx.ModelProto]:
    """Apply ``PIPELINE`` to a copy of ``graph``; the lowered graph and its model.

    ``state_left_out``: state variables whose initializers the caller already
    left out of ``graph`` (they become inputs all the same)."""
    return finish(lower_front(tm, label, graph, state_left_out))


def lower_front(tm: TrainingModel, label: str, graph: onnx.GraphProto,
                state_left_out: Iterable[str] = ()) -> Lowering:
    """The FRONT passes on a copy of ``graph``: state as inputs, Gradient
    expanded, optimizers lowered (standard ops from here on)."""
    state_here = {
        name
        for name in [t.name for t in graph.initializer]
        + [t.values.name for t in graph.sparse_initializer]
        if name in tm.state
    } | set(state_left_out)
    # State variables become inputs fed from the session's buffers: copying
    # their initializer data here would double the memory of a large model.
    model = onnx.ModelProto()  # the program's model: its graph is built in place
    g = copy_graph(graph, exclude_initializers=state_here, into=model.graph)
    opset_imports = list(tm.proto.opset_import)
    if not any(o.domain in ("", "ai.onnx") for o in opset_imports):
        # Lowered Gradient/optimizer ops are default-domain ops; models that
        # import only ai.onnx.preview.training (ONNX's own test cases) get one.
        opset_imports.append(helper.make_opsetid("", DEFAULT_OPSET))
    low = Lowering(tm, label, g, state_here, opset_imports, model=model)
    _run(low, FRONT)
    return low


def finish(low: Lowering) -> tuple[onnx.GraphProto, onnx.ModelProto]:
    """The BACK passes (in place); the lowered graph and its model."""
    _run(low, BACK)
    return low.graph, to_model(low)


def _run(low: Lowering, steps: Iterable[Callable[[Lowering], None]]) -> None:
    for step in steps:
        try:
            step(low)
        except TrainingModelError as exc:
            raise type(exc)(f"{low.label}: {exc}") from exc


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


# ------------------------------------------------------------ kernels out
@dataclass(frozen=True)
class KernelChoice:
    """The model to run for a program, the custom-op library it needs (None:
    standard ops only), and why fused kernels are not used ("" if they are or
    were not asked for)."""

    model: onnx.ModelProto
    library: str | None = None
    note: str = ""


def check_fused_kernels(fused_kernels: bool | None, device: str) -> None:
    """Refuse ``fused_kernels=True`` where the fused kernels cannot run."""
    if fused_kernels not in (None, True, False):
        raise TypeError(f"fused_kernels must be None, True or False, not {fused_kernels!r}")
    if fused_kernels:
        if device != "cpu":
            raise ValueError("fused_kernels=True: the fused kernels run on the CPU provider only")
        if kernels.library() is None:
            raise RuntimeError(f"fused_kernels=True, but the kernel library is {kernels.status()}")


def kernel_choice(model: onnx.ModelProto, fused_kernels: bool | None, device: str,
                  nchwc_block: int | Callable[[], int] = 0) -> KernelChoice:
    """Decide how a training algorithm's program runs: with each optimizer
    update (the builder's Adam/AdamW, the spec's Adam, Momentum and Adagrad)
    fused into one kernel where allowed (``fused_kernels`` not False),
    possible (CPU provider) and available (the library built), else as is.
    With the library, convolutions also run as onnxruntime's NCHWc kernels
    where ``nchwc_block`` (``executor.nchwc_block``, called only for a
    program with convolutions) is one (``nchwc``)."""
    if fused_kernels is False:
        return KernelChoice(model)
    if device != "cpu":
        return KernelChoice(model, None, "fused kernels run on the CPU provider only")
    block = nchwc_block
    if callable(block):  # (a probe: asked only where it matters)
        block = block() if nchwc.has_convolutions(model) else 0
    fused, _ = with_fused_kernels(model, block)
    if fused is model:
        return KernelChoice(model)
    library = kernels.library()
    if library is None:
        return KernelChoice(model, None, kernels.status())
    return KernelChoice(fused, library)
