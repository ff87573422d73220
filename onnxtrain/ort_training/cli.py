"""``onnxtrain import-ort ART_DIR -o model.onnx``: the subcommand's parser and handler.

``onnxtrain.cli`` calls ``add_parser(subparsers)``; the handler ``run(args)``
converts (``import_ort``) and prints what it wrote.  Mistakes (a missing
folder or file, a nominal checkpoint, .ort files, an unknown optimizer) are
ValueError / OSError, which the CLI reports in one line with exit code 1.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "import-ort", help="turn ONNX Runtime training artifacts + checkpoint into one training model",
        description="Convert the artifacts of onnxruntime.training (training_model.onnx, "
                    "eval_model.onnx, optimizer_model.onnx, checkpoint) into one standard ONNX "
                    "training model with their state, for TrainingSession, fit and 'onnxtrain train'.")
    p.add_argument("art_dir", metavar="ART_DIR", help="folder of the artifacts")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="output .onnx path")
    p.add_argument("--prefix", default="", help="file-name prefix the artifacts were made with")
    p.add_argument("--checkpoint", default=None, metavar="CKPT",
                   help="checkpoint file to take the state from (default ART_DIR/<prefix>checkpoint)")
    p.add_argument("--prediction", default=None, metavar="NAME",
                   help="the value the loss compares with the target, for fit's metrics "
                        "(default: found from the loss nodes when there is one)")
    p.set_defaults(handler=run)
    return p


def run(args: argparse.Namespace) -> int:
    from .convert import import_ort

    try:
        model = import_ort(args.art_dir, args.output, prefix=args.prefix, checkpoint=args.checkpoint,
                           prediction=args.prediction)
    except (NotImplementedError, ImportError) as exc:  # unsupported input: a user mistake here
        raise ValueError(str(exc)) from None
    trainable = len(model.training_info[0].update_binding)
    print(f"wrote {args.output}: {len(model.graph.input)} inputs, "
          f"{trainable} state variables updated per step")
    return 0
