"""Soak test: train a small model for many steps and watch resident memory.

Not part of CI.  Runs ``--steps`` (default 200,000) Adam steps of the demo
classifier, and alongside them the other calls a long-running trainer makes:
``run()`` every 10 steps, a ``state`` read every 1,000 steps, an
``export(training=True)`` every 20,000 steps and a ``load_state`` every
50,000 steps.  Resident memory (VmRSS) is sampled after a warm-up (default
10,000 steps, when onnxruntime's arena and the binding caches have settled)
and then every ``--every`` steps.  The pass criterion is growth after warm-up
below 5 %.

    python benchmarks/soak.py                       # the full run (a few minutes)
    python benchmarks/soak.py --steps 20000 --warmup 5000 --json soak.json

Prints one line per sample and a final summary; exits 1 when growth >= 5 %.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import numpy as np

from onnxtrain import TrainingSession
from onnxtrain.demo import build_classifier


def rss_mib() -> float:
    """Resident set size of this process in MiB (Linux /proc; ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--warmup", type=int, default=10_000)
    ap.add_argument("--every", type=int, default=10_000, help="sample memory every N steps")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json", help="write the samples and summary to this file")
    args = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    sess = TrainingSession(build_classifier(n_in=64, hidden=32, n_out=10))
    sess.initialize()
    xs = rng.standard_normal((16, args.batch, 64)).astype(np.float32)
    ys = rng.integers(0, 10, (16, args.batch)).astype(np.int64)
    tmp = tempfile.mkdtemp(prefix="onnxtrain-soak-")
    export_path = os.path.join(tmp, "checkpoint.onnx")

    samples: list[tuple[int, float]] = []
    baseline = None
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        i = step % len(xs)
        out = sess.train_step({"X": xs[i], "label": ys[i]})
        if step % 10 == 0:
            sess.run({"X": xs[i]})
        if step % 1_000 == 0:
            _ = sess.state["W1"]
            if not np.isfinite(out["loss"]):
                print(f"step {step}: non-finite loss", file=sys.stderr)
                return 2
        if step % 20_000 == 0:
            sess.export(export_path, training=True)
        if step % 50_000 == 0:
            sess.load_state({"W1": sess.state["W1"]})
        if step == args.warmup or (step > args.warmup and step % args.every == 0) or step == args.steps:
            gc.collect()
            mem = rss_mib()
            samples.append((step, mem))
            if baseline is None:
                baseline = mem
            rate = step / (time.perf_counter() - t0)
            print(f"step {step:>7}  rss {mem:8.1f} MiB  growth {100 * (mem / baseline - 1):+6.2f} %"
                  f"  {rate:7.0f} steps/s", flush=True)
    elapsed = time.perf_counter() - t0
    final = samples[-1][1]
    peak = max(m for _, m in samples)
    growth = 100 * (final / baseline - 1)
    summary = {
        "steps": args.steps,
        "warmup": args.warmup,
        "seconds": round(elapsed, 1),
        "steps_per_s": round(args.steps / elapsed),
        "rss_after_warmup_mib": round(baseline, 1),
        "rss_final_mib": round(final, 1),
        "rss_peak_after_warmup_mib": round(peak, 1),
        "growth_percent": round(growth, 2),
        "peak_growth_percent": round(100 * (peak / baseline - 1), 2),
        "final_loss": float(out["loss"]),
        "step_counter": int(sess.state["step"]),
    }
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "samples": samples}, f, indent=1)
    for name in os.listdir(tmp):
        os.unlink(os.path.join(tmp, name))
    os.rmdir(tmp)
    return 0 if growth < 5 else 1


if __name__ == "__main__":
    sys.exit(main())
