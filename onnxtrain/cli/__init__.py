"""The command line (``onnxtrain``, ``python -m onnxtrain``): ``main`` in ``cli.app``."""

from .app import main

__all__ = ["main"]
