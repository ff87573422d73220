"""Communicators for data-parallel training: ``TrainingSession(model, comm=...)``.

The public face of ``onnxtrain.parallel.comm``, where they are defined.
"""

from .parallel.comm import (
    Communicator,
    LocalCommunicator,
    MPICommunicator,
    SingleProcess,
    agree,
    as_communicator,
    local_group,
    together,
)

__all__ = ["Communicator", "LocalCommunicator", "MPICommunicator", "SingleProcess", "agree",
           "as_communicator", "local_group", "together"]
