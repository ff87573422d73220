"""LoRA fine-tuning of a decoder-only transformer language model stored with external data.

1. Write a GPT-style language model (``decoder_lm.py``: token and position
   embeddings, pre-norm blocks of causal self-attention and a GELU MLP, final
   norm, LM head; random seeded weights) as ``.onnx`` + ``.onnx.data``, the
   weights streamed to disk tensor by tensor, page-aligned.
2. Make a LoRA training model of it: ``build.training_model(path,
   loss="cross_entropy", lora=build.LoRA(rank=8, alpha=16, targets=lambda name: True))``
   (every eligible weight; ``targets=None`` would leave the LM head out).  The base
   weights stay frozen; only the adapters of every projection (attention
   q, k, v, o, the MLP and the LM head) train, with AdamW.
3. ``sess.fit`` on a synthetic next-token task: every sequence is a window of
   one fixed repeating pattern of tokens, so the next token is a function of
   the current one and the loss drops quickly.
4. ``sess.export(path)``: the merged model (``W + (alpha/r)·A·B``, the original
   graph), loaded in plain onnxruntime, gives the logits ``sess.run`` gives.

Prints the loss before and after, seconds per step, and peak resident memory
(VmHWM).

    python examples/finetune_large_lora.py                    # small config (~4 M parameters)
    python examples/finetune_large_lora.py --quick            # fewer steps (the test suite)
    python examples/finetune_large_lora.py --config 1b --steps 20 --out /tmp/lm1b   # 1.14 B parameters
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from decoder_lm import CONFIGS, write_decoder_lm

from onnxtrain import Callback, TrainingSession, build
from onnxtrain.build import lora as lora_lib

#: Per config: steps, batch, sequence length, learning rate.
DEFAULTS = {"small": (60, 8, 32, 3e-3), "1b": (30, 1, 64, 1e-3)}


def peak_rss() -> int:
    """VmHWM of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def pattern_data(vocab: int, rows: int, seq: int, period: int, seed: int = 0, draw: int = 0):
    """(input_ids, labels), both [rows, seq] int64: windows of one repeating pattern.

    The pattern is ``period`` distinct tokens chosen by ``seed``; the windows'
    start positions are drawn with ``draw``.  Labels are the inputs shifted by
    one (next-token prediction)."""
    pattern = np.random.default_rng(seed).choice(vocab, size=period, replace=False)
    starts = np.random.default_rng([seed, draw]).integers(0, period, rows)
    idx = (starts[:, None] + np.arange(seq + 1)[None, :]) % period
    tokens = pattern[idx].astype(np.int64)
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()


def next_token_loss(logits: np.ndarray, labels: np.ndarray) -> float:
    """Mean cross-entropy of logits [B, T, V] against labels [B, T], in float64."""
    z = logits.astype(np.float64)
    z -= z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, labels[..., None], -1).mean())


class StepTimer(Callback):
    """Wall time of every training step."""

    def __init__(self):
        super().__init__()
        self.times: list[float] = []
        self._t = 0.0

    def on_batch_begin(self, batch, logs=None):
        self._t = time.perf_counter()

    def on_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._t)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: per config)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--out", default=None,
                        help="folder for the base model, the merged export and the adapters "
                             "(default: a temporary folder, removed at the end)")
    parser.add_argument("--quick", action="store_true", help="small config, 25 steps")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.config = "small"
        args.steps = args.steps or 25
    steps, batch, seq, lr = DEFAULTS[args.config]
    steps = args.steps or steps
    batch = args.batch or batch
    seq = args.seq or seq
    lr = args.lr or lr
    cfg = CONFIGS[args.config]
    if seq > cfg.max_seq:
        parser.error(f"--seq {seq} is longer than the model's {cfg.max_seq} positions")

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="finetune_lora_"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        return run(cfg, args, out, steps, batch, seq, lr)
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)


def run(cfg, args, out: Path, steps: int, batch: int, seq: int, lr: float) -> int:
    # 1. the base model
    info = write_decoder_lm(out / f"decoder_lm_{args.config}.onnx", cfg)
    print(f"base model: {cfg.parameters / 1e6:.1f} M parameters ({cfg.layers} layers, d_model "
          f"{cfg.d_model}, {cfg.heads} heads, ffn {cfg.ffn}, vocab {cfg.vocab}), "
          f"{gib(info['data_bytes'])} of weights written in {info['seconds']:.1f} s")

    # 2. the LoRA training model
    t0 = time.perf_counter()
    tm = build.training_model(info["path"], loss="cross_entropy", target="labels",
                              optimizer=build.AdamW(lr=lr, weight_decay=0.0),
                              # every projection, the LM head included (targets=None
                              # leaves a language model's head out, as peft does)
                              lora=build.LoRA(rank=args.rank, alpha=args.alpha,
                                              targets=lambda name: True))
    sess = TrainingSession(tm)
    del tm
    adapters = {k: v.size for k, v in sess.state.items() if k.endswith((".lora_A", ".lora_B"))}
    print(f"LoRA r={args.rank} alpha={args.alpha:g}: {len(adapters) // 2} target weights, "
          f"{sum(adapters.values()) / 1e3:.1f} k trainable parameters "
          f"({sum(adapters.values()) / cfg.parameters:.3%} of the model); "
          f"session ready in {time.perf_counter() - t0:.1f} s")

    # 3. fine-tune on the repeating pattern
    x, y = pattern_data(cfg.vocab, steps * batch, seq, period=16, seed=1, draw=0)
    x_eval, y_eval = pattern_data(cfg.vocab, batch, seq, period=16, seed=1, draw=1)
    # sess.run (the inference program, also used for the export check below) rather
    # than sess.evaluate, so that no third onnxruntime program holds the weights
    before = next_token_loss(sess.run({"input_ids": x_eval})["logits"], y_eval)
    timer = StepTimer()
    history = sess.fit(x, y, epochs=1, batch_size=batch, shuffle=False, callbacks=[timer],
                       progress=not args.no_progress)
    expected = sess.run({"input_ids": x_eval})["logits"]
    after = next_token_loss(expected, y_eval)
    step_times = timer.times[1:] or timer.times  # the first step includes warm-up
    train_peak = peak_rss()
    print(f"trained {len(timer.times)} steps of {batch} x {seq} tokens: "
          f"{np.median(step_times):.3f} s/step (median after the first; first step "
          f"{timer.times[0]:.2f} s); mean training loss {history['loss'][-1]:.4f}")
    print(f"loss on the pattern: {before:.4f} before -> {after:.4f} after "
          f"(chance: ln {cfg.vocab} = {math.log(cfg.vocab):.2f})")
    dropped = after < 0.5 * before
    print(f"loss dropped: {dropped}")

    # 4. the merged export in plain onnxruntime
    merged = out / f"decoder_lm_{args.config}_merged.onnx"
    t0 = time.perf_counter()
    sess.export(merged)
    lora_lib.save_adapters(sess, out / "adapters.npz")
    ops = lambda p: [n.op_type for n in onnx.load(p, load_external_data=False).graph.node]  # noqa: E731
    same_graph = ops(merged) == ops(info["path"])
    print(f"merged export in {time.perf_counter() - t0:.1f} s: {merged.name}, the base model's "
          f"{len(ops(merged))} nodes: {same_graph}; adapters alone "
          f"{(out / 'adapters.npz').stat().st_size / 2**20:.2f} MiB")
    del sess
    plain = ort.InferenceSession(str(merged), providers=["CPUExecutionProvider"])
    got = plain.run(["logits"], {"input_ids": x_eval})[0]
    del plain
    diff = float(np.abs(got - expected).max())
    matches = bool(np.allclose(got, expected, rtol=1e-3, atol=1e-3))
    print(f"merged model in plain onnxruntime matches sess.run: {matches} "
          f"(max |logit difference| {diff:.2e})")
    print(f"peak RSS: {gib(train_peak)} after training, {gib(peak_rss())} overall "
          f"(weights: {gib(4 * cfg.parameters)})")
    return 0 if dropped and matches and same_graph else 1


if __name__ == "__main__":
    raise SystemExit(main())
