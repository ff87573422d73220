"""Ctrl-C while the command line starts: one line and exit status 130.

Importing onnxtrain (numpy, onnx, onnxruntime) takes a moment, and a
KeyboardInterrupt raised then escapes before ``onnxtrain.cli.main`` can catch
it: Python would print a traceback.  ``guard_cli_start`` (run when this module is
imported, which ``onnxtrain/__init__.py`` does first) installs, only in a process started as the
command line (the ``onnxtrain`` script or ``python -m onnxtrain``), an
exception hook that reports an uncaught KeyboardInterrupt as
``onnxtrain: interrupted`` and exits with 130 (128 + SIGINT), as ``main``
does for one during a command.  A program that imports onnxtrain keeps
Python's own behaviour.  Nothing here imports more than ``os`` and ``sys``.
"""

from __future__ import annotations

import os
import sys

PROG = "onnxtrain"
#: The exit status of a run ended by Ctrl-C (128 + SIGINT), as shells report it.
INTERRUPTED = 130


def started_as_cli(argv: list[str] | None = None, orig_argv: list[str] | None = None) -> bool:
    """Whether this process is the ``onnxtrain`` script or ``python -m onnxtrain``.

    >>> started_as_cli(["/venv/bin/onnxtrain", "train"], ["python", "/venv/bin/onnxtrain"])
    True
    >>> started_as_cli(["-m"], ["python3", "-X", "dev", "-m", "onnxtrain", "demo"])
    True
    >>> started_as_cli(["script.py"], ["python", "script.py"])
    False
    """
    argv = sys.argv if argv is None else argv
    orig = getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv
    if argv and os.path.basename(argv[0]) in (PROG, f"{PROG}.exe"):
        return True
    for i, word in enumerate(orig[1:], 1):
        if word == "-m":
            return i + 1 < len(orig) and orig[i + 1] == PROG
        if word == "-c" or not word.startswith("-"):
            return False  # a command or a script: not us
        if word.startswith("-m"):
            return word[2:] == PROG
    return False


def _report_interrupt(previous):
    def hook(kind, value, traceback):
        if issubclass(kind, KeyboardInterrupt):
            try:
                detail = " ".join(str(value).split())
                sys.stderr.write(f"{PROG}: {detail or 'interrupted'}\n")
                sys.stderr.flush()
            finally:
                os._exit(INTERRUPTED)
        previous(kind, value, traceback)

    return hook


def guard_cli_start() -> None:
    """Install the hook (once) when this process is the command line."""
    if started_as_cli() and not getattr(sys.excepthook, "_onnxtrain", False):
        hook = _report_interrupt(sys.excepthook)
        hook._onnxtrain = True
        sys.excepthook = hook


guard_cli_start()
