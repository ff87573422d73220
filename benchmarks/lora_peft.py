"""LoRA fine-tuning: PyTorch + peft against onnxtrain, peak memory and step time.

The same GPT-2-style model (``transformers.GPT2LMHeadModel(GPT2Config(...))``
with seeded random weights; no hub download), the same LoRA configuration
(rank, alpha, no dropout, the targets ``c_attn``, ``c_proj`` and ``c_fc`` of
every block), the same optimizer (AdamW, same hyper-parameters), the same
batches of token ids and next-token labels, the same number of steps:

- **peft**: ``peft.get_peft_model(model, LoraConfig(...))``, a plain
  ``loss.backward(); opt.step(); opt.zero_grad()`` loop (PyTorch eager, the
  model's default attention);
- **onnxtrain**: the model exported by ``torch.onnx.export`` (dynamo, static
  shapes), ``build.training_model(path, loss="cross_entropy",
  lora=build.LoRA(..., targets=<the same weights>))``, ``TrainingSession``,
  ``train_step``.

Both sides start from the same adapters: peft's ``lora_A`` is loaded with the
values onnxtrain's seeded initialization gives (transposed: peft stores
``[r, in]``), ``lora_B`` is zero on both.  So the first-step losses are the
base model's and agree to float rounding, and the later ones track each other.

Each measurement runs in a fresh subprocess so that its peak resident memory
(VmHWM from /proc/self/status) is its own; with ``--repeats N`` the two
frameworks alternate N times and the medians are reported.  Step time is the
median over the steps after ``--warmup``.  "setup" is everything before the
first step (model construction or loading, LoRA wrapping or building,
session creation); "peak RSS" is the whole process's peak; "train peak" is the
peak during the steps alone (VmHWM reset after setup).

Needs ``benchmarks/.venv-peft`` (``bash benchmarks/setup_peft.sh``); run with
any Python, it re-executes itself there.

    python benchmarks/lora_peft.py --small          # a tiny GPT-2, seconds
    python benchmarks/lora_peft.py                  # 124 M parameters (GPT-2 small sizes)
    python benchmarks/lora_peft.py --repeats 2 --json lora_peft.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV_PYTHON = HERE / ".venv-peft" / "bin" / "python"
TARGET_MODULES = ("c_attn", "c_proj", "c_fc")

#: GPT2Config arguments, and the run's batch, sequence length and steps.
CONFIGS = {
    "125m": dict(model=dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),
                 batch=2, seq=128, steps=12, warmup=2),
    "small": dict(model=dict(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=128),
                  batch=2, seq=32, steps=6, warmup=1),
}


# ------------------------------------------------------------------ process helpers
def in_peft_venv(script: str) -> None:
    """Return if torch, transformers and peft import here; else re-execute
    ``script`` with this command line in benchmarks/.venv-peft, or exit saying
    how to make it."""
    try:
        import peft  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        if VENV_PYTHON.exists() and Path(sys.prefix).resolve() != VENV_PYTHON.parents[1].resolve():
            os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), script, *sys.argv[1:]])
        raise SystemExit("needs torch, transformers and peft: run `bash benchmarks/setup_peft.sh` "
                         "and use benchmarks/.venv-peft/bin/python") from None


def vm(field: str) -> int:
    """A /proc/self/status field in bytes (VmHWM: peak resident size, VmRSS: now)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> bool:
    """Set VmHWM back to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def gpt2_config(spec: dict):
    from transformers import GPT2Config

    last = spec["model"]["vocab_size"] - 1  # GPT-2's <|endoftext|> is the last token
    return GPT2Config(**spec["model"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=last, eos_token_id=last)


def gpt2_model(spec: dict, seed: int, attn: str | None = None):
    """The seeded random GPT-2: identical weights in every process (same torch, same seed)."""
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = gpt2_config(spec)
    if attn:
        cfg._attn_implementation = attn
    return GPT2LMHeadModel(cfg)


def onnx_name(module: str) -> str:
    """The ONNX initializer of a Conv1D module's weight (the exporter keeps torch's names)."""
    return f"m.{module}.weight"


def target_modules(spec: dict) -> list[str]:
    n = spec["model"]["n_layer"]
    return [f"transformer.h.{i}.{part}" for i in range(n)
            for part in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


# ------------------------------------------------------------------ prepare (parent)
def prepare(spec: dict, args, work: Path) -> None:
    """Export the model, write the batches and onnxtrain's initial lora_A values."""
    import numpy as np
    import torch

    from onnxtrain import build

    model = gpt2_model(spec, args.seed, attn="eager").eval()

    class LogitsOnly(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids):
            return self.m(input_ids=input_ids, use_cache=False).logits

    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(0, spec["model"]["vocab_size"],
                          (spec["steps"], spec["batch"], spec["seq"] + 1), dtype=np.int64)
    np.save(work / "tokens.npy", tokens)
    example = torch.from_numpy(tokens[0, :, :-1].copy())
    t0 = time.perf_counter()
    with torch.no_grad():
        torch.onnx.export(LogitsOnly(model).eval(), (example,), str(work / "gpt2.onnx"), dynamo=True,
                          input_names=["input_ids"], output_names=["logits"], verbose=False)
    print(f"exported {work / 'gpt2.onnx'} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    del model
    # onnxtrain's seeded lora_A values, for peft to start from the same adapters
    tm = build.training_model(str(work / "gpt2.onnx"), **onnxtrain_build_args(spec, args))
    a_init = {}
    for t in tm.graph.initializer:
        if t.name.endswith(".lora_A"):
            from onnx import numpy_helper

            a_init[t.name] = numpy_helper.to_array(t)
    if not a_init:  # the adapters may be algorithm-graph initializers
        from onnx import numpy_helper

        for info in tm.training_info:
            for t in info.initialization.initializer:
                if t.name.endswith(".lora_A"):
                    a_init[t.name] = numpy_helper.to_array(t)
    expected = {onnx_name(m) + ".lora_A" for m in target_modules(spec)}
    if set(a_init) != expected:
        raise SystemExit(f"onnxtrain's adapters {sorted(a_init)[:4]}... are not the expected "
                         f"{sorted(expected)[:4]}...")
    np.savez(work / "lora_A.npz", **a_init)


def onnxtrain_build_args(spec: dict, args) -> dict:
    from onnxtrain import build

    targets = [onnx_name(m) for m in target_modules(spec)]
    return dict(loss="cross_entropy", target="labels",
                optimizer=build.AdamW(lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                      weight_decay=args.weight_decay),
                lora=build.LoRA(rank=args.rank, alpha=args.alpha, targets=targets, dropout=0.0))


# ------------------------------------------------------------------ workers (subprocesses)
def worker_peft(spec: dict, args, work: Path) -> dict:
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model

    t0 = time.perf_counter()
    model = gpt2_model(spec, args.seed)
    model.train()
    config = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0,
                        target_modules=list(TARGET_MODULES), fan_in_fan_out=True, bias="none")
    model = get_peft_model(model, config)
    a_init = np.load(work / "lora_A.npz")
    with torch.no_grad():
        for name in target_modules(spec):
            module = model.base_model.model.get_submodule(name)
            module.lora_A["default"].weight.copy_(torch.from_numpy(a_init[onnx_name(name) + ".lora_A"].T))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=args.weight_decay)
    tokens = np.load(work / "tokens.npy")
    setup = time.perf_counter() - t0
    setup_peak, setup_rss = vm("VmHWM"), vm("VmRSS")
    reset_peak()
    losses, times = [], []
    vocab = spec["model"]["vocab_size"]
    for step in range(tokens.shape[0]):
        ids = torch.from_numpy(tokens[step, :, :-1].copy())
        labels = torch.from_numpy(tokens[step, :, 1:].copy())
        t = time.perf_counter()
        logits = model(input_ids=ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
    return dict(framework="peft", setup_s=setup, setup_peak=setup_peak, setup_rss=setup_rss,
                train_peak=vm("VmHWM"), losses=losses, step_s=times,
                trainable=sum(p.numel() for p in params), threads=torch.get_num_threads(),
                versions={"torch": torch.__version__, "peft": __import__("peft").__version__,
                          "transformers": __import__("transformers").__version__})


def worker_onnxtrain(spec: dict, args, work: Path) -> dict:
    import numpy as np
    import onnxruntime

    import onnxtrain
    from onnxtrain import TrainingSession, build

    t0 = time.perf_counter()
    tm = build.training_model(str(work / "gpt2.onnx"), **onnxtrain_build_args(spec, args))
    sess = TrainingSession(tm)
    del tm
    tokens = np.load(work / "tokens.npy")
    setup = time.perf_counter() - t0
    setup_peak, setup_rss = vm("VmHWM"), vm("VmRSS")
    reset_peak()
    losses, times = [], []
    for step in range(tokens.shape[0]):
        feeds = {"input_ids": tokens[step, :, :-1].copy(), "labels": tokens[step, :, 1:].copy()}
        t = time.perf_counter()
        out = sess.train_step(feeds)
        times.append(time.perf_counter() - t)
        losses.append(float(out["loss"]))
    trainable = sum(v.size for k, v in sess.state.items() if k.endswith((".lora_A", ".lora_B")))
    return dict(framework="onnxtrain", setup_s=setup, setup_peak=setup_peak, setup_rss=setup_rss,
                train_peak=vm("VmHWM"), losses=losses, step_s=times, trainable=int(trainable),
                threads=os.environ.get("ONNXTRAIN_THREADS", "default"),
                versions={"onnxtrain": onnxtrain.__version__, "onnxruntime": onnxruntime.__version__})


WORKERS = {"peft": worker_peft, "onnxtrain": worker_onnxtrain}


# ------------------------------------------------------------------ report
def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def summarize(runs: list[dict], spec: dict) -> dict:
    warm = spec["warmup"]
    out = {}
    for fw in ("peft", "onnxtrain"):
        rs = [r for r in runs if r["framework"] == fw]
        med = lambda key: statistics.median(r[key] for r in rs)  # noqa: E731
        out[fw] = dict(
            step_s=statistics.median(statistics.median(r["step_s"][warm:]) for r in rs),
            step_s_runs=[statistics.median(r["step_s"][warm:]) for r in rs],
            first_step_s=med("first"),
            setup_s=med("setup_s"),
            peak=max(max(r["setup_peak"], r["train_peak"]) for r in rs),
            setup_peak=med("setup_peak"),
            train_peak=med("train_peak"),
            trainable=rs[0]["trainable"],
            losses=rs[0]["losses"],
        )
    return out


def table(summary: dict, weight_bytes: int) -> str:
    rows = [
        "| | peft (PyTorch eager) | onnxtrain |",
        "|---|---:|---:|",
    ]
    p, o = summary["peft"], summary["onnxtrain"]
    rows.append(f"| s/step (median after warm-up) | {p['step_s']:.3f} | {o['step_s']:.3f} |")
    if len(p["step_s_runs"]) > 1:
        each = lambda x: ", ".join(f"{v:.3f}" for v in x["step_s_runs"])  # noqa: E731
        rows.append(f"| s/step, each run (in order) | {each(p)} | {each(o)} |")
    rows.append(f"| first step, s | {p['first_step_s']:.3f} | {o['first_step_s']:.3f} |")
    rows.append(f"| setup, s | {p['setup_s']:.1f} | {o['setup_s']:.1f} |")
    rows.append(f"| peak RSS, GiB (whole process) | {gib(p['peak'])} | {gib(o['peak'])} |")
    rows.append(f"| peak RSS during setup, GiB | {gib(p['setup_peak'])} | {gib(o['setup_peak'])} |")
    rows.append(f"| peak RSS during the steps, GiB | {gib(p['train_peak'])} | {gib(o['train_peak'])} |")
    rows.append(f"| peak RSS / weight bytes | {p['peak'] / weight_bytes:.1f} | {o['peak'] / weight_bytes:.1f} |")
    rows.append(f"| trainable parameters | {p['trainable']:,} | {o['trainable']:,} |")
    rows.append(f"| first-step loss | {p['losses'][0]:.6f} | {o['losses'][0]:.6f} |")
    rows.append(f"| last-step loss | {p['losses'][-1]:.6f} | {o['losses'][-1]:.6f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny GPT-2 (seconds)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the median")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs of each framework")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--work", default=None, help="folder for the exported model (default: temporary)")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    spec = dict(CONFIGS["small" if args.small else "125m"])
    for key in ("steps", "warmup", "batch", "seq"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    if spec["warmup"] >= spec["steps"]:
        parser.error("--warmup must be smaller than --steps")

    if args.worker:
        work = Path(args.work)
        result = WORKERS[args.worker](spec, args, work)
        result["first"] = result["step_s"][0]
        Path(args.result).write_text(json.dumps(result))
        return 0

    in_peft_venv(__file__)

    load_before = os.getloadavg()
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lora_peft_", dir=args.work) as tmp:
        work = Path(tmp)
        prepare(spec, args, work)
        weight_bytes = (work / "gpt2.onnx").stat().st_size
        data = work / "gpt2.onnx.data"
        if data.exists():
            weight_bytes += data.stat().st_size
        runs = []
        passthrough = _drop_values(argv if argv is not None else sys.argv[1:], ("--json", "--work"))
        for _ in range(args.repeats):
            for fw in ("onnxtrain", "peft"):
                result = work / f"{fw}.json"
                cmd = [sys.executable, __file__, *passthrough, "--worker", fw,
                       "--work", str(work), "--result", str(result)]
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True)
                r = json.loads(result.read_text())
                print(f"{fw}: {statistics.median(r['step_s'][spec['warmup']:]):.3f} s/step, peak "
                      f"{gib(max(r['setup_peak'], r['train_peak']))} GiB, process "
                      f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
                runs.append(r)

    summary = summarize(runs, spec)
    p, o = summary["peft"]["losses"], summary["onnxtrain"]["losses"]
    rel = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(p, o)]
    params = sum(x.numel() for x in gpt2_model(spec, args.seed).parameters())
    cores = os.cpu_count()
    print(f"\n## LoRA fine-tuning, GPT-2 style ({params / 1e6:.1f} M parameters), "
          f"{datetime.date.today().isoformat()}\n")
    print(f"batch {spec['batch']} x {spec['seq']} tokens, r={args.rank}, alpha={args.alpha:g}, "
          f"targets {', '.join(TARGET_MODULES)} in every block, AdamW lr={args.lr:g} "
          f"wd={args.weight_decay:g}, {spec['steps']} steps (median of the last "
          f"{spec['steps'] - spec['warmup']}), {args.repeats} alternating run(s) each in a fresh "
          f"process; {platform.machine()} {cores} cores, float32; load average "
          f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after (other jobs on the "
          "machine add noise)\n")
    print(table(summary, weight_bytes))
    ok = rel[0] < 1e-4
    print(f"\nequal work: first-step losses agree to {rel[0]:.1e} (relative): {ok}; largest relative "
          f"difference over all {len(rel)} steps {max(rel):.1e}")
    versions = {**runs[0]["versions"], **runs[1]["versions"]}
    print("versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            date=datetime.date.today().isoformat(), config="small" if args.small else "125m",
            spec=spec, parameters=params, weight_bytes=weight_bytes, rank=args.rank,
            alpha=args.alpha, lr=args.lr, weight_decay=args.weight_decay, cores=cores,
            versions=versions, load_average=[load_before[0], os.getloadavg()[0]], summary=summary, runs=runs, first_loss_rel_diff=rel[0],
            max_loss_rel_diff=max(rel)), indent=1))
    return 0 if ok else 1


def _drop_values(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """argv without ``--opt VALUE`` / ``--opt=VALUE`` for the given options."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in options:
            skip = True
            continue
        if any(a.startswith(o + "=") for o in options):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
