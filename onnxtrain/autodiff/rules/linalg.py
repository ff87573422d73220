"""Gradient rules: matrix products (MatMul, Gemm, Einsum).

Batched products broadcast their batch dimensions; ``ctx.unbroadcast`` sums a
gradient back to an operand's shape, deciding statically where the shapes allow
it and at run time otherwise, so symbolic batch dimensions work."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...errors import TrainingModelError
from ..registry import Dim, VJPContext, vjp
from ._common import dims_of


# ----------------------------------------------------------------- helpers
def _swap_last(ctx: VJPContext, x: str, rank: int) -> str:
    """Transpose the last two axes."""
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    return ctx.emit.Transpose(x, perm=perm)


def _gemm(ctx: VJPContext, a: str, b: str, trans_a: int, trans_b: int, alpha: float) -> str:
    """alpha * op(a) @ op(b) as one Gemm without C."""
    return ctx.emit.gemm(
        a,
        b,
        transA=trans_a or None,
        transB=trans_b or None,
        alpha=None if alpha == 1.0 else float(alpha),
    )


# -------------------------------------------------------------------- MatMul
@vjp("MatMul")
def matmul_vjp(ctx, dy):
    """y = a @ b (numpy semantics: 1-D operands, broadcast batch dims)
    ->  da = sum_batch(dy @ b^T), db = sum_batch(a^T @ dy)

    A 1-D a is a row (1, k) and a 1-D b a column (k, 1) whose added axis is
    absent from y; dy gets that axis back before the products.  2-D operands
    use one Gemm per gradient."""
    e = ctx.emit
    a, b = ctx.inputs
    ra, rb = ctx.require_rank(a), ctx.require_rank(b)
    want_a, want_b = ctx.needs(0), ctx.needs(1)

    if ra == 1 and rb == 1:  # dot product: y is a scalar
        return (
            e.Mul(dy, b) if want_a else None,
            e.Mul(dy, a) if want_b else None,
        )
    if ra == 2 and rb == 2:
        return (
            _gemm(ctx, dy, b, 0, 1, 1.0) if want_a else None,
            _gemm(ctx, a, dy, 1, 0, 1.0) if want_b else None,
        )

    if rb == 2 and ra > 2 and e.opset >= 5:
        # A batch of rows times one weight matrix (a dense layer on a sequence):
        # flatten the batch into the rows, so that each gradient is one Gemm
        # rather than a batched MatMul followed by a ReduceSum over the batch.
        rows = lambda t: e.Reshape(t, e.concat([e.ints([-1]), e.dim(t, -1)]))  # noqa: E731
        dy_rows = rows(dy)
        da = db = None
        if want_a:
            da = e.Reshape(_gemm(ctx, dy_rows, b, 0, 1, 1.0), e.Shape(a))
        if want_b:
            db = _gemm(ctx, rows(a), dy_rows, 1, 0, 1.0)
        return da, db

    # Bring everything to rank >= 2 with a matrix core.
    a2 = e.unsqueeze(a, [0]) if ra == 1 else a
    b2 = e.unsqueeze(b, [1]) if rb == 1 else b
    ra2, rb2 = max(ra, 2), max(rb, 2)
    r = max(ra2, rb2)
    if ra == 1:
        dy2 = e.unsqueeze(dy, [r - 2])
    elif rb == 1:
        dy2 = e.unsqueeze(dy, [r - 1])
    else:
        dy2 = dy
    # The broadcast batch dims, from the operands' static dims.
    batch = _broadcast_dims(
        [dims_of(ctx, a, ra)[: ra2 - 2], dims_of(ctx, b, rb)[: rb2 - 2]], r - 2
    )

    da = db = None
    if want_a:
        g = e.MatMul(dy2, _swap_last(ctx, b2, rb2))
        a_dims = (1,) + dims_of(ctx, a, 1) if ra == 1 else dims_of(ctx, a, ra)
        # runtime_from=10: MatMul keeps its opset-9 refusal (pinned by a test)
        g = ctx.unbroadcast(g, a2, out_dims=batch + a_dims[-2:], like_dims=a_dims, runtime_from=10)
        da = e.squeeze(g, [0]) if ra == 1 else g
    if want_b:
        g = e.MatMul(_swap_last(ctx, a2, ra2), dy2)
        b_dims = dims_of(ctx, b, 1) + (1,) if rb == 1 else dims_of(ctx, b, rb)
        g = ctx.unbroadcast(g, b2, out_dims=batch + b_dims[-2:], like_dims=b_dims, runtime_from=10)
        db = e.squeeze(g, [1]) if rb == 1 else g
    return da, db


# ---------------------------------------------------------------------- Gemm
@vjp("Gemm")
def gemm_vjp(ctx, dy):
    """y = alpha * op(A) @ op(B) + beta * C,  op = transpose when transA/transB
    ->  dA = alpha * dy @ op(B)^T   (transposed back when transA)
        dB = alpha * op(A)^T @ dy   (transposed back when transB)
        dC = beta * sum_broadcast(dy)

    Each of dA and dB is a single Gemm with the transposes as attributes:
    transA=0: dA = Gemm(dy, B, transB=1-transB); transA=1: dA = Gemm(B, dy,
    transA=transB, transB=1); transB=0: dB = Gemm(A, dy, transA=1-transA);
    transB=1: dB = Gemm(dy, A, transA=1, transB=transA)."""
    e = ctx.emit
    a, b = ctx.inputs[0], ctx.inputs[1]
    c = ctx.input(2)
    ta, tb = int(ctx.attr("transA")), int(ctx.attr("transB"))
    alpha, beta = float(ctx.attr("alpha")), float(ctx.attr("beta"))

    da = db = dc = None
    if ctx.needs(0):
        da = _gemm(ctx, dy, b, 0, 1 - tb, alpha) if not ta else _gemm(ctx, b, dy, tb, 1, alpha)
    if ctx.needs(1):
        db = _gemm(ctx, a, dy, 1 - ta, 0, alpha) if not tb else _gemm(ctx, dy, a, 1, ta, alpha)
    if c is not None and ctx.needs(2):
        rc = ctx.require_rank(c)
        g = dy if beta == 1.0 else e.Mul(dy, ctx.const(beta, like=dy))
        out_dims = dims_of(ctx, ctx.outputs[0], 2)
        dc = ctx.unbroadcast(g, c, out_dims=out_dims, like_dims=dims_of(ctx, c, rc))
    return (da, db, dc)[: len(ctx.inputs)]


# -------------------------------------------------------------------- Einsum
def _parse_einsum(eq: str, ranks: Sequence[int]) -> tuple[list[str], str]:
    """Operand and output subscripts, with '...' kept as the token '.'.

    An implicit output is the sorted letters that occur exactly once, after
    the ellipsis when any operand has one."""
    eq = eq.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = [t.replace("...", ".") for t in lhs.split(",")]
    if len(terms) != len(ranks):
        raise TrainingModelError(
            f"Einsum equation {eq!r} names {len(terms)} operands, the node has {len(ranks)}"
        )
    if arrow:
        out = rhs.replace("...", ".")
    else:
        letters = [ch for t in terms for ch in t if ch != "."]
        once = sorted(ch for ch in set(letters) if letters.count(ch) == 1)
        out = ("." if any("." in t for t in terms) else "") + "".join(once)
    return terms, out


def _broadcast_dims(shapes: Sequence[Sequence[Dim]], rank: int) -> tuple[Dim, ...]:
    """Static dims of the broadcast of ``shapes`` (right-aligned), None where unknown."""
    out: list[Dim] = []
    for k in range(rank):
        dims = [s[len(s) - rank + k] for s in shapes if len(s) - rank + k >= 0]
        big = {d for d in dims if d != 1}
        if not big:
            out.append(1)
        elif len(big) == 1 and None not in big:
            out.append(next(iter(big)))  # one size (or one symbol) besides 1s
        else:
            out.append(None)
    return tuple(out)


@vjp("Einsum")
def einsum_vjp(ctx, dy):
    """y = einsum(eq, x1..xn)  ->  dxi = einsum('out, xj.., xi -> xi', dy, xj.., ones_like(xi))

    The ones operand brings back letters that only xi has (summed in the
    forward pass).  When any operand has an ellipsis, the gradient einsum puts
    the ellipsis first, where it is the broadcast of every operand's ellipsis;
    it is summed back to xi's (away when xi has none) and moved to its place.  A letter repeated
    within one operand (a diagonal) is not supported."""
    e = ctx.emit
    xs = ctx.inputs
    ranks = [ctx.require_rank(x) for x in xs]
    terms, out = _parse_einsum(str(ctx.attr("equation")), ranks)
    n_ell = [r - len(t.replace(".", "")) for r, t in zip(ranks, terms)]
    ell_rank = max((n for n, t in zip(n_ell, terms) if "." in t), default=0)
    # The broadcast ellipsis, from the operands (ONNX's shape inference of
    # Einsum copies the first operand's ellipsis, so y's dims are not used).
    ell_dims = _broadcast_dims(
        [
            dims_of(ctx, x, r)[t.index(".") : t.index(".") + n]
            for x, r, t, n in zip(xs, ranks, terms, n_ell)
            if "." in t
        ],
        ell_rank,
    )
    grads: list[str | None] = []
    for i, x in enumerate(xs):
        if not ctx.needs(i):
            grads.append(None)
            continue
        letters = terms[i].replace(".", "")
        if len(set(letters)) != len(letters):
            raise TrainingModelError(
                f"gradient of Einsum node {ctx.node.name!r}: operand {i} repeats a "
                f"subscript in {terms[i]!r} (a diagonal); this is not supported"
            )
        others = [j for j in range(len(xs)) if j != i]
        # Once any operand has an ellipsis the output of an einsum must too.
        has_ell = any("." in t for t in terms)
        target = ("." if has_ell else "") + letters
        sub = [out] + [terms[j] for j in others] + [terms[i]]
        eq = ",".join(sub) + "->" + target
        ops = [dy] + [xs[j] for j in others] + [e.ones_like(x)]
        g = e.Einsum(*ops, equation=eq.replace(".", "..."))
        if has_ell:
            pos, n = (terms[i].index("."), n_ell[i]) if "." in terms[i] else (0, 0)
            perm = list(range(pos, pos + n)) + list(range(pos)) + list(range(pos + n, ranks[i]))
            x_dims = dims_of(ctx, x, ranks[i])
            like_dims = tuple(x_dims[k] for k in perm)
            out_dims = tuple(ell_dims) + like_dims[n:]
            like_shape = e.Gather(e.Shape(x), e.ints(perm)) if pos and n else None
            g = ctx.unbroadcast(g, x, out_dims=out_dims, like_dims=like_dims, like_shape=like_shape)
            if pos and n:
                g = e.Transpose(g, perm=[int(k) for k in np.argsort(perm)])
        grads.append(g)
    return tuple(grads)
