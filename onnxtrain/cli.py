"""The ``onnxtrain`` command line: thin subcommands over library functions.

- ``onnxtrain demo``                 train the digits classifier (``onnxtrain.demo.run_demo``)
- ``onnxtrain inspect MODEL``        describe a model and its training_info
- ``onnxtrain check MODEL``          validate a training model (exit 0 and 'OK', else 1)
- ``onnxtrain export CKPT -o OUT``   write the inference model of a training checkpoint

User mistakes (a missing file, an invalid model, a bad option value) end in
one line ``onnxtrain: error: ...`` on stderr and exit code 1; command line
syntax errors exit with 2 (argparse).  Neither prints a traceback.

>>> main(["--version"])                            # doctest: +ELLIPSIS
onnxtrain ...
0
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

import numpy as np
import onnx

from . import __version__
from .errors import TrainingModelError
from .model import load
from .session import TrainingSession

PROG = "onnxtrain"

#: The exceptions that count as user mistakes: reported in one line, exit 1.
USER_ERRORS = (TrainingModelError, ValueError, OSError)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.handler(args)
    except USER_ERRORS as exc:
        _error(exc)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _error(exc: BaseException) -> None:
    """Print an exception as one line on stderr."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"{PROG}: error: {message}", file=sys.stderr)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    from .demo import DEFAULT_BATCH_SIZE, DEFAULT_EPOCHS

    parser = argparse.ArgumentParser(
        prog=PROG, description="Run ONNX training models (TrainingInfoProto) on onnxruntime."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="train an MLP on the bundled 8x8 digits and export it")
    demo.add_argument("--epochs", type=_positive_int, default=DEFAULT_EPOCHS,
                      help=f"passes over the training set (default {DEFAULT_EPOCHS})")
    demo.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE,
                      help=f"samples per training step (default {DEFAULT_BATCH_SIZE})")
    demo.add_argument("-o", "--output", default="digits_mlp.onnx",
                      help="where to write the trained inference model (default digits_mlp.onnx)")
    demo.add_argument("--seed", type=int, default=0, help="data split, shuffling and init seed")
    demo.add_argument("--no-progress", action="store_true", help="do not show a progress bar")
    demo.set_defaults(handler=_cmd_demo)

    inspect = sub.add_parser("inspect", help="describe a model, its training_info and state")
    inspect.add_argument("model", metavar="MODEL", help="path of an .onnx model")
    inspect.set_defaults(handler=_cmd_inspect)

    check = sub.add_parser("check", help="validate a training model: print OK or the error")
    check.add_argument("model", metavar="MODEL", help="path of an .onnx model")
    check.set_defaults(handler=_cmd_check)

    export = sub.add_parser("export", help="write the inference model of a training checkpoint")
    export.add_argument("checkpoint", metavar="CKPT", help="path of a training model")
    export.add_argument("-o", "--output", required=True, metavar="OUT", help="output path")
    export.add_argument("--training", action="store_true",
                        help="keep training_info (write a training checkpoint, not inference)")
    export.set_defaults(handler=_cmd_export)
    return parser


# ------------------------------------------------------------------ commands
def _cmd_demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .demo import demo_steps, run_demo

    total = demo_steps(args.epochs, args.batch_size)
    with tqdm(total=total, unit="step", desc="training", disable=args.no_progress,
              file=sys.stderr) as bar:

        def progress(epoch: int, step: int, loss: float) -> None:
            bar.set_postfix(epoch=epoch, loss=f"{loss:.4f}", refresh=False)
            bar.update(1)

        result = run_demo(epochs=args.epochs, batch_size=args.batch_size, out_path=args.output,
                          seed=args.seed, progress=progress)
    print(f"test accuracy: {result['accuracy']:.2%} on {result['test_size']} digits "
          f"({result['steps']} steps, final loss {result['final_loss']:.4f}, "
          f"{result['seconds']:.1f} s)")
    print(f"wrote {result['path']}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    proto, _ = load(args.model)
    out = sys.stdout
    print(f"model: {args.model}", file=out)
    producer = " ".join(p for p in (proto.producer_name, proto.producer_version) if p)
    print(f"ir_version: {proto.ir_version}" + (f"  (producer: {producer})" if producer else ""),
          file=out)
    opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in proto.opset_import)
    print(f"opsets: {opsets}", file=out)
    g = proto.graph
    print(f"graph {g.name!r}: {len(g.node)} nodes, {len(g.initializer)} initializers", file=out)
    _print_values("inputs", g.input, out)
    _print_values("outputs", g.output, out)

    verdict: BaseException | None = None
    state: dict[str, np.ndarray] = {}
    try:
        state = dict(TrainingSession(args.model).state)
    except USER_ERRORS as exc:
        verdict = exc

    print(f"training_info: {len(proto.training_info)}", file=out)
    for i, ti in enumerate(proto.training_info):
        a = ti.algorithm
        print(f"  [{i}] algorithm {a.name!r}: {len(a.node)} nodes, "
              f"{len(a.initializer)} initializers", file=out)
        _print_values("inputs", a.input, out, indent="      ")
        _print_values("outputs", a.output, out, indent="      ")
        if ti.HasField("initialization"):
            init = ti.initialization
            print(f"      initialization {init.name!r}: {len(init.node)} nodes", file=out)
        else:
            print("      initialization: none", file=out)
        _print_bindings("update_binding", ti.update_binding, out)
        _print_bindings("initialization_binding", ti.initialization_binding, out)

    if verdict is None:
        print(f"state variables: {len(state)}", file=out)
        for name, value in state.items():
            print(f"  {name}: {value.dtype}{list(value.shape)}", file=out)
        print("validation: OK", file=out)
        return 0
    print("state variables: unavailable (the model is invalid)", file=out)
    print(f"validation: INVALID: {' '.join(str(verdict).split())}", file=out)
    return 1


def _cmd_check(args: argparse.Namespace) -> int:
    TrainingSession(args.model)
    print("OK")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    path = TrainingSession(args.checkpoint).export(args.output, training=args.training)
    kind = "training checkpoint" if args.training else "inference model"
    print(f"wrote {kind} {path}")
    return 0


# ------------------------------------------------------------------- helpers
def _describe_type(vi: onnx.ValueInfoProto) -> str:
    """``float32[N, 64]`` for a tensor value; the raw type name for anything else."""
    t = vi.type
    if t.WhichOneof("value") != "tensor_type":
        return t.WhichOneof("value") or "?"
    tt = t.tensor_type
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)).name
    except (KeyError, TypeError, ValueError):
        dtype = onnx.TensorProto.DataType.Name(tt.elem_type) if tt.elem_type else "?"
    if not tt.HasField("shape"):
        return f"{dtype}[?]"
    dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
            for d in tt.shape.dim]
    return f"{dtype}[{', '.join(dims)}]"


def _print_values(title: str, values, out: TextIO, indent: str = "  ") -> None:
    print(f"{indent}{title}:" + ("" if values else " none"), file=out)
    for vi in values:
        print(f"{indent}  {vi.name}: {_describe_type(vi)}", file=out)


def _print_bindings(title: str, bindings, out: TextIO) -> None:
    pairs = ", ".join(f"{b.key} <- {b.value}" for b in bindings)
    print(f"      {title} ({len(bindings)}): {pairs or 'none'}", file=out)
