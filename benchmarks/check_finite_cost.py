"""The cost of ``TrainingSession(..., check_finite=True)``, measured side by side.

Not part of CI.  For a few model sizes, trains two sessions of the same
model, one with the guard and one without, alternating blocks of steps in one
process (so that machine noise hits both alike), and prints the time per
step of each and the overhead of the guard.  The guard reads every bound
state value back to numpy and runs ``np.isfinite(...).all()`` on it, so its
cost grows with the state size (parameters and optimizer moments), not with
the batch.

    python benchmarks/check_finite_cost.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from onnxtrain import TrainingSession
from onnxtrain.demo import build_classifier

SIZES = {
    # name: (n_in, hidden, n_out, batch)
    "demo 64-64-10 (Adam, 5k params)": (64, 64, 10, 32),
    "mlp 256-1024-10 (Adam, 274k params)": (256, 1024, 10, 64),
    "mlp 1024-2048-256 (Adam, 2.6M params)": (1024, 2048, 256, 64),
}


def measure(n_in: int, hidden: int, n_out: int, batch: int, seconds: float) -> dict:
    rng = np.random.default_rng(0)
    model = build_classifier(n_in=n_in, hidden=hidden, n_out=n_out)
    plain = TrainingSession(model)
    guarded = TrainingSession(model, check_finite=True)
    feeds = {"X": rng.standard_normal((batch, n_in)).astype(np.float32),
             "label": rng.integers(0, n_out, batch).astype(np.int64)}
    for sess in (plain, guarded):
        sess.initialize()
        for _ in range(5):
            sess.train_step(feeds, fetch=False)
    # Steps per block: about 0.2 s of work.
    t0 = time.perf_counter()
    plain.train_step(feeds, fetch=False)
    per = max(1, int(0.2 / max(time.perf_counter() - t0, 1e-6)))
    times = {"plain": [], "guarded": []}
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for name, sess in (("plain", plain), ("guarded", guarded)):
            t0 = time.perf_counter()
            for _ in range(per):
                sess.train_step(feeds, fetch=False)
            times[name].append((time.perf_counter() - t0) / per)
    state_floats = sum(v.size for k, v in plain.state.items() if v.dtype.kind == "f")
    p = float(np.median(times["plain"]))
    g = float(np.median(times["guarded"]))
    return {"state_floats": state_floats, "plain_ms": p * 1e3, "guarded_ms": g * 1e3,
            "overhead_ms": (g - p) * 1e3, "overhead_percent": 100 * (g / p - 1),
            "blocks": len(times["plain"]), "steps_per_block": per}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="per model size")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    results = {}
    for name, dims in SIZES.items():
        r = measure(*dims, seconds=args.seconds)
        results[name] = r
        print(f"{name:40s} state {r['state_floats']:>9,d} floats  step {r['plain_ms']:7.3f} ms  "
              f"guarded {r['guarded_ms']:7.3f} ms  overhead {r['overhead_ms']:+7.3f} ms "
              f"({r['overhead_percent']:+5.1f} %)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
