"""Ctrl-C while the command line starts: one line and exit status 130.

Importing onnxtrain (numpy, onnx, onnxruntime) takes a moment, and a
KeyboardInterrupt raised then escapes before ``onnxtrain.cli.main`` can catch
it: Python would print a traceback.  ``guard_cli_start`` (run when this module is
imported, which ``onnxtrain/__init__.py`` does first) installs, only in a process started as the
command line (the ``onnxtrain`` script or ``python -m onnxtrain``), an
exception hook that reports an uncaught KeyboardInterrupt as
``onnxtrain: interrupted`` and exits with 130 (128 + SIGINT), as ``main``
does for one during a command, and a SIGINT handler that does the same at once
until ``main`` starts (``end_of_start``).  A program that imports onnxtrain keeps
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
    words = iter(orig[1:])
    for word in words:
        if word == "-m":
            return next(words, None) == PROG
        if word.startswith("-m"):
            return word[2:] == PROG
        if word == "-c" or not word.startswith("-"):
            return False  # a command or a script: not us
        if word in ("-X", "-W", "--check-hash-based-pycs"):
            next(words, None)  # the option's argument
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


def _exit_interrupted(signum, frame) -> None:
    """SIGINT while starting: one line, exit 130 at once.  (A KeyboardInterrupt
    raised inside an extension module's import can be swallowed by its C code,
    which clears errors; exiting from the handler cannot be.)"""
    try:
        sys.stderr.write(f"{PROG}: interrupted\n")
        sys.stderr.flush()
    finally:
        os._exit(INTERRUPTED)


def guard_cli_start() -> None:
    """Install the hook (once) and the start-up SIGINT handler when this
    process is the command line; ``end_of_start`` hands SIGINT back to Python."""
    if not started_as_cli():
        return
    if not getattr(sys.excepthook, "onnxtrain_interrupt_hook", False):
        hook = _report_interrupt(sys.excepthook)
        hook.onnxtrain_interrupt_hook = True
        sys.excepthook = hook
    try:
        import signal

        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _exit_interrupted)
    except (ImportError, ValueError, OSError):  # not the main thread, or no signals here
        pass


def end_of_start() -> None:
    """From here Ctrl-C raises KeyboardInterrupt again (``main`` reports it,
    ``train`` names the checkpoint); called when ``onnxtrain.cli.main`` starts."""
    try:
        import signal

        if signal.getsignal(signal.SIGINT) is _exit_interrupted:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except (ImportError, ValueError, OSError):
        pass


guard_cli_start()
