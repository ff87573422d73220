"""``python -m onnxtrain``: the same command line as the ``onnxtrain`` script."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
