"""LLM fine-tuning workloads L1-L4: onnxtrain against PyTorch + peft and PyTorch.

    python benchmarks/llm.py [--workloads L1,L2,L3,L3r,L4] [--quick] [--json OUT]

(``benchmarks/run.py`` runs it for its L workloads and puts the tables in
``docs/benchmarks.md``.)

- **L1**: LoRA on a Llama-style decoder (hidden 512, 8 layers, 8 heads / 4 KV
  heads, FFN 1408, vocab 8000; 32 M parameters), exported by torch's dynamo
  exporter (static shapes); r=16, alpha 32 on the seven projections of every
  layer, AdamW, batch 4 x 256.  Peer: ``peft.get_peft_model`` on the same
  ``LlamaForCausalLM`` (PyTorch eager, its default attention).
- **L2**: the same on a ~0.5 B configuration (hidden 1280, 24 layers, 20 heads /
  4 KV heads, FFN 3456, vocab 32000); step time and peak RSS, a few steps.
- **L3**: QLoRA of L1's configuration built by the onnxruntime-genai model
  builder in int4 (``-p int4 -e cpu``, its defaults), LoRA on its projections.
  Peer: peft LoRA on the fp32 model, what a CPU user would otherwise run (the
  L1 peft runs, interleaved with it).
- **L3r**: L3 with ``recompute="blocks"``: the activation memory it saves
  (peak RSS) and what that costs a step.
- **L4**: a full fine-tune of L1 (AdamW, ``memory="lean"``) against
  ``torch.optim.AdamW``.

Equal work: one seeded model saved with ``save_pretrained``; torch loads it with
``from_pretrained`` and onnxtrain trains its export (or the genai builder's
model made from the same folder); the same token batches; peft's ``lora_A``
starts from onnxtrain's seeded values (transposed), ``lora_B`` at zero on both,
so the first losses are the base model's and must agree (L3: to the int4
rounding).

Every measurement is a fresh process (``--worker``), the frameworks of a
workload alternating run by run, so load changes hit both alike.  Reported:
median step time after warm-up (each run's median, then the median over runs),
tokens per second, time to first step (construction from the files on disk plus
the first step, imports excluded), peak RSS (VmHWM of the whole process) and the
peak during the steps alone.  onnxtrain's first run of a workload starts with
an empty startup cache (``ONNXTRAIN_CACHE_DIR``): its first step is the *cold*
one, the later runs' are *warm*.

The models, exports and genai folders are cached in ``benchmarks/.cache/llm``.
Needs ``benchmarks/.venv-peft`` (``bash benchmarks/setup_peft.sh``: torch,
transformers, peft, onnxscript, onnxruntime-genai and onnxtrain); run with any
Python, it re-executes itself there.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from lora_peft import in_peft_venv, reset_peak, vm  # noqa: E402

CACHE = HERE / ".cache" / "llm"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GIB = 2 ** 30

#: Llama shapes.  head size 64 (the genai builder's CPU attention needs a multiple of 16).
MODELS = {
    "32m": dict(hidden=512, layers=8, heads=8, kv_heads=4, ffn=1408, vocab=8000),
    "0.5b": dict(hidden=1280, layers=24, heads=20, kv_heads=4, ffn=3456, vocab=32000),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=176, vocab=512),
}
#: model, training mode, batch, sequence, steps per run, warm-up steps, runs per framework.
WORKLOADS = {
    "L1": dict(model="32m", mode="lora", batch=4, seq=256, steps=10, warmup=2, runs=3,
               title="LoRA r=16 on a 32 M Llama-style decoder (dynamo export), batch 4 x 256"),
    "L2": dict(model="0.5b", mode="lora", batch=4, seq=256, steps=4, warmup=1, runs=2,
               title="LoRA r=16 on a 0.5 B Llama-style decoder, batch 4 x 256"),
    "L3": dict(model="32m", mode="qlora", batch=4, seq=256, steps=10, warmup=2, runs=3,
               title="QLoRA r=16 on L1's decoder built in int4 by the onnxruntime-genai builder; "
                     "peer: peft LoRA on the fp32 model"),
    "L3r": dict(model="32m", mode="qlora", recompute="blocks", batch=4, seq=256, steps=10, warmup=2, runs=3,
                title="L3 with recompute=\"blocks\" (activation memory); peer: peft LoRA on the fp32 model"),
    "L4": dict(model="32m", mode="full", batch=4, seq=256, steps=10, warmup=2, runs=3,
               title="full fine-tune of L1's decoder, AdamW, memory=\"lean\"; peer: torch.optim.AdamW"),
}
QUICK = dict(model="tiny", batch=2, seq=32, steps=4, warmup=1, runs=2)
RANK, ALPHA, LR, WD, SEED = 16, 32.0, 1e-4, 0.01, 0
#: First losses of L3's int4 model may differ from fp32 peft's by this much (relative).
INT4_LOSS_TOLERANCE = 2e-2
#: Others: float32 rounding of the same computation in two frameworks.
LOSS_TOLERANCE = 1e-4


def spec_of(key: str, quick: bool) -> dict:
    spec = dict(WORKLOADS[key])
    if quick:
        spec.update(QUICK)
    return spec


def model_dir(model: str) -> Path:
    digest = hashlib.sha256(json.dumps([MODELS[model], SEED, 3]).encode()).hexdigest()[:10]
    return CACHE / f"llama-{model}-{digest}"


# ------------------------------------------------------------------ preparing (parent)
def make_tokenizer(folder: Path) -> None:
    """A small byte-level BPE tokenizer beside the model: the genai builder wants
    one (its ids stay below every vocabulary here; the data are random ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["a small random llama for benchmarks"] * 4, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(folder)


def make_model(model: str) -> Path:
    """The seeded random Llama (``hf/``, save_pretrained) and its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = model_dir(model)
    hf = folder / "hf"
    if (hf / "config.json").exists():
        return folder
    tmp = folder / "hf.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    c = MODELS[model]
    cfg = LlamaConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["ffn"],
                      num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                      num_key_value_heads=c["kv_heads"], max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                      attention_dropout=0.0)
    torch.manual_seed(SEED)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():  # distinct norm weights: the exporter shares equal constants (all ones)
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
    m.save_pretrained(tmp)
    make_tokenizer(tmp)
    tmp.rename(hf)
    return folder


def load_torch_model(folder: Path):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder / "hf", dtype=torch.float32)


def export_onnx(folder: Path, batch: int, seq: int) -> Path:
    """torch.onnx.export(dynamo=True) of input_ids -> logits at a static shape."""
    import torch

    path = folder / f"model-{batch}x{seq}.onnx"
    if path.exists():
        return path
    model = load_torch_model(folder).eval()

    class LogitsOnly(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids):
            return self.m(input_ids=input_ids, use_cache=False).logits

    example = torch.zeros((batch, seq), dtype=torch.int64)
    tmp = folder / f"export.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    t0 = time.perf_counter()
    with torch.no_grad():
        prog = torch.onnx.export(LogitsOnly(model), (example,), dynamo=True, input_names=["input_ids"],
                                 output_names=["logits"], verbose=False)
        prog.save(str(tmp / path.name), external_data=True)
    print(f"exported {path.name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    for f in tmp.iterdir():
        f.rename(folder / f.name)
    tmp.rmdir()
    return path


def build_genai_int4(folder: Path) -> Path:
    """The onnxruntime-genai model builder's int4 CPU model of ``hf/``."""
    out = folder / "genai-int4"
    if (out / "genai_config.json").exists():
        return out
    tmp = folder / "genai-int4.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with tempfile.TemporaryDirectory() as cache:
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(folder / "hf"),
                        "-o", str(tmp), "-p", "int4", "-e", "cpu", "-c", cache],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp.rename(out)
    return out


def genai_feeds(folder: Path, ids):
    """The genai decoder's inputs for whole sequences: all-ones mask, empty past."""
    import numpy as np

    dec = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    feeds = {"input_ids": ids, "attention_mask": np.ones(ids.shape, np.int64)}
    empty = np.zeros((ids.shape[0], dec["num_key_value_heads"], 0, dec["head_size"]), np.float32)
    for layer in range(dec["num_hidden_layers"]):
        feeds[f"past_key_values.{layer}.key"] = empty
        feeds[f"past_key_values.{layer}.value"] = empty
    return feeds


def build_args(spec: dict) -> dict:
    from onnxtrain import build

    args = dict(loss="cross_entropy", target="labels",
                optimizer=build.AdamW(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD))
    if spec["mode"] in ("lora", "qlora"):
        # the genai builder packs q, k, v into one qkv_proj: every projection but the LM head
        targets = list(PROJECTIONS) if spec["mode"] == "lora" else (lambda name: "lm_head" not in name)
        args["lora"] = build.LoRA(rank=RANK, alpha=ALPHA, targets=targets, dropout=0.0, seed=SEED)
    if spec.get("recompute"):
        args["recompute"] = spec["recompute"]
    return args


def onnx_model_of(spec: dict, folder: Path) -> Path:
    if spec["mode"] == "qlora":
        return build_genai_int4(folder) / "model.onnx"
    return export_onnx(folder, spec["batch"], spec["seq"])


def prepare(key: str, spec: dict, work: Path) -> dict:
    """Model files, token batches and (LoRA) onnxtrain's initial lora_A by module."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from onnxtrain import build
    from onnxtrain.builder.known_names import known_names

    folder = make_model(spec["model"])
    path = onnx_model_of(spec, folder)
    rng = np.random.default_rng(SEED + 1)
    vocab = MODELS[spec["model"]]["vocab"]
    tokens = rng.integers(2, vocab, (spec["steps"], spec["batch"], spec["seq"] + 1), dtype=np.int64)
    np.save(work / f"{key}-tokens.npy", tokens)
    out = {"folder": str(folder), "onnx": str(path)}
    if spec["mode"] == "lora":  # peft starts from onnxtrain's seeded A
        model = onnx.load(str(path))
        known = known_names(model.graph)
        tm = build.training_model(model, **build_args(spec))
        inits = list(tm.graph.initializer) + [t for i in tm.training_info for t in i.initialization.initializer]
        a_init = {}
        for t in inits:
            if t.name.endswith(".lora_A"):
                module = known[t.name[: -len(".lora_A")]]
                a_init[module[len("m."):-len(".weight")]] = numpy_helper.to_array(t)
        if len(a_init) != 7 * MODELS[spec["model"]]["layers"]:
            raise SystemExit(f"{key}: onnxtrain made {len(a_init)} adapters, expected 7 per layer")
        np.savez(work / f"{key}-lora_A.npz", **a_init)
    return out


# ------------------------------------------------------------------ workers (fresh processes)
def worker_torch(key: str, spec: dict, files: dict, work: Path) -> dict:
    import numpy as np
    import torch

    t0 = time.perf_counter()
    model = load_torch_model(Path(files["folder"]))
    model.train()
    if spec["mode"] == "full":
        params = list(model.parameters())
    else:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                 target_modules=list(PROJECTIONS), bias="none"))
        a_init = np.load(work / f"{key}-lora_A.npz")
        with torch.no_grad():
            for name in a_init.files:
                module = model.base_model.model.get_submodule(name)
                module.lora_A["default"].weight.copy_(torch.from_numpy(a_init[name].T))
        params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)
    tokens = np.load(work / f"{key}-tokens.npy")
    setup = time.perf_counter() - t0
    setup_peak = vm("VmHWM")
    reset_peak()
    vocab = MODELS[spec["model"]]["vocab"]
    losses, times = [], []
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
    return dict(setup_s=setup, setup_peak=setup_peak, train_peak=vm("VmHWM"), losses=losses,
                step_s=times, trainable=sum(p.numel() for p in params),
                versions={"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                          **({} if spec["mode"] == "full" else {"peft": __import__("peft").__version__})})


def worker_onnxtrain(key: str, spec: dict, files: dict, work: Path) -> dict:
    import numpy as np
    import onnxruntime

    import onnxtrain
    from onnxtrain import build

    t0 = time.perf_counter()
    sess = build.training_session(files["onnx"], session={"memory": "lean" if spec["mode"] == "full" else "safe"},
                                  **build_args(spec))
    tokens = np.load(work / f"{key}-tokens.npy")
    setup = time.perf_counter() - t0
    setup_peak = vm("VmHWM")
    reset_peak()
    genai = Path(files["onnx"]).parent if spec["mode"] == "qlora" else None
    losses, times = [], []
    for step in range(tokens.shape[0]):
        ids = tokens[step, :, :-1].copy()
        feeds = genai_feeds(genai, ids) if genai else {"input_ids": ids}
        feeds["labels"] = tokens[step, :, 1:].copy()
        t = time.perf_counter()
        out = sess.train_step(feeds, fetch=["loss"])  # (as peft's step: not the logits)
        times.append(time.perf_counter() - t)
        losses.append(float(out["loss"]))
    from onnxtrain.summary import state_rows

    trainable = sum(row.size for row in state_rows(sess) if row.role == "trainable")
    return dict(setup_s=setup, setup_peak=setup_peak, train_peak=vm("VmHWM"), losses=losses,
                step_s=times, trainable=int(trainable),
                versions={"onnxtrain": onnxtrain.__version__, "onnxruntime": onnxruntime.__version__})


def category(node: str, op: str) -> str:
    """A profiled node's part of the step, from the names the builder and the
    autodiff give (``.lora_`` adapters, ``gradient/`` backward, optimizer update)."""
    low = node.lower()
    phase = "backward" if "gradient" in low or "grad" in low.split("/")[0] else "forward"
    if "lora" in low:
        return f"LoRA products and sums ({phase})"
    if any(k in low for k in ("adam", "optimizer", "update", "weight_decay")) or op.startswith(("SpecAdam", "AdamW")):
        return "optimizer"
    if op in ("Softmax", "SoftmaxGrad", "Where", "IsNaN") or (op in ("MatMul", "FusedMatMul") and "attn" in low):
        return f"attention softmax/mask/products ({phase})"
    if op in ("MatMul", "FusedMatMul", "Gemm", "MatMulNBits"):
        return f"other products ({phase})"
    if op in ("Transpose", "Reshape", "Concat", "Slice", "Split", "Expand", "Identity", "Cast",
              "Unsqueeze", "Squeeze", "Gather", "ScatterElements", "ConstantOfShape", "MemcpyFromHost"):
        return f"copies and layout ({phase})"
    return f"elementwise and reductions ({phase})"


def worker_profile(key: str, spec: dict, files: dict, work: Path) -> dict:
    """onnxtrain's steps under onnxruntime's profiler (``enable_profiling`` in
    the session options, the rest onnxtrain's defaults): kernel time per step
    of the training program, by op type and by part of the step."""
    import gc

    import numpy as np

    from onnxtrain import TrainingSession, build
    from onnxtrain.runtime.executor import default_session_options

    sys.path.insert(0, str(HERE))
    from worker import _aggregate_profile

    so = default_session_options()
    so.enable_profiling = True
    so.profile_file_prefix = str(work / f"{key}-profile")
    tm = build.training_model(files["onnx"], **build_args(spec))
    sess = TrainingSession(tm, memory="lean" if spec["mode"] == "full" else "safe", session_options=so)
    del tm
    tokens = np.load(work / f"{key}-tokens.npy")
    genai = Path(files["onnx"]).parent if spec["mode"] == "qlora" else None
    warm, steps = 1, min(3, tokens.shape[0] - 1)
    for step in range(warm + steps):
        ids = tokens[step, :, :-1].copy()
        feeds = genai_feeds(genai, ids) if genai else {"input_ids": ids}
        feeds["labels"] = tokens[step, :, 1:].copy()
        sess.train_step(feeds)
    del sess
    gc.collect()  # onnxruntime writes each session's profile when the session goes
    files_ = sorted(work.glob(f"{key}-profile*.json"), key=lambda f: f.stat().st_size)
    path = str(files_[-1])  # the training program's: by far the most events
    agg = _aggregate_profile(path, warm)
    events = json.loads(Path(path).read_text())
    for f in files_:
        f.unlink()
    runs = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    starts = runs[warm:]
    parts: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= starts[0]:
            node = e["name"][: -len("_kernel_time")]
            part = category(node, e.get("args", {}).get("op_name", "?"))
            parts[part] = parts.get(part, 0.0) + e["dur"] / len(starts)
    agg["parts"] = sorted(parts.items(), key=lambda kv: -kv[1])
    return agg


WORKERS = {"torch": worker_torch, "onnxtrain": worker_onnxtrain, "profile": worker_profile}


def peer_name(spec: dict) -> str:
    return "torch" if spec["mode"] == "full" else "peft"


# ------------------------------------------------------------------ running
def run_worker(key: str, framework: str, spec_key: str, quick: bool, files: dict, work: Path,
               env: dict) -> dict:
    result = work / f"{key}-{framework}-{os.getpid()}.json"
    cmd = [sys.executable, __file__, "--worker", framework, "--key", key, "--spec", spec_key,
           "--work", str(work), "--files", json.dumps(files), "--result", str(result)]
    if quick:
        cmd.append("--quick")
    subprocess.run(cmd, check=True, env=env)
    r = json.loads(result.read_text())
    result.unlink()
    if "setup_s" in r:
        r["first_s"] = r["setup_s"] + r["step_s"][0]
    return r


def summarize(runs: list[dict], warmup: int, tokens: int) -> dict:
    medians = [statistics.median(r["step_s"][warmup:]) for r in runs]
    step = statistics.median(medians)
    cold = [r["first_s"] for r in runs if r.get("cache") == "cold"]
    warm = [r["first_s"] for r in runs if r.get("cache") != "cold"]
    return dict(step_s=step, step_s_runs=medians, tokens_per_s=tokens / step,
                first_s=statistics.median(warm or cold), first_cold_s=cold[0] if cold else None,
                first_s_runs=[r["first_s"] for r in runs],
                setup_s=statistics.median(r["setup_s"] for r in runs),
                peak=statistics.median(max(r["setup_peak"], r["train_peak"]) for r in runs),
                setup_peak=statistics.median(r["setup_peak"] for r in runs),
                train_peak=statistics.median(r["train_peak"] for r in runs),
                trainable=runs[0]["trainable"], losses=runs[0]["losses"], versions=runs[0]["versions"])


def run_all(keys: list[str], quick: bool, runs_override: int | None, log=print) -> dict:
    """Run the workloads ``keys``; the int4 ones (L3, L3r) share L1's peft runs
    when it is asked for, and one peft peer otherwise."""
    report = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "load_before": os.getloadavg()[0], "workloads": {}, "rank": RANK, "alpha": ALPHA,
              "lr": LR, "weight_decay": WD, "quick": quick}
    work = Path(tempfile.mkdtemp(prefix="onnxtrain-llm-"))
    try:
        # the int4 workloads' peer is L1's peft: one group of interleaved runs
        int4 = [k for k in keys if WORKLOADS[k]["mode"] == "qlora"]
        groups = [[k] for k in keys if k not in int4]
        if int4:
            host = next((g for g in groups if g == ["L1"]), None)
            if host is None:
                groups.append(int4)
            else:
                host.extend(int4)
        for group in groups:
            _run_group(group, quick, runs_override, work, report, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["workloads"] = {k: report["workloads"][k] for k in keys if k in report["workloads"]}
    report["load_after"] = os.getloadavg()[0]
    return report


def _run_group(group: list[str], quick: bool, runs_override: int | None, work: Path, report: dict,
               log) -> None:
    """Interleaved fresh processes of the group's variants: (key, framework) pairs."""
    specs = {k: spec_of(k, quick) for k in group}
    files, variants = {}, []
    for k in group:
        t0 = time.perf_counter()
        files[k] = prepare(k, specs[k], work)
        log(f"{k}: {specs[k]['title']}; prepared in {time.perf_counter() - t0:.1f} s")
    for k in group:
        variants.append((k, "onnxtrain"))
        if specs[k]["mode"] == "qlora":  # the peer is the fp32 model's peft LoRA
            if not any(spec["mode"] == "lora" and spec["model"] == specs[k]["model"] for spec in specs.values()):
                lora = dict(specs[k], mode="lora")
                specs[k + "-peer"] = lora
                files[k + "-peer"] = prepare(k + "-peer", lora, work)
                variants.append((k + "-peer", "torch"))
        else:
            variants.append((k, "torch"))
    runs = runs_override or specs[group[0]]["runs"]
    cache = work / "cache"
    out: dict[tuple[str, str], list[dict]] = {v: [] for v in variants}
    load = os.getloadavg()[0]
    for r in range(runs):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for key, fw in order:
            env = dict(os.environ)
            if fw == "onnxtrain":
                env["ONNXTRAIN_CACHE_DIR"] = str(cache / key)
            result = run_worker(key, fw, key.removesuffix("-peer"), quick, files[key], work, env)
            result["cache"] = "cold" if fw == "onnxtrain" and not out[(key, fw)] else "warm"
            out[(key, fw)].append(result)
            spec = specs[key]
            log(f"  run {r + 1}/{runs} {key} {fw}: {statistics.median(result['step_s'][spec['warmup']:]):.3f} "
                f"s/step, first step {result['first_s']:.2f} s ({result['cache'] if fw == 'onnxtrain' else 'fresh'}), "
                f"peak {max(result['setup_peak'], result['train_peak']) / GIB:.2f} GiB")
    for k in group:
        spec = specs[k]
        tokens = spec["batch"] * spec["seq"]
        peer_key = next((key for key, fw in variants if fw == "torch" and specs[key]["model"] == spec["model"]
                         and (specs[key]["mode"] == "full") == (spec["mode"] == "full")), None)
        ours = summarize(out[(k, "onnxtrain")], spec["warmup"], tokens)
        peer = summarize(out[(peer_key, "torch")], spec["warmup"], tokens)
        a, b = peer["losses"], ours["losses"]
        rel = [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)]
        tol = INT4_LOSS_TOLERANCE if spec["mode"] == "qlora" else LOSS_TOLERANCE
        paired = [o / p for o, p in zip(ours["step_s_runs"], peer["step_s_runs"])]
        report["workloads"][k] = dict(
            title=spec["title"], spec={x: spec[x] for x in ("model", "mode", "batch", "seq", "steps", "warmup")},
            model=MODELS[spec["model"]], runs=runs, load=load, peer=peer_name(spec),
            onnxtrain=ours, torch=peer, first_loss_rel_diff=rel[0], max_loss_rel_diff=max(rel),
            equal_work=rel[0] <= tol and (spec["mode"] == "qlora" or ours["trainable"] == peer["trainable"]),
            tolerance=tol,
            ratios=dict(step=ours["step_s"] / peer["step_s"], step_paired=statistics.median(paired),
                        peak=ours["peak"] / peer["peak"], first=ours["first_s"] / peer["first_s"]))
        w = report["workloads"][k]
        log(f"{k}: step {ours['step_s']:.3f} s vs {peer_name(spec)} {peer['step_s']:.3f} s "
            f"({w['ratios']['step']:.2f}, paired {w['ratios']['step_paired']:.2f}); peak "
            f"{ours['peak'] / GIB:.2f} vs {peer['peak'] / GIB:.2f} GiB ({w['ratios']['peak']:.2f}); "
            f"first losses {b[0]:.6f} vs {a[0]:.6f} (rel. {rel[0]:.1e}, equal work {w['equal_work']})")


def profile_all(keys: list[str], quick: bool) -> list[str]:
    """Markdown: each workload's onnxtrain step under onnxruntime's profiler (a
    fresh process each), kernel time by part of the step and the top ops."""
    lines = []
    work = Path(tempfile.mkdtemp(prefix="onnxtrain-llm-profile-"))
    try:
        for key in keys:
            spec = spec_of(key, quick)
            files = prepare(key, spec, work)
            r = run_worker(key, "profile", key, quick, files, work, dict(os.environ))
            kernel = r["kernel_us_per_run"]
            lines += [f"**{key}** ({spec['title']}): run {r['run_us_median'] / 1e3:.0f} ms, kernels "
                      f"{kernel / 1e3:.0f} ms over {r['nodes']} nodes (median of {r['runs']} profiled steps "
                      f"after one; load average {os.getloadavg()[0]:.2f})", "",
                      "| part of the step | ms | share |", "|---|---|---|"]
            lines += [f"| {part} | {us / 1e3:.1f} | {100 * us / kernel:.0f}% |" for part, us in r["parts"]]
            lines += ["", "| op | nodes | ms | share |", "|---|---|---|---|"]
            lines += [f"| {o['op']} | {o['count']} | {o['us'] / 1e3:.1f} | {100 * o['share']:.0f}% |"
                      for o in r["ops"][:10]]
            lines.append("")
            print("\n".join(lines[-(len(r["parts"]) + 18):]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return lines


# ------------------------------------------------------------------ report
def table(report: dict) -> list[str]:
    rows = ["| workload | framework | median s/step | tokens/s | × peer (paired) | first step s: warm (cold) "
            "| peak RSS GiB | × peer | peak during steps GiB | trainable | first loss |",
            "|" + "---|" * 11]
    for key, w in report["workloads"].items():
        o, p, r = w["onnxtrain"], w["torch"], w["ratios"]
        cold = f" ({o['first_cold_s']:.2f})" if o.get("first_cold_s") is not None else ""
        rows.append(f"| {key} | **onnxtrain** | {o['step_s']:.3f} | {o['tokens_per_s']:.0f} | "
                    f"**{r['step']:.2f}** ({r['step_paired']:.2f}) | {o['first_s']:.2f}{cold} | "
                    f"{o['peak'] / GIB:.2f} | **{r['peak']:.2f}** | {o['train_peak'] / GIB:.2f} | "
                    f"{o['trainable']:,} | {o['losses'][0]:.6f} |")
        rows.append(f"| {key} | {w['peer']} | {p['step_s']:.3f} | {p['tokens_per_s']:.0f} | 1.00 | "
                    f"{p['first_s']:.2f} | {p['peak'] / GIB:.2f} | 1.00 | {p['train_peak'] / GIB:.2f} | "
                    f"{p['trainable']:,} | {p['losses'][0]:.6f} |")
    return rows


def section(report: dict) -> list[str]:
    lines = ["## LLM fine-tuning (L1-L4)", "",
             f"`benchmarks/llm.py`, {report['date']}; load average (1 min) {report['load_before']:.2f} before, "
             f"{report['load_after']:.2f} after. LoRA r={report['rank']}, alpha {report['alpha']:g} on "
             f"{', '.join(PROJECTIONS)} of every layer; AdamW lr {report['lr']:g}, weight decay "
             f"{report['weight_decay']:g}, betas (0.9, 0.999), eps 1e-8; {report.get('threads', 2)} threads "
             "for both frameworks, idle threads as each framework's default (onnxruntime spins, "
             "OpenMP's default for torch); every run a fresh process, the "
             "frameworks alternating run by run. *× peer*: ratio of the medians (paired: the median of "
             "the run-by-run ratios). *first step*: construction from the files on disk plus the first "
             "step, imports excluded; for onnxtrain the median over runs with a warm startup cache and, in "
             "brackets, the first run, with an empty one. *peak RSS*: the process's VmHWM, the median over runs.",
             ""]
    for key, w in report["workloads"].items():
        m, s = w["model"], w["spec"]
        lines.append(f"- **{key}**: {w['title']}. Model: hidden {m['hidden']}, {m['layers']} layers, "
                     f"{m['heads']} heads / {m['kv_heads']} KV heads, FFN {m['ffn']}, vocab {m['vocab']}; "
                     f"{s['steps']} steps per run ({s['warmup']} warm-up), {w['runs']} runs per framework, "
                     f"load average {w['load']:.2f} at the start.")
    lines += [""] + table(report) + ["", "Equal work (first losses, relative difference; L3 against fp32 "
                                         "peft, to the int4 rounding):", ""]
    lines += ["| workload | first losses | largest over the steps | tolerance | equal work |", "|---|---|---|---|---|"]
    for key, w in report["workloads"].items():
        lines.append(f"| {key} | {w['first_loss_rel_diff']:.1e} | {w['max_loss_rel_diff']:.1e} | "
                     f"{w['tolerance']:.0e} | {'yes' if w['equal_work'] else '**no**'} |")
    versions = {}
    for w in report["workloads"].values():
        versions.update(w["torch"]["versions"])
        versions.update(w["onnxtrain"]["versions"])
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) + "."]
    return lines


# ------------------------------------------------------------------ main
def this_checkout() -> None:
    """Measure this checkout's onnxtrain, here and in every worker: the peft
    environment has onnxtrain installed editable from wherever
    ``setup_peft.sh`` ran, which may be another working tree."""
    root = str(HERE.parent)
    if sys.path[1:2] != [root]:
        sys.path.insert(1, root)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root] + [p for p in paths if p])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="L1,L2,L3,L3r,L4")
    ap.add_argument("--quick", action="store_true", help="a tiny Llama, seconds (development)")
    ap.add_argument("--runs", type=int, help="fresh processes per framework (default: per workload)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--profile", action="store_true",
                    help="instead of timing: onnxruntime's profile of onnxtrain's step, by part and op")
    ap.add_argument("--threads", type=int, default=2,
                    help="intra-op threads of every framework (ONNXTRAIN_THREADS, OMP_NUM_THREADS)")
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--key", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--files", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    this_checkout()

    if args.worker:
        spec = spec_of(args.spec, args.quick)
        if args.key.endswith("-peer"):
            spec["mode"] = "lora"
        r = WORKERS[args.worker](args.key, spec, json.loads(args.files), Path(args.work))
        Path(args.result).write_text(json.dumps(r))
        return 0

    in_peft_venv(__file__)
    named = {k.upper(): k for k in WORKLOADS}
    keys = [named.get(k.strip().upper(), k.strip()) for k in args.workloads.split(",") if k.strip()]
    bad = [k for k in keys if k not in WORKLOADS]
    if bad:
        raise SystemExit(f"unknown workload(s) {bad}; choose from {', '.join(WORKLOADS)}")
    for var in ("ONNXTRAIN_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    if args.profile:
        profile_all(keys, args.quick)
        return 0
    report = run_all(keys, args.quick, args.runs, log=lambda m: print(m, file=sys.stderr, flush=True))
    report["threads"] = args.threads
    print("\n".join(section(report)))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if all(w["equal_work"] for w in report["workloads"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
