"""The fixed cost of a training step on a tiny model: onnxtrain against ONNX Runtime training.

    python benchmarks/tiny.py [--rounds 6] [--steps 4000] [--variants ...]

The model is issue 28's hand-written W3: linear regression 10 -> 1, batch 32,
MSE, the spec's ``Adam`` op (alpha 0.9, beta 0.999, epsilon 1e-6, the learning
rate an initializer), an int64 step counter bound through ``update_binding``.
Each variant runs in a fresh child process, the children of all variants
interleaved round by round (the machine is shared: medians of round medians,
and the ratio of each round paired with the same round's peer).

Variants (``--variants``, comma-separated):

- ``onnxtrain``: ``sess.train_step(feeds)["loss"]`` on a session made with
  default options (no ``session_options``, ``ONNXTRAIN_THREADS`` unset);
- ``onnxtrain-nofetch``: the same, ``train_step(feeds, fetch=False)``;
- ``onnxtrain-spin``: default options with onnxruntime's spinning forced on;
- ``onnxtrain-1thread``: default options with one intra-op thread;
- ``onnxtrain-unshaped``: the same model with its target declared without a
  shape (``make_tensor_value_info("Y", FLOAT, None)``, as hand-written
  algorithm graphs often do), default options: the program is specialized to
  the feed shapes (``onnxtrain.lower.specialize``);
- ``onnxtrain-unshaped-general``: that model with ``ONNXTRAIN_SPECIALIZE=0``
  (the general program, its broadcasting decided at run time);
- ``ort-training``: ``onnxruntime.training.api`` with default options:
  ``loss = module(x, y); optimizer.step(); module.lazy_reset_grad()``, on
  artifacts from ``generate_artifacts`` (MSE, AdamW with eps 1e-6, no decay);
  it runs in ``benchmarks/.venv-ort-training`` (``setup_ort_training.sh``).

``--baseline DIR`` adds ``baseline``: the ``onnxtrain`` variant run on the
onnxtrain package under DIR (e.g. ``git archive OLD onnxtrain | tar -x -C DIR``),
for A/B runs of a change.

Equal work: the first losses of every variant must agree (the spec's Adam and
ORT training's AdamW place epsilon alike at step 1, and both start from the
same weights; they are compared to 1e-4 relative).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORT_PYTHON = HERE / ".venv-ort-training" / "bin" / "python"
EPSILON = 1e-6
LR = 0.01
CHECK_STEPS = 5


def prepare(root: Path) -> Path:
    """The inference model, weights, batch and onnxtrain's training model, in ``root``."""
    sys.path.insert(0, str(HERE))
    import numpy as np
    import onnx
    from training_model import hand_built
    from workloads import WORKLOADS

    w = WORKLOADS["W3"]
    model, params, batch = w.build()
    onnx.save(model, str(root / "model.onnx"))
    np.savez(root / "batch.npz", **batch)

    class AdamW3:  # W3 with the spec Adam op (no weight decay)
        loss, output, target, optimizer = "mse", w.output, w.target, "adamw"
        lr, weight_decay, momentum = LR, 0.0, 0.0

    training = hand_built(model, AdamW3)
    for node in training.training_info[0].algorithm.node:
        if node.op_type == "Adam":
            for a in node.attribute:
                if a.name == "epsilon":
                    a.f = EPSILON
    onnx.save(training, str(root / "training.onnx"))
    target = training.training_info[0].algorithm.input[0]
    target.type.tensor_type.ClearField("shape")
    onnx.save(training, str(root / "training-unshaped.onnx"))
    return root


def ort_artifacts(root: Path) -> None:
    import onnx
    from onnxruntime.training import artifacts, onnxblock

    model = onnx.load(str(root / "model.onnx"))
    (root / "ort").mkdir(exist_ok=True)
    artifacts.generate_artifacts(
        model, requires_grad=[t.name for t in model.graph.initializer], frozen_params=[],
        loss=artifacts.LossType.MSELoss,
        optimizer=onnxblock.optim.AdamW(betas=(0.9, 0.999), eps=EPSILON, weight_decay=0.0),
        artifact_directory=str(root / "ort"))


def child(variant: str, root: Path, steps: int) -> dict:
    baseline = os.environ.get("TINY_BASELINE_SRC")
    if variant == "baseline" and baseline:
        # that tree's package, not the installed (editable) one
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
        sys.path.insert(0, baseline)
        variant = "onnxtrain"
    import numpy as np

    batch = dict(np.load(root / "batch.npz"))
    t0 = time.perf_counter()
    if variant.startswith("onnxtrain"):
        import onnxruntime as ort

        import onnxtrain

        options = None
        if variant == "onnxtrain-1thread":
            from onnxtrain.runtime.executor import default_session_options

            options = default_session_options(1)
        if variant == "onnxtrain-spin":
            from onnxtrain.runtime.executor import default_session_options

            options = default_session_options()
            options.add_session_config_entry("session.intra_op.allow_spinning", "1")
        if variant == "onnxtrain-unshaped-general":
            os.environ["ONNXTRAIN_SPECIALIZE"] = "0"
        path = root / ("training-unshaped.onnx" if "unshaped" in variant else "training.onnx")
        sess = onnxtrain.TrainingSession(str(path), session_options=options)
        feeds = {"X": batch["X"], "Y": batch["Y"]}

        def step_loss():
            return float(sess.train_step(feeds)["loss"])

        if variant == "onnxtrain-nofetch":
            def step():
                sess.train_step(feeds, fetch=False)
        else:
            def step():
                return sess.train_step(feeds)["loss"]
        info = {"onnxruntime": ort.__version__, "onnxtrain": onnxtrain.__file__}
    elif variant == "ort-training":
        import onnxruntime as ort
        from onnxruntime.training.api import CheckpointState, Module, Optimizer

        state = CheckpointState.load_checkpoint(str(root / "ort" / "checkpoint"))
        module = Module(str(root / "ort" / "training_model.onnx"), state, None, "cpu")
        opt = Optimizer(str(root / "ort" / "optimizer_model.onnx"), module)
        opt.set_learning_rate(LR)
        module.train()
        x, y = batch["X"], batch["Y"]

        def step_loss():
            loss = module(x, y)
            opt.step()
            module.lazy_reset_grad()
            return float(loss)

        def step():
            loss = module(x, y)
            opt.step()
            module.lazy_reset_grad()
            return loss
        info = {"onnxruntime": ort.__version__}
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    losses = [step_loss() for _ in range(CHECK_STEPS)]
    build_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(min(500, steps)):
        step()
    perf = time.perf_counter
    times = []
    for _ in range(steps):
        a = perf()
        step()
        times.append(perf() - a)
    arr = np.asarray(times) * 1e6
    return {"variant": variant, "median_us": float(np.median(arr)), "p90_us": float(np.percentile(arr, 90)),
            "mean_us": float(arr.mean()), "losses": losses, "build_ms": build_ms, "info": info,
            "threads": os.cpu_count()}


def run_child(python: str, variant: str, root: Path, steps: int, baseline: str | None = None) -> dict:
    env = dict(os.environ)
    if baseline:
        env["TINY_BASELINE_SRC"] = baseline
    for var in ("ONNXTRAIN_THREADS", "OMP_NUM_THREADS", "ONNXTRAIN_SPECIALIZE", "ONNXTRAIN_SPINNING"):
        env.pop(var, None)
    env["PYTHONPATH"] = str(HERE.parent)
    out = subprocess.run([python, str(Path(__file__).resolve()), "child", variant, str(root),
                          "--steps", str(steps)], capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{variant}: child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    c = sub.add_parser("child")
    c.add_argument("variant")
    c.add_argument("root", type=Path)
    c.add_argument("--steps", type=int, default=4000)
    a = sub.add_parser("artifacts")
    a.add_argument("root", type=Path)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--variants", default="onnxtrain,ort-training")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--baseline", help="another onnxtrain source tree: adds the variant 'baseline'")
    args = ap.parse_args(argv)
    if args.cmd == "child":
        print(json.dumps(child(args.variant, args.root, args.steps)))
        return 0
    if args.cmd == "artifacts":
        ort_artifacts(args.root)
        return 0
    variants = args.variants.split(",")
    if args.baseline and "baseline" not in variants:
        variants.insert(0, "baseline")
    with tempfile.TemporaryDirectory(prefix="onnxtrain-tiny-") as tmp:
        root = prepare(Path(tmp))
        if "ort-training" in variants:
            if not ORT_PYTHON.exists():
                raise SystemExit("ort-training needs benchmarks/.venv-ort-training (setup_ort_training.sh)")
            out = subprocess.run([str(ORT_PYTHON), __file__, "artifacts", str(root)],
                                 capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"generate_artifacts failed:\n{out.stderr[-3000:]}")
        results: dict[str, list[dict]] = {v: [] for v in variants}
        loads = [loadavg()]
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for v in order:
                python = str(ORT_PYTHON) if v == "ort-training" else sys.executable
                res = run_child(python, v, root, args.steps, args.baseline)
                results[v].append(res)
                print(f"round {r} {v:20s} median {res['median_us']:7.2f} us  p90 {res['p90_us']:7.2f}"
                      f"  load {loadavg()}", file=sys.stderr, flush=True)
            loads.append(loadavg())
    base = variants[-1] if "ort-training" not in variants else "ort-training"
    summary = {}
    for v in variants:
        meds = [x["median_us"] for x in results[v]]
        paired = [m / b["median_us"] for m, b in zip(meds, results[base])]
        summary[v] = {"median_us": statistics.median(meds), "rounds_us": meds,
                      "paired_ratio": statistics.median(paired), "first_losses": results[v][0]["losses"]}
    ref = summary[base]["first_losses"]
    for v in variants:
        got = summary[v]["first_losses"]
        summary[v]["equal_work"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref)) < 1e-4
    print(f"\nload averages during the run: {', '.join(loads)}")
    print(f"| variant | median µs | paired ratio to {base} | first losses agree |")
    print("|---|---|---|---|")
    for v, s in summary.items():
        print(f"| {v} | {s['median_us']:.2f} | {s['paired_ratio']:.2f} | {s['equal_work']} |")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "loads": loads}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
