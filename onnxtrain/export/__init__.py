"""Every way out of onnxtrain, each taking one ``SessionLike`` (a
``TrainingSession``, or anything with its ``model``, ``state`` and
``fit_position``): the ONNX model for inference or as a checkpoint
(``model``), onnxruntime-genai folders (``genai``), LoRA adapter files
(``adapters``) and the portable training bundle (``bundle``: write,
``bundle_read``: read back; docs/bundle.md).

It sits below the session and imports no onnxruntime: a way out writes
files, it runs nothing (``genai``'s ``.onnx_adapter`` files, onnxruntime's
format, are written by ``runtime.adapters``).
"""

from .session_like import SessionLike

__all__ = ["SessionLike"]
