"""What onnxruntime runs of a program: the executed pass lists.

A program (``programs.Program``) is a standard-op model.  The session's
runner does not run every program as it is: it runs what the executed list
of the program's role makes of it (``EXECUTED``), and merely executes it:

==============  ==========================================================
role            steps
==============  ==========================================================
algorithm       KERNELS, device_batch_norm
forward         KERNELS, device_batch_norm
evaluate        device_batch_norm
update          KERNELS, scratch_outputs, inplace_plan
(others)        none: the program as it is
==============  ==========================================================

``KERNELS``, the kernel choice, is ``optimizer_kernels``, ``decoder_kernels``,
``nchwc_kernels`` (the rewrites, ``REWRITES``), then ``kernel_library``:

- ``optimizer_kernels``: each intact call of an update rule that names a
  fused kernel becomes that kernel (``fuse.with_fused_kernels``);
- ``decoder_kernels``: a decoder's elementwise chains and int4 unpacking
  become library kernels (``kernels.llm``);
- ``nchwc_kernels``: convolutions run as onnxruntime's NCHWc kernels where
  its block is known (``nchwc``);
- ``kernel_library``: the library those kernels need, or the standard
  program again where it is not built.

The rewrites run where fused kernels are allowed (``fused_kernels`` not
False) and possible (the CPU provider), on a copy: the standard programs
(``programs.Programs``, what ``sess.programs()`` returns) never hold a
library kernel.
- ``device_batch_norm`` (off the CPU provider): training-mode
  BatchNormalization as standard ops (``batchnorm``), which onnxruntime's
  CUDA kernel refuses from opset 14 on;
- ``scratch_outputs`` (memory="lean"): the update's temporaries become
  outputs written over its gradient buffers (``inplace.with_scratch_outputs``);
- ``inplace_plan`` (memory="lean"): which state variables the update may
  write in place (``inplace.inplace_keys``), judged on that final model.

What the list makes is SSA and sorted; with checks on (``check=True`` or
``ONNXTRAIN_CHECK_PASSES=1``) so is the model after each step, the step's
own postcondition holds (``POSTCONDITIONS``) and onnx.checker passes.
Where onnxruntime cannot load the fused kernels the runner runs the list
again with ``fused_kernels=False`` (``ExecOptions.standard``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import onnx
from onnx import helper

from ..kernels import library as kernels
from ..kernels import llm, nchwc
from ..kernels.fuse import KERNEL_DOMAIN
from ..kernels.fuse import with_fused_kernels as _with_fused_kernels
from . import program_cache
from .batchnorm import is_training_batch_norm, standard_batch_norm
from .checks import check_condition, check_sound, check_valid, checking, step_name
from .inplace import inplace_keys, with_scratch_outputs
from .lowering import ALGORITHM, EVALUATE, FORWARD, INFERENCE, INITIALIZATION, UPDATE
from .programs import Program


# ------------------------------------------------------------ kernels out
def check_fused_kernels(fused_kernels: bool | None, device: str) -> None:
    """Refuse ``fused_kernels=True`` where the fused kernels cannot run."""
    if fused_kernels not in (None, True, False):
        raise TypeError(f"fused_kernels must be None, True or False, not {fused_kernels!r}")
    if fused_kernels:
        if device != "cpu":
            raise ValueError("fused_kernels=True: the fused kernels run on the CPU provider only")
        if kernels.library() is None:
            raise RuntimeError(f"fused_kernels=True, but the kernel library is {kernels.status()}")


# ------------------------------------------------------- the executed lists
@dataclass(frozen=True)
class ExecOptions:
    """How a session runs its programs: ``fused_kernels`` (None: where
    possible; True: required; False: never), the ``device`` of its provider,
    ``nchwc_block`` (onnxruntime's NCHWc block, or a probe of it called only
    for a program with convolutions) and ``lean`` (memory="lean")."""

    fused_kernels: bool | None = None
    device: str = "cpu"
    nchwc_block: int | Callable[[], int] = 0
    lean: bool = False

    def standard(self) -> ExecOptions:
        """The same without fused kernels (where onnxruntime cannot load them)."""
        return replace(self, fused_kernels=False)


@dataclass
class Execution:
    """A program as onnxruntime runs it: the ``model``, the custom-op
    ``library`` it needs (None: standard ops only), why fused kernels are not
    used (``note``), how many chains run as library ``kernels``, and under memory="lean" the temporaries written over
    gradient buffers (``scratch``: {output: input}) and the state variables
    written in place (``inplace``)."""

    program: Program
    role: str
    options: ExecOptions
    model: onnx.ModelProto
    library: str | None = None
    note: str = ""
    #: How many chains run as library kernels.
    kernels: int = 0
    scratch: dict[str, str] = field(default_factory=dict)
    inplace: frozenset[str] = frozenset()


def optimizer_kernels(ex: Execution) -> None:
    """Each intact call of an update rule that names a fused kernel becomes
    that kernel (``fuse.with_fused_kernels``: the builder's Adam/AdamW, the
    spec's Adam, Momentum and Adagrad, and some layers' gradients)."""
    model, count = _with_fused_kernels(ex.model)
    ex.model, ex.kernels = model, ex.kernels + count


def decoder_kernels(ex: Execution) -> None:
    """A decoder's non-product chains (RMSNorm, the SiLU gate, RoPE, the
    guarded softmax, the vocabulary cross-entropy, int4 unpacking) as library
    kernels (``kernels.llm``): in a copy of the program's model made only when
    a chain is there, in place in one a step before made."""
    model = ex.model
    if not llm.ANCHORS & {n.op_type for n in model.graph.node}:
        return
    fused = model
    if model is ex.program.model:
        fused = onnx.ModelProto()
        fused.CopyFrom(model)
    count = llm.rewrite(fused.graph, list(fused.opset_import), KERNEL_DOMAIN)
    if not count:
        return
    if not any(o.domain == KERNEL_DOMAIN for o in fused.opset_import):
        fused.opset_import.append(helper.make_opsetid(KERNEL_DOMAIN, 1))
    ex.model, ex.kernels = fused, ex.kernels + count


def nchwc_kernels(ex: Execution) -> None:
    """Convolutions as onnxruntime's NCHWc kernels, where its block is known (``nchwc.rewrite``)."""
    block = ex.options.nchwc_block
    model, count = nchwc.rewrite(ex.model, block if isinstance(block, int) else 0, KERNEL_DOMAIN)
    ex.model, ex.kernels = model, ex.kernels + count


def kernel_library(ex: Execution) -> None:
    """The custom-op library the kernels need; where it is not available,
    the standard program again, and why (``note``)."""
    o = ex.options
    if o.fused_kernels is False:
        return
    if o.device != "cpu":
        ex.note = "fused kernels run on the CPU provider only"
        return
    if ex.model is ex.program.model:
        return
    library = kernels.library()
    if library is None:
        ex.model, ex.kernels, ex.note = ex.program.model, 0, kernels.status()
    else:
        ex.library = library


def scratch_outputs(ex: Execution) -> None:
    """memory="lean": temporaries over the gradient buffers (``inplace.with_scratch_outputs``)."""
    if ex.options.lean:
        ex.model, ex.scratch = with_scratch_outputs(ex.model, set(ex.program.feeds))


def inplace_plan(ex: Execution) -> None:
    """memory="lean": the state variables the update may write in place (``inplace.inplace_keys``)."""
    if ex.options.lean:
        program = ex.program
        ex.inplace = frozenset(inplace_keys(ex.model.graph, list(zip(program.bound_keys, program.bound_values))))


def device_batch_norm(ex: Execution) -> None:
    """Off the CPU provider: training-mode BatchNormalization as standard ops
    (``batchnorm.standard_batch_norm``; onnxruntime's CUDA kernel refuses it
    from opset 14 on)."""
    if ex.options.device != "cpu":
        ex.model, _ = standard_batch_norm(ex.model)


#: The rewrites to library kernels, in order: run only where fused kernels
#: are allowed and possible (``kernels_wanted``), and answered together from
#: the program cache (``program_cache.fused_for``).
REWRITES = (optimizer_kernels, decoder_kernels, nchwc_kernels)
#: The kernel choice: the rewrites, then the library they need.
KERNELS = (*REWRITES, kernel_library)

#: The executed list of every role (see the module docstring).
EXECUTED: dict[str, tuple[Callable[[Execution], None], ...]] = {
    INFERENCE: (),
    ALGORITHM: (*KERNELS, device_batch_norm),
    FORWARD: (*KERNELS, device_batch_norm),
    UPDATE: (*KERNELS, scratch_outputs, inplace_plan),
    INITIALIZATION: (),
    EVALUATE: (device_batch_norm,),
}


def _program_stays_standard(ex: Execution) -> str | None:
    if ex.model is ex.program.model and any(n.domain == KERNEL_DOMAIN for n in ex.model.graph.node):
        return "library kernels were written into the standard program, not a copy"
    return None


def _library_iff_kernels(ex: Execution) -> str | None:
    uses = any(n.domain == KERNEL_DOMAIN for n in ex.model.graph.node)
    if uses and ex.library is None:
        return "the model runs library kernels but no library is given"
    if ex.library is not None and ex.model is ex.program.model:
        return "a library is given for the standard program"
    return None


def _no_training_batch_norm_off_cpu(ex: Execution) -> str | None:
    if ex.options.device == "cpu":
        return None
    left = [n.name or n.output[0] for n in ex.model.graph.node if is_training_batch_norm(n)]
    return f"training-mode BatchNormalization {left[0]!r} is left for {ex.options.device}" if left else None


def _scratch_is_bound(ex: Execution) -> str | None:
    outputs = {o.name for o in ex.model.graph.output}
    feeds = set(ex.program.feeds)
    wrong = [v for v, name in ex.scratch.items() if v not in outputs or name not in feeds]
    return f"scratch value {wrong[0]!r} is not an output over a fed buffer" if wrong else None


def _inplace_is_bound(ex: Execution) -> str | None:
    wrong = sorted(ex.inplace - set(ex.program.bound_keys))
    return f"{wrong[0]!r} is written in place but bound by no output" if wrong else None


#: What holds after each executed step besides SSA and topological order.
POSTCONDITIONS: dict[Callable[[Execution], None], Callable[[Execution], str | None]] = {
    optimizer_kernels: _program_stays_standard,
    decoder_kernels: _program_stays_standard,
    nchwc_kernels: _program_stays_standard,
    kernel_library: _library_iff_kernels,
    device_batch_norm: _no_training_batch_norm_off_cpu,
    scratch_outputs: _scratch_is_bound,
    inplace_plan: _inplace_is_bound,
}


def kernels_wanted(options: ExecOptions) -> bool:
    """Whether the kernel rewrites run: fused kernels allowed (not False) on the CPU provider."""
    return options.fused_kernels is not False and options.device == "cpu"


def execute(program: Program, role: str, options: ExecOptions, check: bool | None = None) -> Execution:
    """Run the executed list of ``role`` on ``program``: what onnxruntime runs,
    SSA and sorted; with ``check`` (``checks.checking``) every step's
    postconditions checked.  The kernel rewrites (``REWRITES``) at the
    list's start run only where ``kernels_wanted``, after the NCHWc block is
    known (a probe is called only for a program with convolutions), and are
    answered together from the program cache for a program it handed out.
    A rewritten model is checked SSA and sorted before the cache keeps it,
    so one the cache hands back is not walked again (as a cached program is
    not): on a 1400-node program that walk was the first touch of every
    parsed node, 40-50 ms of a first step."""
    check = checking(check)
    steps = EXECUTED[role]
    ex = Execution(program, role, options, program.model)
    where = f"{program.label}, executed"
    lead = 0
    while lead < len(steps) and steps[lead] in REWRITES:
        lead += 1
    if lead and kernels_wanted(options):
        block = options.nchwc_block
        if callable(block):
            block = block() if nchwc.has_convolutions(program.model) else 0
        ex.options = replace(options, nchwc_block=block)

        def rewrite(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
            _run(ex, steps[:lead], check)
            if ex.model is not model:
                check_sound(ex.model.graph, where)
            return ex.model, ex.kernels

        ex.model, ex.kernels = program_cache.fused_for(program.model, rewrite, variant=block)
    checked = ex.model  # (the program itself, or its rewrite checked above)
    _run(ex, steps[lead:], check)
    if ex.model is not checked and ex.model is not program.model:
        check_sound(ex.model.graph, where)
    return ex


def _run(ex: Execution, steps: tuple[Callable[[Execution], None], ...], check: bool) -> None:
    for step in steps:
        step(ex)
        if check:
            where = f"{ex.program.label}, executed, after {step_name(step)}"
            check_sound(ex.model.graph, where)
            condition = POSTCONDITIONS.get(step)
            if condition is not None:
                check_condition(condition(ex), where)
            check_valid(ex.model, where)
