"""Prepare the in-browser training page (examples/web/): a digits classifier
bundle, the digits, and the JavaScript it runs.

    python examples/web/prepare.py
    python3 -m http.server 8000 --bind 127.0.0.1 --directory examples/web   # then open http://127.0.0.1:8000

Writes, into ``--out`` (default: this folder; all of it is gitignored):

- ``bundle/``: ``onnxtrain.bundle.save`` of a training model that the builder
  makes from a small inference model (MLP ``64-64-10`` or, ``--model cnn``, a
  Conv/MaxPool net on ``1x8x8`` images): cross-entropy, Adam (or ``--optimizer
  sgd``), the learning rate a state variable the page can change;
- ``digits.bin`` and ``digits.json``: the 8x8 digits that ship with onnxtrain
  (``onnxtrain.datasets.load_digits``), split 80/20 with
  ``train_test_split(seed=0)``, as uint8 pixel counts (0..16) and labels;
- ``vendor/ort/``: onnxruntime-web's WASM build (from ``js/node_modules`` when
  ``npm ci`` ran there, else from ``npm pack onnxruntime-web@<the version
  js/package-lock.json pins>``);
- ``vendor/onnxtrain/``: the package's browser sources (``js/src``);
- ``index.html`` and ``app.js`` (the page) when ``--out`` is another folder.

``--bundle-only`` writes the bundle alone (for examples/node_finetune.mjs
and examples/federated/).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from inference_models import cnn, mlp  # noqa: E402

from onnxtrain import build, bundle  # noqa: E402
from onnxtrain.datasets import load_digits, train_test_split  # noqa: E402

#: The files of onnxruntime-web's dist/ that the WASM build loads.
ORT_FILES = ["ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm"]


def write_bundle(folder: Path, model: str, optimizer: str, lr: float, seed: int) -> None:
    """The training model of the builder, saved as a bundle (replacing ``folder``)."""
    inference = mlp(n_in=64, hidden=64, seed=seed) if model == "mlp" else cnn(channels=8, seed=seed)
    opt = build.Adam(lr=lr) if optimizer == "adam" else build.SGD(lr=lr)
    training = build.training_model(inference, loss="cross_entropy", target="label", optimizer=opt)
    bundle.save(training, folder, overwrite=True)


def write_digits(out: Path) -> None:
    """digits.bin: train pixels, train labels, test pixels, test labels (uint8); digits.json: the counts."""
    X, y = load_digits()
    X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.2, seed=0)
    counts = [np.rint(X_train * 16), y_train, np.rint(X_test * 16), y_test]
    (out / "digits.bin").write_bytes(b"".join(a.astype(np.uint8).tobytes() for a in counts))
    (out / "digits.json").write_text(json.dumps(
        {"features": 64, "train": len(y_train), "test": len(y_test), "scale": 16,
         "layout": "uint8: train pixels [train, 64], train labels [train], test pixels, test labels"}))


def ort_dist() -> tuple[Path, tempfile.TemporaryDirectory | None]:
    """onnxruntime-web's dist folder: js/node_modules's, or the pinned version's npm tarball."""
    installed = ROOT / "js" / "node_modules" / "onnxruntime-web" / "dist"
    if installed.is_dir():
        return installed, None
    lock = json.loads((ROOT / "js" / "package-lock.json").read_text())
    version = lock["packages"]["node_modules/onnxruntime-web"]["version"]
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit("prepare: npm is needed to fetch onnxruntime-web (or run `npm ci` in js/)")
    temp = tempfile.TemporaryDirectory()
    subprocess.run([npm, "pack", f"onnxruntime-web@{version}", "--pack-destination", temp.name],
                   check=True, capture_output=True)
    (tarball,) = Path(temp.name).glob("onnxruntime-web-*.tgz")
    with tarfile.open(tarball) as archive:
        members = [m for m in archive.getmembers() if m.name in {f"package/dist/{f}" for f in ORT_FILES}]
        archive.extractall(temp.name, members=members, filter="data")
    return Path(temp.name) / "package" / "dist", temp


def write_vendor(out: Path) -> None:
    """vendor/ort (onnxruntime-web's WASM build) and vendor/onnxtrain (js/src)."""
    vendor = out / "vendor"
    if vendor.exists():
        shutil.rmtree(vendor)
    (vendor / "ort").mkdir(parents=True)
    dist, temp = ort_dist()
    try:
        for name in ORT_FILES:
            shutil.copy2(dist / name, vendor / "ort" / name)
    finally:
        if temp is not None:
            temp.cleanup()
    shutil.copytree(ROOT / "js" / "src", vendor / "onnxtrain", ignore=shutil.ignore_patterns("*.d.ts"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE), help="where to write (default: examples/web)")
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: 0.01 Adam, 0.1 SGD)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    parser.add_argument("--bundle-only", action="store_true", help="write the bundle alone")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lr = args.lr if args.lr is not None else (0.01 if args.optimizer == "adam" else 0.1)
    write_bundle(out / "bundle", args.model, args.optimizer, lr, args.seed)
    print(f"wrote {out / 'bundle'} ({args.model}, {args.optimizer} lr {lr})")
    if not args.bundle_only:
        write_digits(out)
        write_vendor(out)
        if out.resolve() != HERE:
            for page in ("index.html", "app.js"):
                shutil.copy2(HERE / page, out / page)
        print(f"wrote {out / 'digits.bin'}, {out / 'digits.json'}, {out / 'vendor'}")
        print(f"serve it: python3 -m http.server 8000 --bind 127.0.0.1 --directory {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
