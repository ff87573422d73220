"""Where an LLM workload's peak RSS goes (issue 36, item 1): L1 / L4 of llm.py.

    python benchmarks/peak_breakdown.py --workload L1 [--json OUT]

One fresh process: RSS and its parts (/proc/self/smaps_rollup: anonymous,
shared memory, file pages) after the imports, after building the training
model, after the session, after each of a few steps, and the peak (VmHWM)
during each phase; besides them the sizes of the frozen weights (the model's
initializers that are not state), of the trainable state, of the optimizer
state (held twice: the store's double buffer), and the activations estimated
as the step's rise above the RSS before it.  Run it in benchmarks/.venv-peft
(llm.py's model cache: benchmarks/.cache/llm).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from lora_peft import reset_peak, vm  # noqa: E402

MIB = 2 ** 20


def rollup() -> dict:
    """RSS parts in bytes (anonymous, shared memory, file-backed)."""
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if parts[0] in ("Rss:", "Anonymous:", "Shared_Clean:", "Private_Clean:"):
                out[parts[0][:-1]] = int(parts[1]) * 1024
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="L1", choices=("L1", "L4"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    import llm
    import numpy as np

    spec = llm.spec_of(args.workload, False)
    folder = llm.model_dir(spec["model"])
    path = folder / f"model-{spec['batch']}x{spec['seq']}.onnx"
    rng = np.random.default_rng(llm.SEED + 1)
    vocab = llm.MODELS[spec["model"]]["vocab"]
    tokens = rng.integers(2, vocab, (args.steps, spec["batch"], spec["seq"] + 1), dtype=np.int64)

    from onnxtrain import TrainingSession, build
    from onnxtrain.summary import state_rows

    phases = []

    def mark(name: str, **extra) -> None:
        phases.append(dict(phase=name, rss=vm("VmRSS"), peak=vm("VmHWM"), **rollup(), **extra))
        p = phases[-1]
        print(f"{name:>18}: rss {p['rss'] / MIB:7.0f} MiB (anon {p['RssAnon'] / MIB:6.0f}, shmem "
              f"{p['RssShmem'] / MIB:5.0f}, file {p['RssFile'] / MIB:5.0f}); peak in phase "
              f"{p['peak'] / MIB:7.0f} MiB {extra or ''}", flush=True)
        reset_peak()

    reset_peak()
    mark("imports")
    tm = build.training_model(str(path), **llm.build_args(spec))
    mark("training model")
    t = time.perf_counter()
    sess = TrainingSession(tm, memory="lean" if spec["mode"] == "full" else "safe")
    del tm
    mark("session", seconds=round(time.perf_counter() - t, 2))
    losses = []
    for step in range(args.steps):
        feeds = {"input_ids": tokens[step, :, :-1].copy(), "labels": tokens[step, :, 1:].copy()}
        t = time.perf_counter()
        out = sess.train_step(feeds)
        losses.append(float(out["loss"]))
        mark(f"step {step + 1}", seconds=round(time.perf_counter() - t, 3))
    rows = state_rows(sess)
    sizes = {role: sum(int(np.prod(r.shape)) * np.dtype(r.dtype).itemsize for r in rows if r.role == role)
             for role in ("trainable", "optimizer", "state")}
    state = {i.name for i in sess.model.graph.initializer if i.name in sess.state_info}
    frozen = sum(int(np.prod(i.dims)) * 4 for i in sess.model.graph.initializer if i.name not in state
                 and i.data_type == 1)
    inline = sum(len(i.raw_data) for i in sess.model.graph.initializer)
    report = dict(workload=args.workload, phases=phases, losses=losses, frozen_weights=frozen,
                  inline_bytes_in_session_model=inline, **{f"{k}_bytes": v for k, v in sizes.items()})
    print(json.dumps({k: v for k, v in report.items() if k != "phases"}))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
