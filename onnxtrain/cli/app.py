"""The ``onnxtrain`` command line: thin subcommands over library functions.

- ``onnxtrain demo``                 train the digits classifier (``onnxtrain.demo.run_demo``)
- ``onnxtrain inspect MODEL``        describe a model and its training_info
- ``onnxtrain check MODEL``          validate a training model (exit 0 and 'OK', else 1)
- ``onnxtrain export CKPT -o OUT [--outputs A,B]``
                                     write the inference model of a training checkpoint
- ``onnxtrain bundle MODEL -o FOLDER``  write a portable training bundle (``onnxtrain.bundle.save``)
- ``onnxtrain make-training MODEL -o OUT --loss L --target T --optimizer O --lr LR``
  ``[--lora RANK[:ALPHA] [--lora-targets NAME,...]]``
                                     build a training model (``onnxtrain.build.training_model``)
- ``onnxtrain train MODEL --data DATA.npz --epochs N -o OUT [--lr LR] [--checkpoint C]``
  ``[--resume C] [--distributed]`` (under ``mpiexec -n N``: data-parallel over MPI)

Each subcommand's ``--help`` ends with examples (``EXAMPLES``); warnings print
as one line ``onnxtrain: warning: ...``.
                                     fit it with progress bars (``onnxtrain.cli.train.train_files``)

User mistakes (a missing file, an invalid model, a bad option value) and a
training run whose loss turns NaN or infinite end in one line
``onnxtrain: error: ...`` on stderr and exit code 1; command line
syntax errors exit with 2 (argparse).  Neither prints a traceback.

>>> main(["--version"])                            # doctest: +ELLIPSIS
onnxtrain ...
0
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence
from typing import TextIO

import numpy as np
import onnx

from .._version import __version__
from ..core.emitter import FLOAT_TYPES
from ..errors import DistributedStepError, ExecutionError, TrainingModelError
from ..io.model import load
from ..session import TrainingSession
from ..startup import end_of_start
from ..train.loop import fmt_loss

PROG = "onnxtrain"

#: The exceptions that count as user mistakes (or a run that diverged: a NaN
#: or infinite loss; or onnxruntime failing on the data, e.g. an index out of
#: range in a hand-written loss): reported in one line, exit 1.
USER_ERRORS = (TrainingModelError, ValueError, OSError, FloatingPointError, ExecutionError,
               DistributedStepError)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    end_of_start()  # Ctrl-C raises KeyboardInterrupt from here on (reported below)
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_line
            return args.handler(args)
    except BrokenPipeError:
        # The reader went away (``onnxtrain ... | head``): exit quietly.  Python
        # would report the pipe again when it flushes stdout at exit, so point
        # stdout at devnull first.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except USER_ERRORS as exc:
        _error(exc)
        return 1
    except KeyboardInterrupt as exc:
        detail = " ".join(str(exc).split())
        print(f"{PROG}: {detail or 'interrupted'}", file=sys.stderr)
        return 130


def _error(exc: BaseException) -> None:
    """Print an exception as one line on stderr."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"{PROG}: error: {message}", file=sys.stderr)


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line ``onnxtrain: warning: ...`` on stderr (no source line)."""
    text = " ".join(str(message).split())
    print(f"{PROG}: warning: {text}", file=sys.stderr if file is None else file)


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
    export.add_argument("--outputs", default=None, metavar="A,B",
                        help="the outputs the inference model keeps, comma-separated (the nodes they "
                             "need stay, inputs nothing reads go); default: the model's own "
                             "(a model from import-ort: its prediction, not the loss)")
    export.set_defaults(handler=_cmd_export)

    bundle = sub.add_parser(
        "bundle", help="write a portable training bundle (trains in JavaScript: onnxruntime-node/-web)",
        description="Write MODEL (a training model or a checkpoint, whose fit position is kept) as a "
                    "training bundle: standard-op programs, state.bin and a manifest (docs/bundle.md), "
                    "which the JavaScript package onnxtrain trains and onnxtrain.bundle.load reads back.")
    bundle.add_argument("model", metavar="MODEL", help="path of a training model or checkpoint")
    bundle.add_argument("-o", "--output", required=True, metavar="FOLDER",
                        help="the bundle folder to write (new or empty)")
    bundle.add_argument("--overwrite", action="store_true",
                        help="replace an existing non-empty FOLDER")
    bundle.set_defaults(handler=_cmd_bundle)
    _add_training_commands(sub)
    from ..ort_training.cli import add_parser as _add_import_ort
    _add_import_ort(sub)
    for name, command in sub.choices.items():  # each --help ends with its examples
        command.formatter_class = _ExamplesLast
        if name in EXAMPLES:
            command.epilog = "examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[name])
    return parser


#: What each subcommand's --help ends with: command lines that work as shown.
EXAMPLES = {
    "demo": ["onnxtrain demo",
             "onnxtrain demo --epochs 5 --batch-size 64 -o digits.onnx --no-progress"],
    "inspect": ["onnxtrain inspect model.onnx          # an export: what make-training would train",
                "onnxtrain inspect checkpoint.onnx     # a training model: training_info and state"],
    "check": ["onnxtrain check training.onnx",
              "onnxtrain check checkpoint.onnx && onnxtrain export checkpoint.onnx -o trained.onnx"],
    "export": ["onnxtrain export checkpoint.onnx -o trained.onnx",
               "onnxtrain export checkpoint.onnx -o copy.onnx --training",
               "onnxtrain export checkpoint.onnx -o scores.onnx --outputs logits"],
    "bundle": ["onnxtrain bundle training.onnx -o digits.bundle",
               "onnxtrain bundle checkpoint.onnx -o digits.bundle --overwrite"],
    "make-training": [
        "onnxtrain make-training model.onnx -o training.onnx --loss cross_entropy --lr 1e-3",
        "onnxtrain make-training regressor.onnx -o training.onnx --loss mse --optimizer sgd "
        "--lr 0.01 --momentum 0.9 --schedule cosine",
        "onnxtrain make-training llama.onnx -o lora.onnx --lora 8:16 --lora-targets q_proj,v_proj",
    ],
    "train": [
        "onnxtrain train training.onnx --data train.npz --epochs 10 -o trained.onnx",
        "onnxtrain train training.onnx --data train.npz --epochs 20 --lr 1e-4 -o trained.onnx "
        "--checkpoint ckpt.onnx --resume ckpt.onnx",
        "mpiexec -n 2 onnxtrain train training.onnx --data train.npz --epochs 10 -o trained.onnx "
        "--distributed",
    ],
    "import-ort": ["onnxtrain import-ort artifacts/ -o model.onnx",
                   "onnxtrain import-ort artifacts/ -o model.onnx --checkpoint saved/checkpoint "
                   "--prediction logits"],
}


class _ExamplesLast(argparse.HelpFormatter):
    """argparse's help, with the examples (the epilog) kept line by line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return "\n".join(indent + line for line in text.splitlines())
        return super()._fill_text(text, width, indent)


# ------------------------------------------------------------------ commands
def _cmd_demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..train.callbacks import check_writable
    from .demo import demo_steps, run_demo

    check_writable(args.output, "-o")

    total = demo_steps(args.epochs, args.batch_size)
    with tqdm(total=total, unit="step", desc="training", disable=args.no_progress,
              file=sys.stderr) as bar:

        def progress(epoch: int, step: int, loss: float) -> None:
            bar.set_postfix({"epoch": epoch, "last batch loss": fmt_loss(loss)}, refresh=False)
            bar.update(1)

        result = run_demo(epochs=args.epochs, batch_size=args.batch_size, out_path=args.output,
                          seed=args.seed, progress=progress)
    print(f"test accuracy: {result['accuracy']:.2%} on {result['test_size']} digits "
          f"({result['steps']} steps, last epoch's mean loss {fmt_loss(result['final_loss'])}, "
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
    from ..builder.folding import batchnorm_hint

    hint = batchnorm_hint(proto)
    if hint:
        print(hint, file=out)
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

    if not proto.training_info:
        _print_parameter_choice(proto, out)
    if verdict is None:
        print(f"state variables: {len(state)}", file=out)
        for name, value in state.items():
            print(f"  {name}: {value.dtype}{list(value.shape)}", file=out)
        print("validation: OK", file=out)
        return 0
    print("state variables: unavailable (the model is invalid)", file=out)
    print(f"validation: INVALID: {' '.join(str(verdict).split())}", file=out)
    return 1


def _print_parameter_choice(proto: onnx.ModelProto, out: TextIO) -> None:
    """For an inference model: what make-training would train by default, and why."""
    from ..summary import parameter_text

    if any(t.data_type in FLOAT_TYPES for t in proto.graph.initializer):
        print(parameter_text(proto), file=out)


def _cmd_check(args: argparse.Namespace) -> int:
    sess = TrainingSession(args.model)
    if sess.num_algorithms == 0:
        print("OK: a valid inference model, but not a training model (no training_info); "
              "make one with: onnxtrain make-training")
    else:
        print("OK")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from ..train.callbacks import check_writable

    check_writable(args.output, "-o")
    _not_the_input(args.output, args.checkpoint, "the checkpoint read (CKPT)")
    outputs = None
    if args.outputs is not None:
        if args.training:
            raise ValueError("--outputs cuts the inference model; --training writes the whole "
                             "training checkpoint: give one of them")
        outputs = [o.strip() for o in args.outputs.split(",") if o.strip()]
        if not outputs:
            raise ValueError(f"--outputs {args.outputs!r}: expected output names, comma-separated")
    path = TrainingSession(args.checkpoint).export(args.output, training=args.training, outputs=outputs)
    kind = "training checkpoint" if args.training else "inference model"
    print(f"wrote {kind} {path}")
    return 0


def _cmd_bundle(args: argparse.Namespace) -> int:
    from ..core.files import check_folder_target
    from ..errors import OutputExists
    from ..export.bundle import write

    try:  # before the model is read: a bad -o fails at once, nothing changed
        check_folder_target(args.output, args.overwrite, how="--overwrite")
    except OutputExists as exc:
        raise ValueError(f"-o {exc}") from None
    path = write(args.model, args.output, overwrite=args.overwrite)
    print(f"wrote training bundle {path}")
    return 0


# ------------------------------------------- make-training and train (issue 4)
LOSSES = ("cross_entropy", "mse", "l1", "huber", "bce_with_logits", "nll")
OPTIMIZERS = ("adam", "adamw", "sgd", "adagrad")
SCHEDULES = ("cosine[:TOTAL[:WARMUP]]", "step_decay:STEP[:GAMMA]", "linear_warmup:STEPS")


def _add_training_commands(sub) -> None:
    make = sub.add_parser(
        "make-training", help="turn an inference model into a training model (onnxtrain.build)",
        description="Add a loss, gradients, an optimizer and initialization graphs to an "
                    "inference model, as a standard ONNX training model.")
    make.add_argument("model", metavar="MODEL", help="path of an inference .onnx model")
    make.add_argument("-o", "--output", required=True, metavar="OUT", help="output path")
    make.add_argument("--loss", default=None, choices=LOSSES,
                      help="the loss (default cross_entropy, for an output of several classes; "
                           "a one-column output needs --loss)")
    make.add_argument("--target", default="target",
                      help="name of the new target input (default 'target')")
    make.add_argument("--output-name", default=None, metavar="NAME",
                      help="the model output the loss reads (default: the first)")
    make.add_argument("--optimizer", default="adam", choices=OPTIMIZERS,
                      help="the optimizer (default adam)")
    make.add_argument("--lr", type=_positive_float, default=1e-3, help="learning rate (default 1e-3)")
    make.add_argument("--momentum", type=_non_negative_float, default=0.0,
                      help="momentum of sgd (default 0)")
    make.add_argument("--weight-decay", type=_non_negative_float, default=None,
                      help="weight decay (default: the optimizer's)")
    make.add_argument("--frozen", nargs="+", default=[], metavar="NAME",
                      help="initializers to keep fixed (every other float initializer trains)")
    make.add_argument("--schedule", default=None, metavar="SPEC",
                      help="learning-rate schedule: " + ", ".join(SCHEDULES))
    make.add_argument("--clip-grad-norm", type=_positive_float, default=None, metavar="C",
                      help="scale gradients to a global L2 norm of at most C")
    make.add_argument("--accumulate", type=_positive_int, default=1, metavar="K",
                      help="average gradients over K batches per update (default 1)")
    make.add_argument("--lora", default=None, metavar="RANK[:ALPHA]",
                      help="train low-rank adapters instead of the targeted weights "
                           "(build.LoRA(rank, alpha); alpha defaults to build.LoRA's, 16)")
    make.add_argument("--lora-targets", default=None, metavar="NAME,NAME,...",
                      help="the weights --lora adapts: initializer names, PyTorch names or "
                           "module suffixes such as q_proj,v_proj (default: every MatMul/Gemm "
                           "weight but a language model's head; inspect's lora column)")
    make.set_defaults(handler=_cmd_make_training)

    train = sub.add_parser(
        "train", help="train a training model on an .npz file (X and y) with a progress bar",
        description="Train a training model on DATA.npz (arrays X and y, or arrays named like "
                    "the model's inputs and target) and write the trained inference model.")
    train.add_argument("model", metavar="MODEL", help="path of a training model")
    train.add_argument("--data", required=True, metavar="DATA.npz", help="training data")
    train.add_argument("--epochs", type=_positive_int, required=True, metavar="N",
                       help="train up to this many epochs")
    train.add_argument("--batch-size", type=_positive_int, default=32, metavar="B",
                       help="rows per batch (default 32)")
    train.add_argument("-o", "--output", required=True, metavar="TRAINED.onnx",
                       help="where to write the trained inference model")
    train.add_argument("--checkpoint", default=None, metavar="CKPT.onnx",
                       help="write the training model (a complete checkpoint) after each epoch")
    train.add_argument("--resume", default=None, metavar="CKPT.onnx",
                       help="continue from a checkpoint written by --checkpoint")
    train.add_argument("--overwrite", action="store_true",
                       help="start again over an existing --checkpoint (without it, an existing "
                            "checkpoint needs --resume)")
    train.add_argument("--validation-data", default=None, metavar="VAL.npz",
                       help="report val_loss and val_accuracy after each epoch")
    train.add_argument("--lr", type=_non_negative_float, default=None,
                       help="the learning rate to train with (default: the model's; a schedule "
                            "scales it); also over a --resume checkpoint's")
    train.add_argument("--seed", type=int, default=0, help="shuffling seed (default 0)")
    train.add_argument("--no-progress", action="store_true",
                       help="no progress bars (one line per epoch is printed either way)")
    train.add_argument("--distributed", action="store_true",
                       help="data-parallel training over MPI: launch with mpiexec -n N; each rank "
                            "trains on its share of every global batch of N x B rows, rank 0 "
                            "prints and writes (needs onnxtrain[mpi])")
    train.add_argument("--no-terminate-on-nan", action="store_true",
                       help="raise at a NaN/Inf loss instead of stopping through TerminateOnNaN "
                            "(either way: one error line, exit 1, no output)")
    train.set_defaults(handler=_cmd_train)


def _not_the_input(output: str, source: str, what: str) -> None:
    """ValueError when ``-o`` names the file the command reads."""
    from ..train.callbacks import same_file

    if same_file(output, source):
        raise ValueError(f"-o {output}: is {what}; writing there would replace it: give another path")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def parse_schedule(text: str):
    """``cosine`` (over the run: epochs x steps per epoch, set when ``train``
    starts), ``cosine:1000``, ``cosine:1000:100``, ``cosine::100`` (the run,
    100 warmup steps), ``step_decay:500:0.5``, ``linear_warmup:200``.

    >>> parse_schedule("step_decay:500:0.5")
    StepDecay(step_size=500, gamma=0.5)
    >>> parse_schedule("cosine")
    Cosine(total_steps=None, warmup=0)
    """
    from .. import builder as build

    kind, _, rest = text.partition(":")
    args = rest.split(":") if rest else []
    usage = f"--schedule: expected one of {', '.join(SCHEDULES)}, got {text!r}"
    try:
        if kind == "cosine" and len(args) <= 2:
            total = int(args[0]) if args and args[0] else None  # none: the run's
            return build.cosine(total, *(int(a) for a in args[1:]))
        if kind == "step_decay" and len(args) in (1, 2):
            return build.step_decay(int(args[0]), *(float(a) for a in args[1:]))
        if kind == "linear_warmup" and len(args) == 1:
            return build.linear_warmup(int(args[0]))
    except ValueError as exc:
        raise ValueError(f"{usage} ({exc})") from None
    raise ValueError(usage)


def parse_lora(text: str | None, targets: str | None):
    """``--lora RANK[:ALPHA]`` and ``--lora-targets NAME,NAME,...`` as ``build.LoRA``
    (None without ``--lora``).

    >>> parse_lora("8", None) == parse_lora("8:16", None)    # build.LoRA's alpha: 16
    True
    >>> parse_lora("4:8", "q_proj,v_proj")
    LoRA(rank=4, alpha=8.0, targets=('q_proj', 'v_proj'), dropout=0.0, seed=0)
    """
    from .. import builder as build

    if text is None:
        if targets is not None:
            raise ValueError("--lora-targets needs --lora RANK[:ALPHA]")
        return None
    rank, _, alpha = text.partition(":")
    try:
        options = {"rank": int(rank)} | ({"alpha": float(alpha)} if alpha else {})
    except ValueError:
        raise ValueError(f"--lora: expected RANK[:ALPHA] (e.g. 8 or 8:16), got {text!r}") from None
    if targets is not None:
        names = [n.strip() for n in targets.split(",")]
        if not all(names):
            raise ValueError(f"--lora-targets: expected NAME,NAME,..., got {targets!r}")
        options["targets"] = names
    try:
        return build.LoRA(**options)
    except ValueError as exc:
        raise ValueError(f"--lora {text}: {exc}") from None


def _optimizer(args: argparse.Namespace):
    from .. import builder as build

    extra = {} if args.weight_decay is None else {"weight_decay": args.weight_decay}
    if args.momentum and args.optimizer != "sgd":
        raise ValueError(f"--momentum applies to --optimizer sgd, not {args.optimizer}")
    if args.optimizer == "sgd":
        return build.SGD(lr=args.lr, momentum=args.momentum, **extra)
    cls = {"adam": build.Adam, "adamw": build.AdamW, "adagrad": build.Adagrad}[args.optimizer]
    return cls(lr=args.lr, **extra)


def _cmd_make_training(args: argparse.Namespace) -> int:
    from .. import builder as build
    from ..builder.folding import FoldedBatchNormWarning
    from ..io.storage import write_model
    from ..train.callbacks import check_writable

    check_writable(args.output, "-o")
    _not_the_input(args.output, args.model, "the model read (MODEL)")
    schedule = parse_schedule(args.schedule) if args.schedule else None
    optimizer = _optimizer(args)
    lora = parse_lora(args.lora, args.lora_targets)
    if lora is not None and args.frozen:
        raise ValueError("--frozen does not go with --lora: under LoRA only the adapters train "
                         "(leave a weight out of --lora-targets to keep it as it is)")
    trainable = None
    model = args.model
    if args.frozen:
        model, _ = load(args.model)
        names = [t.name for t in model.graph.initializer]
        unknown = [n for n in args.frozen if n not in names]
        if unknown:
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise ValueError(f"--frozen: {unknown[0]!r} is not an initializer of {args.model} "
                             f"(initializers: {shown or 'none'})")
        frozen = set(args.frozen)
        trainable = lambda name: name not in frozen  # noqa: E731

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FoldedBatchNormWarning)
            built = build.training_model(
                model, loss=args.loss or "cross_entropy", target=args.target,
                output=args.output_name, optimizer=optimizer, trainable=trainable,
                schedule=schedule, clip_grad_norm=args.clip_grad_norm,
                accumulate=args.accumulate, lora=lora)
        _replay(caught)
    except TypeError as exc:  # the builder's type checks: a user mistake here
        raise ValueError(str(exc)) from None
    except ValueError as exc:
        if args.loss is None and "one class" in str(exc):  # the default does not fit: ask
            detail = str(exc).split(";")[0].removeprefix("cross_entropy: ")
            raise ValueError(f"--loss: the default, cross_entropy, does not fit this model "
                             f"({detail}): pass --loss mse for a regression or --loss "
                             "bce_with_logits for 0/1 targets") from None
        if str(exc).startswith("LoRA.targets: "):  # the option that gave them
            raise ValueError(str(exc).replace("LoRA.targets: ", "--lora-targets: ", 1)) from None
        raise
    path = write_model(built, args.output)
    sess = TrainingSession(built)
    print(f"wrote training model {path}")
    print(sess)
    return 0


def _replay(caught) -> None:
    """Warnings caught while building, shown again; the folded-BatchNorm one as
    the ``hint:`` line ``inspect`` prints."""
    from ..builder.folding import FoldedBatchNormWarning

    for w in caught:
        if issubclass(w.category, FoldedBatchNormWarning):
            print("hint: " + str(w.message).removeprefix("training_model: "), file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


class _EpochLines:
    """Prints ``epoch 3/10: loss 0.4123, ...`` on stdout as each epoch ends."""

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def on_epoch_end(self, epoch: int, logs: dict) -> None:
        values = ", ".join(f"{k} {v:.4g}" if k == "lr" else f"{k} {fmt_loss(v)}"
                           for k, v in logs.items())
        print(f"epoch {epoch + 1}/{self.epochs}: {values}", flush=True)


def _cmd_train(args: argparse.Namespace) -> int:
    from ..io.metadata import checkpoint_epoch
    from .train import TrainingInterrupted, train_files

    comm = _world() if args.distributed else None
    rank = comm.rank if comm is not None else 0
    if args.resume and rank == 0:
        at = checkpoint_epoch(args.resume)
        if at:
            print(f"resumed from {args.resume} after epoch {at}", flush=True)
    try:
        result = train_files(args.model, args.data, epochs=args.epochs, batch_size=args.batch_size,
                             output=args.output, checkpoint=args.checkpoint, resume=args.resume,
                             validation_data=args.validation_data, seed=args.seed,
                             progress=not args.no_progress,
                             callbacks=[_EpochLines(args.epochs)] if rank == 0 else [],
                             terminate_on_nan=not args.no_terminate_on_nan, comm=comm,
                             overwrite=args.overwrite, lr=args.lr)
    except TrainingInterrupted as exc:
        if exc.checkpoint is None:
            raise
        # The whole command that goes on from the checkpoint.
        told = f"continue with --resume {exc.checkpoint}"
        raise TrainingInterrupted(str(exc).replace(
            told, f"continue with: {_resume_command(args, exc.checkpoint)}"), exc.checkpoint) from None
    except USER_ERRORS:
        if rank == 0:
            raise
        return 1  # rank 0 reports it (its error names the failing rank): one line in all
    if rank != 0:
        return 0
    history = result.history
    if not history.epochs:
        print(f"nothing to train: the checkpoint is at epoch {result.initial_epoch} "
              f"of {result.epochs}")
    from ..summary import plural

    ranks = f" on {comm.size} ranks" if comm is not None and comm.size > 1 else ""
    print(f"trained {plural(len(history), 'epoch')} ({plural(history.steps, 'step')}{ranks}) "
          f"in {result.seconds:.1f} s")
    if result.checkpoint is not None:
        print(f"wrote checkpoint {result.checkpoint}")
    print(f"wrote inference model {result.output}")
    return 0


def _resume_command(args: argparse.Namespace, checkpoint) -> str:
    """``onnxtrain train ... --resume CKPT``: this run's command, resumed."""
    import shlex

    words = [PROG, "train", args.model, "--data", args.data, "--epochs", args.epochs,
             "--batch-size", args.batch_size, "--seed", args.seed, "-o", args.output]
    if args.checkpoint:
        words += ["--checkpoint", args.checkpoint]
    words += ["--resume", checkpoint]
    if args.validation_data:
        words += ["--validation-data", args.validation_data]
    if args.lr is not None:
        words += ["--lr", args.lr]
    if args.no_progress:
        words.append("--no-progress")
    return shlex.join(str(w) for w in words)


def _world():
    """MPI.COMM_WORLD for --distributed, or a one-line error without mpi4py."""
    from ..parallel.comm import world

    try:
        return world()
    except ImportError:
        raise ValueError("--distributed needs mpi4py and an MPI library: "
                         "pip install 'onnxtrain[mpi]', then launch with mpiexec -n N") from None


# ------------------------------------------------------------------- helpers
def _describe_type(vi: onnx.ValueInfoProto) -> str:
    """``float32[N, 64]`` for a tensor value; the raw type name for anything else."""
    from ..summary import describe_value

    return describe_value(vi)


def _print_values(title: str, values, out: TextIO, indent: str = "  ") -> None:
    print(f"{indent}{title}:" + ("" if values else " none"), file=out)
    for vi in values:
        print(f"{indent}  {vi.name}: {_describe_type(vi)}", file=out)


def _print_bindings(title: str, bindings, out: TextIO) -> None:
    pairs = ", ".join(f"{b.key} <- {b.value}" for b in bindings)
    print(f"      {title} ({len(bindings)}): {pairs or 'none'}", file=out)
