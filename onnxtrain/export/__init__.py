"""Every way out of onnxtrain, each taking one ``SessionLike`` (a
``TrainingSession``, or anything with its ``model``, ``state`` and
``fit_position``): the portable training bundle (``bundle``: write,
``bundle_read``: read back; docs/bundle.md).

It sits below the session and imports no onnxruntime: a way out writes
files, it runs nothing.
"""

from .session_like import SessionLike

__all__ = ["SessionLike"]
