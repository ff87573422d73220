"""Sliding-window geometry shared by the convolution and pooling rules.

``Window`` reads strides, dilations, pads and auto_pad and resolves the pads
statically where the spatial dims are known and at run time otherwise.  The
gradients of sliding-window ops are again sliding-window ops: the transpose of
a window sum is a ConvTranspose, and the weight gradient of a convolution is a
convolution of the input with the output gradient acting as the kernel."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from onnx import TensorProto

from ...core.emitter import np_dtype
from ...errors import TrainingModelError
from ..registry import VJPContext

Pads = list[int] | str  # static ints, or a runtime int64 tensor with one entry per spatial axis


# ----------------------------------------------------------- window geometry
class Window:
    """Geometry of a sliding-window op along its k spatial axes.

    ``begin``/``end`` are the pads, static ints where they can be known when
    building and runtime int64 vectors otherwise (auto_pad SAME over dynamic
    spatial dims).  ``in_dims``/``out_dims`` are the static spatial dims of the
    op's input and output (None where unknown); ``kernel`` the static kernel
    dims (None where unknown, then read at run time from ``weight``)."""

    def __init__(
        self,
        ctx: VJPContext,
        x: str,
        y: str,
        k: int,
        kernel: Sequence[int | None],
        weight: str | None = None,
        has_dilations: bool = True,
        pads: tuple[Pads, Pads] | None = None,
    ) -> None:
        self.ctx = ctx
        self.x, self.y, self.k = x, y, k
        self.strides = [int(v) for v in ctx.attr("strides", [1] * k)]
        self.dilations = (
            [int(v) for v in ctx.attr("dilations", [1] * k)] if has_dilations else [1] * k
        )
        self.kernel = list(kernel)
        self._weight = weight
        self.in_dims = self._spatial(x)
        # ONNX shape inference does not drop ceil_mode windows that start in
        # the end padding, the runtime does: do not trust static output dims there.
        self.out_dims = [None] * k if ctx.attr("ceil_mode", 0) else self._spatial(y)
        self.auto_pad = ctx.attr("auto_pad", "NOTSET")
        self.begin, self.end = pads if pads is not None else self._pads()

    def _spatial(self, name: str) -> list[int | None]:
        s = self.ctx.shape(name)
        if s is None or len(s) != self.k + 2:
            return [None] * self.k
        return [d if isinstance(d, int) else None for d in s[2:]]

    @property
    def static_kernel(self) -> bool:
        return all(isinstance(d, int) for d in self.kernel)

    @property
    def static_pads(self) -> bool:
        return not isinstance(self.begin, str)

    def kernel_rt(self) -> str:
        """The kernel dims as a runtime int64 vector."""
        if self.static_kernel:
            return self.ctx.emit.ints(self.kernel)
        if self._weight is None:
            raise TrainingModelError(self.where("the kernel shape is unknown"))
        return self.ctx.emit.shape_of(self._weight, 2)

    def in_shape_rt(self) -> str:
        """The input's spatial dims as a runtime int64 vector."""
        return self.ctx.emit.shape_of(self.x, 2)

    def where(self, what: str) -> str:
        n = self.ctx.node
        return f"gradient of {n.op_type} node {n.name!r}: {what}"

    def _pads(self) -> tuple[Pads, Pads]:
        k = self.k
        if self.auto_pad in ("NOTSET", ""):
            pads = [int(v) for v in self.ctx.attr("pads", [0] * (2 * k))]
            return pads[:k], pads[k:]
        if self.auto_pad == "VALID":
            return [0] * k, [0] * k
        if self.auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
            raise TrainingModelError(self.where(f"unknown auto_pad {self.auto_pad!r}"))
        upper = self.auto_pad == "SAME_UPPER"
        if self.static_kernel and all(d is not None for d in self.in_dims):
            begin, end = [], []
            for d, s, dl, kk in zip(self.in_dims, self.strides, self.dilations, self.kernel):
                total = max(0, (-(-d // s) - 1) * s + (kk - 1) * dl + 1 - d)
                small, big = total // 2, total - total // 2
                begin.append(small if upper else big)
                end.append(big if upper else small)
            return begin, end
        # total = max(0, (ceil(D/s) - 1) * s + (K - 1) * dil + 1 - D), split as the spec says.
        e = self.ctx.emit
        d = self.in_shape_rt()
        s, dl = e.ints(self.strides), e.ints(self.dilations)
        one = e.ints([1])
        out = e.Div(e.Sub(e.Add(d, s), one), s)
        total = e.Sub(
            e.Add(e.Add(e.Mul(e.Sub(out, one), s), e.Mul(e.Sub(self.kernel_rt(), one), dl)), one), d
        )
        zero = e.ints([0])
        total = e.Where(e.Less(total, zero), zero, total)
        small = e.Div(total, e.ints([2]))
        big = e.Sub(total, small)
        return (small, big) if upper else (big, small)

    def require_runtime_slices(self) -> None:
        if self.ctx.opset < 10:
            raise TrainingModelError(
                self.where(
                    "the spatial dims are not all known statically, and opset "
                    f"{self.ctx.opset} < 10 has no Slice with runtime bounds"
                )
            )

    # ------------------------------------------------------ transposed window
    def scatter(self, z: str, w: str, group: int = 1) -> str:
        """The transpose of the window sum ``y[o] = sum_k w[k] x[o*s + k*dil - pb]``:
        ConvTranspose of z (laid out like y) with kernel w, cropped to x's spatial dims.

        With everything static, the crop is exact through pads/output_padding;
        otherwise the full ConvTranspose (pads 0, output_padding s-1, which is
        long enough) is sliced to [pb, pb + D)."""
        e = self.ctx.emit
        k = self.k
        exact = (
            self.static_kernel
            and self.static_pads
            and all(d is not None for d in self.in_dims + self.out_dims)
        )
        if exact:
            begin, end, outpad = [], [], []
            for i in range(k):
                full = self.strides[i] * (self.out_dims[i] - 1) + (self.kernel[i] - 1) * self.dilations[i] + 1
                crop_end = full - self.begin[i] - self.in_dims[i]
                begin.append(self.begin[i])
                end.append(max(crop_end, 0))
                outpad.append(max(-crop_end, 0))
            return e.ConvTranspose(
                z,
                w,
                strides=self.strides,
                dilations=self.dilations,
                pads=begin + end,
                output_padding=outpad if any(outpad) else None,
                group=group if group != 1 else None,
            )
        self.require_runtime_slices()
        full = e.ConvTranspose(
            z,
            w,
            strides=self.strides,
            dilations=self.dilations,
            output_padding=[s - 1 for s in self.strides] if any(s > 1 for s in self.strides) else None,
            group=group if group != 1 else None,
        )
        start_t = e.ints(self.begin) if self.static_pads else self.begin
        ends = e.Add(start_t, self.in_shape_rt())
        return e.slice(full, start_t, ends, axes=list(range(2, k + 2)))

    # --------------------------------------------------------- weight gradient
    def _patch_form(self, inp: str, group: int) -> str | None:
        """Which explicit-patch form suits this weight gradient, if any (see ``patches``)."""
        shape = self.ctx.shape(inp)
        if (
            group != 1
            or self.ctx.opset < 13
            or not (self.static_kernel and self.static_pads)
            or shape is None
            or not all(isinstance(d, int) and d > 0 for d in shape)
            or not all(isinstance(d, int) and d > 0 for d in self.in_dims + self.out_dims)
            or self.ctx.dtype(inp) not in (TensorProto.FLOAT, TensorProto.DOUBLE)
        ):
            return None
        taps = math.prod(self.kernel)
        if shape[1] * taps <= 64:
            return "conv"
        return "slices" if taps <= 49 else None

    def patches(self, inp: str, dout: str, form: str) -> str:
        """dW[m, c, k] = sum_{n,o} dout[n, m, o] * inp_padded[n, c, o*s + k*dil], with the
        patches inp_padded[n, c, o*s + k*dil] made explicit and contracted by MatMul
        (onnxruntime's Conv with the batch as channels is slow for this, 2-4x).

        ``conv`` (few channels x taps): all patches at once, a Conv with one-hot
        filters (group = C) -> [N, C*K, P]; dW = sum_n dout_n @ patches_n^T.
        ``slices`` (many channels): per tap, the strided Slice of inp_padded
        -> [N, C, P]; dW[:, :, tap] = sum_n dout_n @ slice_n^T.

        ``slices`` with a batch (N > 1): one MatMul for the whole gradient.
        The input is laid out once channel-major, [C, N, ...], so each tap's
        Slice is that tap's [C, N*P] patch matrix; stacked tap by tap they
        are the column matrix col [C*K, N*P] (row c*K + t), and with dout laid
        out once as [M, N*P], dW = dout2 @ col^T is [M, C*K], already dW's
        layout.  The sum over (n, o) is one contraction (N products [M, C]
        and a ReduceSum over them per tap cost 250 ms of a ResNet-18 step),
        and one [M, N*P] x [N*P, C*K] product runs faster than K narrow ones.
        The kernel library builds col in one pass (``fuse_layers``:
        ``Im2ColF32``), the same values, so the MatMul gives the same bits."""
        e = self.ctx.emit
        k = self.k
        n, c = self.ctx.shape(inp)[:2]
        outs = math.prod(self.out_dims)
        taps = math.prod(self.kernel)
        dy3 = e.reshape(dout, [n, -1, outs])  # [N, M, P]
        if form == "conv":
            # Filter ch * K + t picks tap t of channel ch.
            onehot = np.tile(np.eye(taps), (c, 1)).reshape(c * taps, 1, *self.kernel)
            onehot = onehot.astype(np_dtype(self.ctx.dtype(inp)))
            pads = list(self.begin) + list(self.end)
            cols = e.Conv(
                inp,
                e.const(onehot),
                strides=self.strides,
                dilations=self.dilations,
                pads=pads if any(pads) else None,
                group=c if c != 1 else None,
            )
            cols = e.Transpose(e.reshape(cols, [n, c * taps, outs]), perm=[0, 2, 1])  # [N, P, C*K]
            dw = e.reduce_sum(e.MatMul(dy3, cols), [0], keepdims=False)  # [M, C*K]
            return e.reshape(dw, [-1, c, *self.kernel])
        padded = inp
        if any(self.begin) or any(self.end):
            zeros2 = [0, 0]
            padded = e.Pad(inp, e.ints(zeros2 + list(self.begin) + zeros2 + list(self.end)))
        flat = n > 1
        if flat:
            padded = e.Transpose(padded, perm=[1, 0] + list(range(2, k + 2)))  # [C, N, ...]
        pieces = []
        for tap in np.ndindex(*self.kernel):
            starts = [t * d for t, d in zip(tap, self.dilations)]
            ends = [st + (o - 1) * s + 1 for st, o, s in zip(starts, self.out_dims, self.strides)]
            pieces.append(e.slice(padded, starts, ends, axes=list(range(2, k + 2)), steps=self.strides))
        if flat:
            stacked = e.concat([e.unsqueeze(p, [1]) for p in pieces], axis=1)  # [C, K, N, ...]
            col = e.reshape(stacked, [c * taps, n * outs])
            dy2 = e.reshape(e.Transpose(dy3, perm=[1, 0, 2]), [-1, n * outs])  # [M, N*P]
            dw = e.MatMul(dy2, e.Transpose(col, perm=[1, 0]))  # [M, C*K]
            return e.reshape(dw, [-1, c, *self.kernel])
        columns = []
        for piece in pieces:
            piece = e.Transpose(e.reshape(piece, [n, c, outs]), perm=[0, 2, 1])  # [N, P, C]
            column = e.reduce_sum(e.MatMul(dy3, piece), [0], keepdims=False)
            columns.append(e.unsqueeze(column, [2]))
        dw = e.concat(columns, axis=2) if len(columns) > 1 else columns[0]  # [M, C, K]
        return e.reshape(dw, [-1, c, *self.kernel])

    def correlate(self, inp: str, dout: str, group: int) -> str:
        """dW[m, c, k] = sum_{n,o} dout[n, m, o] * inp_padded[n, g(m)*Cg + c, o*s + k*dil]

        With static shapes and one group: explicit patches and MatMul (``patches``).
        Otherwise a Conv whose batch is inp's channels (within a group), whose
        channels are (group, batch) and whose kernel is dout with batch and
        channels swapped: strides and dilations trade places."""
        e = self.ctx.emit
        k = self.k
        form = self._patch_form(inp, group)
        if form is not None:
            return self.patches(inp, dout, form)
        if group == 1:
            xt = e.Transpose(inp, perm=[1, 0] + list(range(2, k + 2)))
        else:
            spatial = e.shape_of(inp, 2)
            split = e.Reshape(inp, e.Concat(e.shape_of(inp, 0, 1), e.ints([group, -1]), spatial, axis=0))
            moved = e.Transpose(split, perm=[2, 1, 0] + list(range(3, k + 3)))
            xt = e.Reshape(moved, e.Concat(e.ints([0, -1]), spatial, axis=0))
        dt = e.Transpose(dout, perm=[1, 0] + list(range(2, k + 2)))
        if self.static_pads:
            r = e.Conv(
                xt,
                dt,
                strides=self.dilations,
                dilations=self.strides,
                pads=list(self.begin) + list(self.end) if any(self.begin) or any(self.end) else None,
                group=group if group != 1 else None,
            )
        else:
            if e.opset < 11:
                raise TrainingModelError(self.where(f"runtime pads need opset >= 11, model has {e.opset}"))
            zeros2 = e.ints([0, 0])
            pads = e.Concat(zeros2, self.begin, zeros2, self.end, axis=0)
            r = e.Conv(
                e.Pad(xt, pads),
                dt,
                strides=self.dilations,
                dilations=self.strides,
                group=group if group != 1 else None,
            )
        # The result may be longer than the kernel when the forward op left
        # trailing input unused (r >= dil); keep the first K.
        exact = self.static_kernel and self.static_pads and all(
            d is not None for d in self.in_dims + self.out_dims
        )
        if exact:
            longer = False
            for i in range(k):
                span = self.in_dims[i] + self.begin[i] + self.end[i]
                got = (span - self.strides[i] * (self.out_dims[i] - 1) - 1) // self.dilations[i] + 1
                longer = longer or got != self.kernel[i]
            if longer:
                r = e.slice(r, [0] * k, self.kernel, axes=list(range(2, k + 2)))
        else:
            self.require_runtime_slices()
            r = e.slice(r, e.ints([0] * k), self.kernel_rt(), axes=list(range(2, k + 2)))
        return e.Transpose(r, perm=[1, 0] + list(range(2, k + 2)))


def spatial_rank(ctx: VJPContext, *names: str) -> int:
    """Number of spatial axes: from kernel_shape, else from a known rank."""
    ks = ctx.attr("kernel_shape")
    if ks is not None:
        return len(ks)
    for n in names:
        r = ctx.rank(n)
        if r is not None:
            return r - 2
    raise TrainingModelError(
        f"gradient of {ctx.node.op_type} node {ctx.node.name!r} needs the number of "
        "spatial axes: give kernel_shape or inputs of known rank"
    )


def kernel_dims(ctx: VJPContext, w: str, k: int) -> list[int | None]:
    ks = ctx.attr("kernel_shape")
    if ks is not None:
        return [int(v) for v in ks]
    s = ctx.shape(w)
    if s is not None and len(s) == k + 2:
        return [d if isinstance(d, int) else None for d in s[2:]]
    return [None] * k
