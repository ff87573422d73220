"""Regenerate tests/data/masks/masked_attention.npz: PyTorch's gradients of masked attention.

    PYTHONPATH=. python scripts/make_masked_attention_refs.py     # needs torch

Each case is one attention over q, k, v of shape [B, H, T, D] (k and v with
``kv_heads`` heads: grouped-query attention), a mask and the loss
``sum(R * attention(q, k, v))``.  The npz holds, per case ``<c>``:

- ``<c>/q``, ``<c>/k``, ``<c>/v``, ``<c>/R`` (float32 inputs);
- ``<c>/mask``: the mask the ONNX graph is fed: bool (True = may attend) or
  float (additive: 0, or -inf / the float32 minimum where masked);
- ``<c>/dq``, ``<c>/dk``, ``<c>/dv``, ``<c>/out``: PyTorch's output and
  gradients, computed in float64 by ``F.scaled_dot_product_attention`` on
  the same values (with is_causal folded into the mask, since torch takes one
  or the other), stored as float32.  The math backend is used: on a query
  row that a finite-minimum mask hides entirely, torch's CPU flash kernel
  gives a gradient T times the exact one (the softmax of that row is uniform;
  the math backend, a hand-written softmax in float64 and onnxtrain agree).

Padding: ``left`` pads the first two positions of batch row 0, ``right`` its
last two; with a causal mask, left padding leaves query rows that see no key
at all (PyTorch gives them zero output and zero gradient).  The case list and
each case's settings are in ``CASES`` below; the tests read the same table
from the npz (``<c>/spec``, a JSON string).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "masks" / "masked_attention.npz"
B, H, T, D = 2, 2, 5, 4

#: name -> graph ("torchscript": Softmax + Where(IsNaN); "attention": opset-23
#: Attention), mask ("bool", "neginf", "min": the additive fill), causal
#: ("mask": folded into the mask the graph is fed; "attr": Attention's
#: is_causal=1 with a [B, 1, 1, T] padding mask), padding side, kv_heads.
CASES = {
    "ts_neginf_left": dict(graph="torchscript", mask="neginf", causal="mask", pad="left", kv_heads=2),
    "ts_neginf_right": dict(graph="torchscript", mask="neginf", causal="mask", pad="right", kv_heads=2),
    "ts_min_left": dict(graph="torchscript", mask="min", causal="mask", pad="left", kv_heads=2),
    "ts_bool_left": dict(graph="torchscript", mask="bool", causal="mask", pad="left", kv_heads=2),
    "att_bool_left": dict(graph="attention", mask="bool", causal="mask", pad="left", kv_heads=2),
    "att_bool_left_is_causal": dict(graph="attention", mask="bool", causal="attr", pad="left", kv_heads=2),
    "att_bool_right_is_causal": dict(graph="attention", mask="bool", causal="attr", pad="right", kv_heads=2),
    "att_neginf_left": dict(graph="attention", mask="neginf", causal="mask", pad="left", kv_heads=2),
    "att_min_left": dict(graph="attention", mask="min", causal="mask", pad="left", kv_heads=2),
    "att_gqa_bool_left_is_causal": dict(graph="attention", mask="bool", causal="attr", pad="left",
                                        kv_heads=1),
}


def masks(spec: dict) -> tuple[np.ndarray, np.ndarray]:
    """(the mask the graph is fed, the full boolean mask [B, 1, T, T] torch applies)."""
    keep = np.ones((B, T), bool)
    if spec["pad"] == "left":
        keep[0, :2] = False
    else:
        keep[0, -2:] = False
    causal = np.tril(np.ones((T, T), bool))
    full = keep[:, None, None, :] & causal[None, None]
    fed_bool = keep[:, None, None, :] if spec["causal"] == "attr" else full
    if spec["mask"] == "bool":
        return fed_bool, full
    fill = -np.inf if spec["mask"] == "neginf" else np.finfo(np.float32).min
    return np.where(fed_bool, 0.0, fill).astype(np.float32), full


def main() -> None:
    rng = np.random.default_rng(7)
    arrays: dict[str, np.ndarray] = {}
    for name, spec in CASES.items():
        kvh = spec["kv_heads"]
        q = rng.standard_normal((B, H, T, D)).astype(np.float32)
        k = rng.standard_normal((B, kvh, T, D)).astype(np.float32)
        v = rng.standard_normal((B, kvh, T, D)).astype(np.float32)
        r = rng.standard_normal((B, H, T, D)).astype(np.float32)
        fed, full = masks(spec)
        if spec["mask"] == "bool":
            tmask = torch.from_numpy(full)
        else:  # the same additive values torch adds (is_causal folded in as -inf)
            add = np.broadcast_to(fed, (B, 1, T, T)).astype(np.float64)
            if spec["causal"] == "attr":
                add = add + np.where(np.tril(np.ones((T, T), bool)), 0.0, -np.inf)
            tmask = torch.from_numpy(np.ascontiguousarray(add))
        tq, tk, tv = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q, k, v))
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask, enable_gqa=kvh != H)
        (out * torch.from_numpy(r).double()).sum().backward()
        for key, val in {"q": q, "k": k, "v": v, "R": r, "mask": fed, "out": out.detach().numpy(),
                         "dq": tq.grad.numpy(), "dk": tk.grad.numpy(), "dv": tv.grad.numpy()}.items():
            val = np.asarray(val)
            arrays[f"{name}/{key}"] = val.astype(np.float32) if val.dtype == np.float64 else val
        arrays[f"{name}/spec"] = np.array(json.dumps(spec))
        assert all(np.isfinite(arrays[f"{name}/{g}"]).all() for g in ("dq", "dk", "dv")), name
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(CASES)} cases)")


if __name__ == "__main__":
    main()
