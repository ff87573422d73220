"""Gradient rules: spectral ops (DFT, STFT) and the signal generators.

Complex tensors are real tensors with a last axis of 2 (real, imaginary); a
real input has a last axis of 1.  A DFT matrix F (and its inverse G = conj(F)
/ N) is symmetric, so the adjoint of y = A x for the real inner product
sum(re * re') + sum(im * im') is

    A^H v = conj(A conj(v))

which is the op itself between two conjugations (negations of the imaginary
part).  A real input takes the real part of that; a one-sided output is
zero-padded back to the full N bins first.

The window generators and MelWeightMatrix take integer sizes (their float
arguments, MelWeightMatrix's band edges, only move the integer bin edges):
their outputs carry no gradient.
"""

from __future__ import annotations

import numpy as np

from ...core.emitter import Emitter
from ...errors import GradientError
from ..registry import VJPContext, no_grad, vjp
from ._common import constant_value, int64, scatter_add_axis

Axis = int | str  # a static axis, or a runtime 1-element int64 tensor (non-negative)


def _conj(ctx: VJPContext, z: str) -> str:
    """The complex conjugate of z (last axis: real, imaginary)."""
    return ctx.emit.Mul(z, ctx.const(np.array([1.0, -1.0]), like=z))


def _length(e: Emitter, t: str, axis: Axis) -> str:
    """t's length along ``axis`` (a 1-element int64 tensor)."""
    if isinstance(axis, int):
        return e.dim(t, axis)
    return e.Gather(e.Shape(t), axis, axis=0)


def _fit(e: Emitter, t: str, target: str, axis: Axis, rank: int) -> str:
    """t cut to, or zero-padded at the end to, ``target`` entries along ``axis``
    (target: a 1-element int64 tensor).  The adjoint of a cut is a zero-pad
    and vice versa, so fitting back to the original length is the adjoint."""
    axes = e.ints([axis]) if isinstance(axis, int) else axis
    cut = e.Slice(t, e.ints([0]), target, axes)
    missing = e.Max(e.Sub(target, _length(e, t, axis)), e.ints([0]))
    if isinstance(axis, int):
        pads = e.Concat(e.ints([0] * (rank + axis)), missing, e.ints([0] * (rank - axis - 1)), axis=0)
        return e.Pad(cut, pads)
    # a runtime axis: Pad's axes input (opset >= 18; a runtime axis means opset >= 20)
    return e.Pad(cut, e.Concat(e.ints([0]), missing, axis=0), None, axis)


def _along(e: Emitter, v: str, axis: Axis, rank: int) -> str:
    """A 1-D tensor shaped to broadcast along ``axis`` of a rank-``rank`` tensor."""
    if isinstance(axis, int):
        return e.reshape(v, [1] * axis + [-1] + [1] * (rank - axis - 1))
    ones = e.ints([1] * rank)
    shape = e.ScatterElements(ones, axis, e.Shape(v), axis=0)
    return e.Reshape(v, shape)


def _like_input(e: Emitter, z: str, x: str) -> str:
    """A complex gradient z brought to x's last axis: the real part for a real x."""
    return e.Slice(z, e.ints([0]), e.shape_of(x, -1), e.ints([-1]))


def _dft_axis(ctx: VJPContext, rank: int) -> Axis:
    """The transform axis: static (attribute, or a constant input), or the
    runtime axis input made non-negative."""
    e = ctx.emit
    if ctx.opset < 20:
        return int(ctx.attr("axis", 1)) % rank
    name = ctx.input(2)
    if name is None:
        return -2 % rank
    value = constant_value(ctx, name)
    if value is not None:
        return int(value.reshape(-1)[0]) % rank
    a = int64(e, e.reshape(name, [1]))
    return e.Where(e.Less(a, e.ints([0])), e.Add(a, e.ints([rank])), a)


@vjp("DFT")
def dft_vjp(ctx, dy):
    """y = A fit(x, N) along axis, A = F (DFT), G (inverse, G = conj(F) / N) or the
    first K = N // 2 + 1 rows of F (onesided); fit cuts or zero-pads x to
    N = dft_length
    ->  dx = fit^T(A^H dy), A^H dy = conj(A conj(dy)) with the one-sided dy
        zero-padded to N bins; the real part for a real x

    inverse and onesided (a one-sided spectrum X to a real signal of length N):
    y = Re(G H(X)), H the Hermitian extension, so
        dX[k] = c_k / N * F(dy)[k] for k < K, c_k = 1 at k = 0 and k = N / 2, else 2
    (the first K bins of the input are used; more are ignored, fewer are
    zero-padded, as numpy's irfft and onnx.reference do; onnxruntime 1.31
    agrees only when the input has exactly K bins).
    The axis may be a runtime input (opset >= 20).  dft_length and axis get none."""
    x = ctx.inputs[0]
    e = ctx.emit
    if not ctx.needs(0):
        return (None,) * len(ctx.inputs)
    rank = ctx.require_rank(x)
    axis = _dft_axis(ctx, rank)
    inverse = bool(ctx.attr("inverse"))
    onesided = bool(ctx.attr("onesided"))
    length = ctx.input(1)
    n_in = _length(e, x, axis)
    rest = (None,) * (len(ctx.inputs) - 1)
    if inverse and onesided:
        n = _length(e, ctx.outputs[0], axis)  # the real signal's length N
        spectrum = e.dft(dy, axis, onesided=True)  # F(dy), first K bins
        k = e.arange(_length(e, spectrum, axis))
        single = e.Or(e.Equal(k, e.ints([0])), e.Equal(e.Mul(k, e.ints([2])), n))
        weight = e.Div(
            e.Where(single, ctx.const(1.0, like=dy), ctx.const(2.0, like=dy)), e.Cast(n, to=ctx.dtype(dy))
        )
        dx = _fit(e, e.Mul(spectrum, _along(e, weight, axis, rank)), n_in, axis, rank)
        return (_like_input(e, dx, x),) + rest
    g = dy
    if onesided:
        n = int64(e, e.reshape(length, [1])) if length is not None else n_in
        g = _fit(e, g, n, axis, rank)
    full = _conj(ctx, e.dft(_conj(ctx, g), axis, inverse=inverse))
    if length is not None:
        full = _fit(e, full, n_in, axis, rank)
    return (_like_input(e, full, x),) + rest


@vjp("STFT")
def stft_vjp(ctx, dy):
    """y[b, f, k] = sum_n w[n] s[b, f * step + n] e^(-2 pi i k n / L)   (k < L // 2 + 1
    when onesided), i.e. the DFT of the windowed frames
    ->  g = conj(F conj(dy)) per frame (dy zero-padded to L bins when onesided),
        dsignal = the overlap-add (scatter-add) of w * g over the frames,
        dwindow[n] = sum_{b, f} <g[b, f, n], s[b, f * step + n]>
    (real parts only for a real signal); frame_step and frame_length get none."""
    e = ctx.emit
    signal, step = ctx.inputs[0], ctx.inputs[1]
    window, frame_length = ctx.input(2), ctx.input(3)
    need_w = window is not None and ctx.needs(2)
    if not (ctx.needs(0) or need_w):
        return (None,) * len(ctx.inputs)
    if frame_length is not None:
        length = int64(e, e.reshape(frame_length, [1]))
    elif window is not None:
        length = e.Shape(window)
    else:
        raise GradientError(
            f"gradient of STFT node {ctx.node.name!r}: needs a window or a frame_length"
        )
    frames = e.dim(ctx.outputs[0], 1)
    starts = e.Mul(e.unsqueeze(e.arange(frames), [1]), int64(e, e.reshape(step, [1, 1])))
    positions = e.Add(starts, e.unsqueeze(e.arange(length), [0]))  # [F, L]
    g = dy
    if int(ctx.attr("onesided")):
        g = _fit(e, g, length, 2, 4)
    g = _like_input(e, _conj(ctx, e.dft(_conj(ctx, g), 2)), signal)  # [B, F, L, c]
    dsignal = dwindow = None
    if ctx.needs(0):
        weighted = g if window is None else e.Mul(g, e.reshape(window, [1, 1, -1, 1]))
        flat = e.Reshape(weighted, e.Concat(e.dim(g, 0), e.ints([-1]), e.dim(g, 3), axis=0))
        dsignal = scatter_add_axis(
            ctx, flat, e.reshape(positions, [-1]), e.dim(signal, 1), 1, 3, e.Shape(signal)
        )
    if need_w:
        pieces = e.Gather(signal, positions, axis=1)  # [B, F, L, c]
        dwindow = e.reduce_sum(e.Mul(g, pieces), [0, 1, 3], keepdims=False)
    return (dsignal, None, dwindow, None)[: len(ctx.inputs)]


no_grad("HannWindow", "HammingWindow", "BlackmanWindow", "MelWeightMatrix")
