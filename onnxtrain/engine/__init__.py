"""The parts ``TrainingSession`` (``onnxtrain/session.py``) is made of, one
concept a module: its settings, how it compiles and plans its programs, the
data-parallel step, and export.  Each is a mixin whose methods use the
session's own attributes; ``session.py`` holds the transactional step engine
and composes them.
"""
