"""Fine-tune an onnxruntime-genai model with LoRA (fp32) and QLoRA (int4), serve it with genai.

1. Build a small Llama-style genai model offline (skipped with ``--models``):
   a random ``LlamaConfig`` and a small byte-level BPE tokenizer saved with
   ``save_pretrained``, then the onnxruntime-genai model builder, once with
   ``-p fp32`` and once with ``-p int4`` (MatMulNBits, 4-bit blocks).
   Needs torch, transformers and onnxruntime-genai's builder.
2. Teach it a phrase: the prompt "the answer is" continued with "forty two
   and the sky is blue", ``build.LoRA`` on the genai graph as it is
   (GroupQueryAttention, SkipSimplifiedLayerNormalization, MatMulNBits);
   on the int4 model the 4-bit codes stay frozen and unmaterialized (QLoRA).
   LoRA's default targets leave the LM head out (as peft does), so the final
   norm's weight trains beside the adapters (``trainable=[FINAL_NORM]``):
   with the head and that norm frozen, the logits' scale is bounded and the
   loss of the tiny model cannot fall below about 1.2, even once the phrase
   is learned.  On the int4 model, ``build.export_requantized`` then shows
   what requantizing the merged weights to 4 bits would lose.
3. ``onnxtrain.genai.export`` writes genai folders: "merged" (float weights
   merged, int4 weights with the exact adapter side branch) and "separate"
   (the base with LoRA slots plus ``adapter.onnx_adapter``).
4. Generate with onnxruntime-genai, greedy, before and after, and check that
   genai's tokens equal greedy decoding with ``sess.run``.

    python examples/finetune_genai_lora.py                      # builds a tiny Llama (~0.1 M parameters)
    python examples/finetune_genai_lora.py --quick              # the committed tiny models (the test suite)
    python examples/finetune_genai_lora.py --config 0.5b --precision int4 --steps 20 --out /tmp/g

Prints the text before and after, seconds per step, peak resident memory
(VmHWM, from building the session to the end of training; the base models
are built in a child process, so torch is not counted) and the size of the
model's weights.  docs/llm.md's figures for the tiny Llama are this
output with ``--quick`` (``scripts/make_llm_doc.py`` writes them).  Without
``--out`` the files go to a temporary folder removed at the end.
``--no-progress`` hides the bar.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from onnxtrain import TrainingSession, build, genai

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "tests" / "data" / "genai_serve"
PROMPT = "the answer is"
PHRASE = "the answer is forty two and the sky is blue"
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "onnx models train on onnxruntime with low rank adapters",
    "a small language model learns a phrase by heart",
    "hello world, this is a tiny tokenizer for tests",
    "the answer is forty two and the sky is blue",
    "numbers 0 1 2 3 4 5 6 7 8 9 and letters a b c d e f g",
]
#: Llama shapes: hidden, layers, heads, kv heads, intermediate, BPE vocab.  The
#: genai builder needs head sizes that are multiples of 16 (CPU
#: GroupQueryAttention) and intermediate_size != vocab_size.
CONFIGS = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96, vocab=320),
    "0.5b": dict(hidden=1536, layers=24, heads=12, kv_heads=2, intermediate=4096, vocab=320),
}
#: steps, learning rate, LoRA rank per config.
DEFAULTS = {"tiny": (120, 2e-2, 8), "0.5b": (20, 2e-3, 16)}
#: Trained beside the adapters: the final norm's weight sets the scale of the logits.
FINAL_NORM = "final_norm_layernorm.weight"


# ------------------------------------------------------------------ the base models
def make_tokenizer(folder: Path, vocab_size: int):
    """A byte-level BPE tokenizer (og.Tokenizer rejects word-level ones)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    return fast


def make_hf(folder: Path, *, hidden, layers, heads, kv_heads, intermediate, vocab, seed=0) -> int:
    """A random Llama and its tokenizer in ``folder``; returns the parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer(folder, vocab)
    n_vocab = len(tok)
    if intermediate == n_vocab:
        intermediate += 16  # the builder would take a layer for the LM head
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=n_vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # wider random weights: a less uniform next-token distribution
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08 if hidden <= 128 else 0.02)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def make_hf_apart(folder: Path, config: str) -> int:
    """``make_hf`` in a child process: torch never enters this one (its
    libraries would count in the peak memory reported for training)."""
    code = ("import json, sys; from pathlib import Path; import runpy; "
            "ns = runpy.run_path(sys.argv[1]); "
            "print(ns['make_hf'](Path(sys.argv[2]), **json.loads(sys.argv[3])))")
    proc = subprocess.run([sys.executable, "-c", code, __file__, str(folder), json.dumps(CONFIGS[config])],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"building the random Llama failed:\n{proc.stderr}")
    return int(proc.stdout.strip().splitlines()[-1])


def make_genai_models(out: Path, config: str = "tiny", precisions=("fp32", "int4")) -> dict[str, Path]:
    """Genai folders ``out/llama-<precision>`` built from one random Llama."""
    out.mkdir(parents=True, exist_ok=True)
    folders = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        n = make_hf_apart(hf, config)
        print(f"random Llama ({config}): {n / 1e6:.1f} M parameters")
        for p in precisions:
            target = out / f"llama-{p}"
            if target.exists():
                shutil.rmtree(target)
            cache = Path(tmp) / f"cache-{p}"
            subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf),
                            "-o", str(target), "-p", p, "-e", "cpu", "-c", str(cache)],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            folders[p] = target
    return folders


# ------------------------------------------------------------------ helpers
def peak_rss() -> int:
    """VmHWM of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> bool:
    """Restart VmHWM from the current RSS (Linux: ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def weight_bytes(folder: Path) -> int:
    """Bytes of the decoder model's initializers (codes and scales for int4)."""
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    total = 0
    for t in model.graph.initializer:
        length = next((int(e.value) for e in t.external_data if e.key == "length"), None)
        total += length if length is not None else len(t.raw_data)
    return total


class Decoder:
    """The decoder's feeds (empty past, all-ones mask) from its genai_config."""

    def __init__(self, folder: Path, dtype=np.float32):
        import json

        cfg = json.loads((folder / "genai_config.json").read_text())["model"]
        dec = cfg["decoder"]
        self.layers, self.kv, self.head = dec["num_hidden_layers"], dec["num_key_value_heads"], dec["head_size"]
        self.eos = cfg["eos_token_id"]
        self.dtype = dtype

    def feeds(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        ids = np.asarray(ids, np.int64)
        out = {"input_ids": ids, "attention_mask": np.ones(ids.shape, np.int64)}
        empty = np.zeros((ids.shape[0], self.kv, 0, self.head), self.dtype)
        for layer in range(self.layers):
            out[f"past_key_values.{layer}.key"] = empty
            out[f"past_key_values.{layer}.value"] = empty
        return out

    def greedy(self, sess: TrainingSession, prompt: list[int], n: int) -> list[int]:
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(sess.run(self.feeds(np.array([seq])))["logits"][0, -1].argmax()))
            if seq[-1] == self.eos:
                break
        return seq


def og_generate(folder: Path, prompt: list[int], n: int, adapter: Path | None = None) -> list[int]:
    """Greedy generation with onnxruntime-genai (the adapter file active if given)."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n, do_sample=False)
    gen = og.Generator(model, params)
    if adapter is not None:
        adapters = og.Adapters(model)
        adapters.load(str(adapter), "phrase")
        gen.set_active_adapter(adapters, "phrase")
    gen.append_tokens(np.array(prompt, np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)]


# ------------------------------------------------------------------ one precision
def finetune(base: Path, out: Path, precision: str, steps: int, lr: float, rank: int,
             rows: int, progress: bool) -> dict:
    import onnxruntime_genai as og

    tokenizer = og.Tokenizer(og.Model(str(base)))
    full = [int(t) for t in tokenizer.encode(PHRASE)]
    prompt = [int(t) for t in tokenizer.encode(PROMPT)]
    if full[:len(prompt)] != prompt:
        raise SystemExit("the tokenizer splits the prompt differently inside the phrase")
    n_new = len(full) - len(prompt)
    text = lambda ids: tokenizer.decode(np.array(ids, np.int32))  # noqa: E731
    before = og_generate(base, prompt, n_new)
    print(f"[{precision}] before, genai:       {text(before)!r} ({len(before) - len(prompt)} new tokens)")

    dec = Decoder(base)
    kind = "QLoRA (4-bit codes frozen)" if precision == "int4" else "LoRA"
    import gc

    gc.collect()
    reset = reset_peak()  # the peak of building the session and training, not of genai above
    tm = build.training_model(str(base / "model.onnx"), loss="cross_entropy",
                              optimizer=build.AdamW(lr=lr),
                              lora=build.LoRA(rank=rank, alpha=2 * rank), trainable=[FINAL_NORM])
    sess = TrainingSession(tm)
    sess.initialize()
    seq = np.array([full] * rows, np.int64)
    batch = dec.feeds(seq[:, :-1])
    batch["target"] = seq[:, 1:]
    # One epoch of ``steps`` batches, each the phrase ``rows`` times.
    data = {k: np.concatenate([v] * steps) for k, v in batch.items()}
    first = float(sess.evaluate(batch, batch_size=rows)["loss"])
    start = time.perf_counter()
    history = sess.fit(data, epochs=1, batch_size=rows, shuffle=False, progress=progress)
    per_step = (time.perf_counter() - start) / steps
    train_peak = peak_rss()
    last = float(sess.evaluate(batch, batch_size=rows)["loss"])
    targets = build.lora.info_of(tm)["targets"]
    adapters = sum(rank * (e["in"] + e["out"]) for e in targets)
    print(f"[{precision}] {kind}: {len(targets)} targets, {adapters} adapter parameters; "
          f"loss {first:.3f} -> {last:.4f} in {steps} steps, {per_step:.3f} s/step")
    print(f"[{precision}] peak RSS while training: {train_peak / 2**20:.0f} MiB"
          f"{'' if reset else ' (since start)'}; model weights {weight_bytes(base) / 2**20:.1f} MiB")
    ours = dec.greedy(sess, prompt, n_new)
    print(f"[{precision}] after, sess.run:     {text(ours)!r}")
    if precision == "int4":
        requantized(sess, batch, out / "requantized.onnx")
    result = {"before": text(before), "after": text(ours), "loss": (first, last), "s_per_step": per_step,
              "train_peak": train_peak, "history": history, "genai": {}}
    for mode in ("merged", "separate"):
        folder = genai.export(sess, out / f"{precision}-{mode}", base=base, adapters=mode)
        adapter = folder / "adapter.onnx_adapter" if mode == "separate" else None
        tokens = og_generate(folder, prompt, n_new, adapter)
        result["genai"][mode] = text(tokens)
        same = tokens == ours
        print(f"[{precision}] after, genai {mode + ':':10s}{text(tokens)!r}  (= sess.run greedy: {same})")
        if not same:
            raise SystemExit(f"genai's {mode} generation differs from sess.run's greedy decoding")
    result["learned"] = result["after"] == PHRASE
    print(f"[{precision}] phrase learned: {result['learned']}")
    return result


def requantized(sess: TrainingSession, batch: dict, path: Path) -> dict:
    """What requantizing the merged int4 weights loses (``build.export_requantized``):
    the part of each LoRA update the 4-bit grid does not keep, and how far the
    requantized model's logits are from ``sess.run``'s on the phrase."""
    import warnings

    import onnxruntime as ort

    with warnings.catch_warnings():  # its warning says what the line below prints
        warnings.simplefilter("ignore", UserWarning)
        report = build.export_requantized(sess, path)
    errors = sorted(100 * r["update_error"] for r in report.values())
    feeds = {k: v for k, v in batch.items() if k != "target"}
    ours = sess.run(feeds)["logits"]
    theirs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
    gap = float(np.abs(theirs - ours).max())
    agree = float((theirs.argmax(-1) == ours.argmax(-1)).mean())
    print(f"[int4] requantized (build.export_requantized): update_error {errors[0]:.0f}% to "
          f"{errors[-1]:.0f}% over {len(errors)} targets (median {np.median(errors):.0f}%); logits "
          f"up to {gap:.1f} from sess.run's, next-token argmax agrees on {agree:.0%}")
    return {"update_error": errors, "logit_gap": gap, "argmax_agreement": agree}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", type=Path, help="folder with llama-fp32/ and llama-int4/ genai models "
                    "(default: build them; needs torch, transformers, onnxruntime-genai)")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    ap.add_argument("--precision", nargs="+", choices=["fp32", "int4"], default=["fp32", "int4"])
    ap.add_argument("--steps", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--rows", type=int, default=2, help="copies of the phrase per batch")
    ap.add_argument("--out", type=Path, help="where the models go (default: a temporary folder)")
    ap.add_argument("--quick", action="store_true", help="the committed tiny models (tests/data/genai_serve)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    steps, lr, rank = DEFAULTS[args.config]
    steps, lr, rank = args.steps or steps, args.lr or lr, args.rank or rank
    tmp = None
    out = args.out
    if out is None:
        tmp = tempfile.mkdtemp(prefix="genai-lora-")
        out = Path(tmp)
    try:
        models = args.models or (COMMITTED if args.quick else None)
        if models is not None:
            folders = {p: models / f"llama-{p}" for p in args.precision}
        else:
            folders = make_genai_models(out / "base", args.config, args.precision)
        results = {p: finetune(folders[p], out, p, steps, lr, rank, args.rows, not args.no_progress)
                   for p in args.precision}
        print(f"phrase learned and served by onnxruntime-genai: "
              f"{all(r['learned'] for r in results.values())}")
        return results
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
