"""Exceptions raised by onnxtrain."""

from __future__ import annotations


class TrainingModelError(ValueError):
    """A model breaks a rule of the ONNX training spec or cannot be executed.

    The message names where the problem is, for example
    ``training_info[0].update_binding[2]: key 'W9' is not an initializer of the
    main graph or of training_info[0].algorithm``.
    """


class GradientError(TrainingModelError):
    """A Gradient node cannot be expanded (missing rule, non-differentiable op, ...)."""


class ExecutionError(RuntimeError):
    """onnxruntime failed while running a program (a kernel's error on the
    fed data, an allocation failure, ...).  The message names the program
    and carries onnxruntime's own message; a step that fails this way
    commits nothing."""


class DistributedStepError(RuntimeError):
    """A data-parallel step failed on another rank (``TrainingSession(comm=...)``).

    Raised on every rank whose own part succeeded; the failing ranks raise
    their own exception.  ``ranks`` lists the failing ranks.  Nothing was
    committed on any rank."""

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks or [])


class BundleError(ValueError):
    """A training bundle (docs/bundle.md) cannot be written or read: a model
    it cannot hold, a version this onnxtrain does not know, a manifest that
    disagrees with its files.  The message names the folder, file or entry."""


class BundleFileMissing(BundleError, FileNotFoundError):
    """A file the bundle's manifest lists is not in the folder (its message
    names the file)."""

    def __init__(self, message: str) -> None:
        BundleError.__init__(self, message)
