"""The demo: a classifier trained on the digits (public; defined in ``onnxtrain.cli.demo``)."""

from .cli.demo import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_EPOCHS,
    DEFAULT_LR,
    TEST_FRACTION,
    build_classifier,
    demo_steps,
    run_demo,
)

__all__ = ["DEFAULT_BATCH_SIZE", "DEFAULT_EPOCHS", "DEFAULT_LR", "TEST_FRACTION", "build_classifier",
           "demo_steps", "run_demo"]
