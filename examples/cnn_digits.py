"""A small CNN on the 8x8 digits, seen as 1x8x8 images: build, fit, evaluate, export.

    inference model   image[N,1,8,8] -> Conv 3x3 -> Relu -> MaxPool 2x2 -> Flatten -> Gemm -> logits
    training model    onnxtrain.build.training_model(..., loss="cross_entropy", optimizer=Adam)

The convolution's gradient comes from onnxtrain's autodiff (a ConvTranspose-
style backward pass in standard ONNX ops), the Adam update is lowered to
standard ops, and the whole step runs in onnxruntime.

    python examples/cnn_digits.py            # 12 epochs, ~97% test accuracy, a few seconds
    python examples/cnn_digits.py --quick    # 2 epochs
"""

from __future__ import annotations

import argparse

from inference_models import cnn

from onnxtrain import TrainingSession, build
from onnxtrain.datasets import load_digits, train_test_split


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (2 epochs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--epochs", type=int, default=None, help="passes over the data (default 12)")
    parser.add_argument("-o", "--output", default=None, help="also write the trained inference model")
    args = parser.parse_args(argv)
    epochs = args.epochs or (2 if args.quick else 12)

    X, y = load_digits()
    images = X.reshape(-1, 1, 8, 8)  # NCHW: one channel of 8x8 pixels
    X_train, X_test, y_train, y_test = train_test_split(images, y, test_size=0.2, seed=0)

    model = build.training_model(cnn(channels=16), loss="cross_entropy", target="label",
                                 optimizer=build.Adam(lr=3e-3))
    sess = TrainingSession(model)
    print(sess)
    history = sess.fit(X_train, y_train, epochs=epochs, batch_size=32,
                       validation_data=(X_test, y_test),
                       progress=not (args.quick or args.no_progress))
    result = sess.evaluate((X_test, y_test))
    print(f"after {len(history)} epochs ({sum(history.seconds):.1f} s): "
          f"test loss {result['loss']:.4f}, test accuracy {result['accuracy']:.2%}")
    if args.output:
        print(f"wrote {sess.export(args.output)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
