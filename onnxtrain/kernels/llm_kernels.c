/* onnxtrain's LLM training kernels: the non-product work of a decoder's step
 * (kernels/llm.py, kernels/attention.py and kernels/xent.py write the nodes).
 * Compiled into the same custom-op library as optim_kernels.c, in the domain
 * "ai.onnxtrain.kernels"; float32 tensors, int64 targets.
 *
 *   RmsNormF32      x [.., D], w [D], eps [1] -> y, r [.., 1], s [.., 1] (opt), n (opt)
 *       m = mean(x * x) over the last axis (summed in double, rounded once),
 *       s = sqrt(m + eps), r = 1 / s, n = x * r, y = w * n: the standard
 *       chain's float operations (Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul,
 *       Mul) but for the row sum, whose order no kernel shares with another.
 *   RmsNormGradF32  x, w, r, s, inv_d [1], acc (opt), dy_0, dy_1, ... (one or more) -> dx
 *       dy = ((dy_0 + dy_1) + dy_2) + ... (onnxruntime's Sum of the terms);
 *       g = dy * w; t = sum(g * x) over the row (double, rounded once);
 *       dx = g * r + ((-(t * (r * r))) / (2 s)) * inv_d * (2 x)  [+ acc]
 *       the rule's float operations in their order (Mul, ReduceSum, Mul, Neg,
 *       Div, Mul, Mul, Add) but for the row sum.
 *   SiluMulF32      a, s, b -> h, silu (opt)    silu = a * s, h = silu * b
 *   SiluMulGradF32  dh, a, b, s, dh2 (opt) -> da, db (opt)
 *       (dh += dh2 first) e = dh * b; db = dh * (a * s);
 *       da = e * s + (e * a) * (s * (1 - s)): the rule's operations, bit for bit.
 *   RopeF32         x [.., S, D], cos, sin [S * D elements] -> y
 *       y[i] = x[i] * cos[i] + rot[i] * sin[i], rot = (-x[h:], x[:h]), h = D / 2
 *       (Mul, Slice, Slice, Neg, Concat, Mul, Add: bit for bit).
 *   RopeGradF32     dy, cos, sin -> dx
 *       the rule's Mul, Mul, Split, Neg, two Pads and their three-input Sum
 *       with dy * cos: bit for bit.  At each element one of the Sum's terms
 *       is a Pad's +0, so any order of its two additions gives the same bits
 *       (a zero total is +0 in every order).
 *   RotateHalvesF32 x [.., D], cos, sin [.., half] (one shape, broadcast into x[.., :half]) -> y
 *       y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin (x1 = x[:half], x2 = x[half:2 half]),
 *       the rest of x copied: the attention rules' rotate (Slices, four Muls,
 *       Sub, Add, two Concats), bit for bit.
 *   LowRankMatMulAddF32 c [.., N], a [.., K], b [K, N] -> y = c + a b
 *       a product of few columns K (LoRA's up-projection: K = its rank) and
 *       the Add of its result, in one pass over c and y: each y[., j] is
 *       c + fma(a_k-1, b_k-1,j, ... fma(a1, b1j, a0 b0j)), k in order.  Not
 *       onnxruntime's product (its order): tests/kernels/ checks it against
 *       float64.
 *   LowRankTransAF32 a [M, K], b [M, N] -> a^T b [K, N]   (K few: LoRA's dB = h^T dY)
 *       each element summed over chunks of 64 rows in order by fused
 *       multiply-adds, the chunks' sums added in order.
 *   SoftmaxGuardF32 y -> isnan(y) ? 0 : y      (IsNaN + Where, bit for bit)
 *   SoftmaxGradF32  dq, y -> dx, kept (opt)   (the last axis)
 *       q = guard(y), e = isnan(y) ? 0 : dq, t = sum(e * q) over the row
 *       (double, rounded once), dx = q * (e - t): the rule's Where, Where,
 *       Mul, ReduceSum, Sub, Mul but for the row sum.
 *   SoftmaxGradPlainF32  dq, y -> dx, kept (opt)   (the last axis; one shape)
 *       t = sum(dq * y) over the row (double, rounded once), dx = y * (dq - t):
 *       the unguarded rule's Mul, ReduceSum, Sub, Mul but for the row sum.
 *   MaskedSoftmaxF32 a, b (broadcast together, as Add's) -> y, kept (opt)
 *       y = Softmax(a + b) over the last axis: the Add's float sums, the
 *       row's max, e^(v - max) (the library's exp, as the cross-entropy's),
 *       their sum in double, y = e * (1 / sum); the Add and the Softmax
 *       without writing a + b.  A row with a NaN or all -inf is NaN.
 *       kept (int64, y's dims but the last, and so the gradients'): each
 *       row's length past which its values are all +-0 (a bound: not always
 *       the last nonzero), for the products below.
 *   MatMulMaskedSoftmaxF32 a [.., M, K], b [.., K, N], mask (broadcast) -> y, kept (opt)
 *       MaskedSoftmaxF32(a b, mask) without writing a b, whose sums (the tail
 *       products') leave out each row's columns past its mask's last value
 *       that is not -inf (where a finite score gives y = 0).
 *   CrossEntropyF32     scores [N, C], target (int64 [N]), ignore (int64 [1])
 *                       -> loss [], lse (double [N])
 *       lse = log sum exp over each row; loss = mean over the rows whose
 *       target is not ignored of lse - scores[target], all in double: the
 *       reduction="mean" SoftmaxCrossEntropyLoss without weights.
 *   CrossEntropyGradF32 scores, lse, target (int64 [N], in range), v [N] -> d
 *       d[n, c] = (c == target[n] ? v[n] : 0) - exp(scores[n, c] - lse[n]) * v[n]:
 *       the rule's ScatterElements, ReduceSum, Exp, Mul and Sub over the
 *       log-probabilities, from the scores without storing them.
 *   TailMatMulF32       a [.., M, K], b [.., K, N], alpha (opt), kept (opt) -> (a b) [* alpha]
 *   TailMatMulTransAF32 a [.., K, M], b [.., K, N], alpha (opt), kept (opt) -> (a^T b) [* alpha]
 *   MatMulTailBF32      a [.., M, K], b [.., K, N], alpha (opt), kept (opt) -> (a b) [* alpha]
 *       products that leave out the zeros past each row's last nonzero of a's
 *       rows (as stored) or b's (found by a scan, or kept's bound of each:
 *       int64, one per row of the tailed operand, from the kernel that wrote
 *       it): attention's products of a masked softmax's
 *       probabilities and their gradient (kernels/tails.py), summed over k
 *       by chunks of fused multiply-adds.  Not onnxruntime's order; an
 *       infinity or a NaN facing a skipped zero is left out (the standard
 *       product's NaN).
 *   DequantizeNBitsF32  B (uint8 [N, blocks, blob]), scales [N * blocks], G (int64: K, N,
 *                       bits, block_size), zp (uint8, packed per row; opt), zpf (float; opt)
 *                       -> W [N, K]
 *       W[n, k] = (q[n, k] - z[n, j]) * scales[n, j], j = k / block_size: q the
 *       bits-bit codes of B, low bits of a byte first; z the codes of zp, or
 *       zpf, or 2^(bits - 1): what MatMulNBits multiplies by (Y = A W^T), from
 *       the codes in one pass, with the rule's Sub and Mul: bit for bit the
 *       rule's unpacking (kernels/nbits.py).
 *
 * Where a kernel is not bit for bit its chain, the difference is the row
 * sums: run in double in one order, they are as close to float64 as the
 * float sums they replace (tests/kernels/ checks both claims).  The library
 * is compiled with -ffp-contract=off, so no fused multiply-add changes a
 * rounding.  A kernel splits its rows into ranges (ort_api.h: over the
 * session's intra-op pool); a row is computed by one thread, so the split
 * changes nothing.
 */

#include "ort_api.h"

#include <stdlib.h>

/* Comparisons do not trap here (no kernel reads the floating-point exception
 * flags), so the selections below (NaN and range checks) vectorize.  No value
 * changes: -ffp-contract=off and IEEE rounding hold. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#define MAX_IO 16

typedef struct Args {
    size_t n_in, n_out;
    const OrtValue *value[MAX_IO];
    void *data[MAX_IO];
    int64_t dims[MAX_IO][8];
    size_t rank[MAX_IO], count[MAX_IO];
    OrtKernelContext *ctx;
} Args;

struct LlmOp;
typedef OrtStatus *(*LlmCompute)(const struct LlmOp *op, Args *a);

typedef struct LlmOp {
    CustomOp op; /* first member: ORT hands back &op */
    const char *name;
    int n_in, n_out;
    int in_type[MAX_IO], out_type[MAX_IO];
    unsigned opt_in, opt_out; /* bit i: input / output i may be absent */
    LlmCompute compute;
    int variadic; /* the last input takes any number (one or more) of tensors of its type */
} LlmOp;

static OrtStatus *llm_fail(const LlmOp *op, const char *what) { return named_fail(op->name, what); }

/* Output k of shape dims, its data in *out (NULL: an absent optional output). */
static OrtStatus *llm_output(const LlmOp *op, Args *a, size_t k, const int64_t *dims, size_t rank, void **out) {
    *out = NULL;
    if (k >= a->n_out) {
        if (op->opt_out & (1u << k)) return NULL;
        return llm_fail(op, "a required output is missing");
    }
    OrtValue *value = NULL;
    OrtStatus *st = API(API_KernelContext_GetOutput, GetOutputFn)(a->ctx, k, dims, rank, &value);
    if (st) return st;
    if (!value) {
        if (op->opt_out & (1u << k)) return NULL;
        return llm_fail(op, "a required output is missing");
    }
    return API(API_GetTensorMutableData, MutableDataFn)(value, out);
}

static OrtStatus *llm_compute_in(void *kernel, OrtKernelContext *ctx) {
    const LlmOp *op = (const LlmOp *)kernel;
    Args a;
    memset(&a, 0, sizeof(a));
    a.ctx = ctx;
    OrtStatus *st = API(API_KernelContext_GetInputCount, InputCountFn)(ctx, &a.n_in);
    if (!st) st = API(API_KernelContext_GetOutputCount, InputCountFn)(ctx, &a.n_out);
    if (st) return st;
    const size_t n_in = op->variadic && a.n_in > (size_t)op->n_in ? a.n_in : (size_t)op->n_in;
    if (n_in > MAX_IO || a.n_out > (size_t)op->n_out) return llm_fail(op, "too many inputs or outputs");
    for (size_t i = 0; i < n_in; ++i) {
        const size_t spec = i < (size_t)op->n_in ? i : (size_t)op->n_in - 1;
        const OrtValue *v = NULL;
        if (i < a.n_in) {
            st = API(API_KernelContext_GetInput, GetInputFn)(ctx, i, &v);
            if (st) return st;
        }
        if (!v) {
            if (op->opt_in & (1u << spec)) continue;
            return llm_fail(op, "a required input is missing");
        }
        int elem = 0;
        st = describe(v, &elem, &a.count[i], a.dims[i], &a.rank[i]);
        if (st) return st;
        if (elem != op->in_type[spec]) return llm_fail(op, "an input has the wrong element type");
        st = API(API_GetTensorMutableData, MutableDataFn)((OrtValue *)v, &a.data[i]);
        if (st) return st;
        a.value[i] = v;
    }
    return op->compute(op, &a);
}

/* ------------------------------------------------------------ row sums */
/* OUT = the sum over I in [0, N) of EXPR (a double), in one fixed order: eight
 * partial sums over I mod 8, then added pairwise.  Products of floats are
 * exact in double. */
#define SUM8(OUT, N, I, EXPR)                                                               \
    do {                                                                                    \
        double p_[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                            \
        int64_t b_ = 0;                                                                     \
        for (; b_ + 8 <= (N); b_ += 8)                                                      \
            for (int k_ = 0; k_ < 8; ++k_) {                                                \
                const int64_t I = b_ + k_;                                                  \
                p_[k_] += (EXPR);                                                           \
            }                                                                               \
        for (int k_ = 0; b_ + k_ < (N); ++k_) {                                             \
            const int64_t I = b_ + k_;                                                      \
            p_[k_] += (EXPR);                                                               \
        }                                                                                   \
        OUT = ((p_[0] + p_[4]) + (p_[2] + p_[6])) + ((p_[1] + p_[5]) + (p_[3] + p_[7]));    \
    } while (0)

/* ------------------------------------------------------------ RMSNorm */
typedef struct {
    const float *x, *w, *dy, *r, *s, *acc;
    float eps, inv_d;
    float *y, *ro, *so, *n, *dx;
    int64_t d;
    int terms;
    const float *dys[MAX_IO];
} NormJob;

CLONES static void rms_norm_rows(void *arg, int64_t b, int64_t e) {
    const NormJob *j = (const NormJob *)arg;
    const int64_t d = j->d;
    for (int64_t row = b; row < e; ++row) {
        const float *x = j->x + row * d;
        double sq;
        SUM8(sq, d, i, (double)x[i] * (double)x[i]);
        const float m = (float)(sq / (double)d);
        const float s = sqrtf(m + j->eps);
        const float r = 1.0f / s;
        j->ro[row] = r;
        if (j->so) j->so[row] = s;
        float *y = j->y + row * d, *n = j->n ? j->n + row * d : NULL;
        for (int64_t i = 0; i < d; ++i) {
            const float ni = x[i] * r;
            y[i] = j->w[i] * ni;
            if (n) n[i] = ni;
        }
    }
}

static OrtStatus *rms_norm(const LlmOp *op, Args *a) {
    const size_t rank = a->rank[0];
    if (rank < 1) return llm_fail(op, "x must have a last axis");
    const int64_t d = a->dims[0][rank - 1];
    if (d <= 0 || (int64_t)a->count[1] != d || a->count[2] != 1)
        return llm_fail(op, "w must hold x's last dimension and eps one element");
    int64_t rdims[8];
    memcpy(rdims, a->dims[0], sizeof(rdims));
    rdims[rank - 1] = 1;
    NormJob j = {a->data[0], a->data[1], NULL, NULL, NULL, NULL, *(const float *)a->data[2], 0.0f,
                 NULL, NULL, NULL, NULL, NULL, d, 0, {0}};
    OrtStatus *st = llm_output(op, a, 0, a->dims[0], rank, (void **)&j.y);
    if (!st) st = llm_output(op, a, 1, rdims, rank, (void **)&j.ro);
    if (!st) st = llm_output(op, a, 2, rdims, rank, (void **)&j.so);
    if (!st) st = llm_output(op, a, 3, a->dims[0], rank, (void **)&j.n);
    if (st) return st;
    const int64_t rows = (int64_t)a->count[0] / d;
    split_work(rms_norm_rows, &j, rows, (int64_t)a->count[0] * 12);
    return NULL;
}

/* dx = (acc +) g r + dm 2x with g = dy w, for one row (dy may be dx itself:
 * each element is read before it is written). */
static inline void rms_norm_grad_finish(const NormJob *j, const float *x, const float *dy, const float *acc,
                                        float *dx, float r, float dm) {
    const float *w = j->w;
    if (acc)
        for (int64_t i = 0; i < j->d; ++i) dx[i] = acc[i] + ((dy[i] * w[i]) * r + dm * (2.0f * x[i]));
    else
        for (int64_t i = 0; i < j->d; ++i) dx[i] = (dy[i] * w[i]) * r + dm * (2.0f * x[i]);
}

/* With several dy terms their sum, ((dy_0 + dy_1) + dy_2) + ... (the order of
 * onnxruntime's Sum), goes into the row of dx first, which the last pass
 * then overwrites element by element. */
CLONES static void rms_norm_grad_rows(void *arg, int64_t b, int64_t e) {
    const NormJob *j = (const NormJob *)arg;
    const int64_t d = j->d;
    const float *w = j->w;
    for (int64_t row = b; row < e; ++row) {
        const float *x = j->x + row * d;
        const float *acc = j->acc ? j->acc + row * d : NULL;
        float *dx = j->dx + row * d;
        const float r = j->r[row], s = j->s[row];
        const float *dy = j->dys[0] + row * d;
        if (j->terms > 1) {
            const float *d0 = j->dys[0] + row * d, *d1 = j->dys[1] + row * d;
            for (int64_t i = 0; i < d; ++i) dx[i] = d0[i] + d1[i];
            for (int t = 2; t < j->terms; ++t) {
                const float *dt = j->dys[t] + row * d;
                for (int64_t i = 0; i < d; ++i) dx[i] = dx[i] + dt[i];
            }
            dy = dx;
        }
        double t;
        SUM8(t, d, i, (double)(dy[i] * w[i]) * (double)x[i]);
        /* d/dr, d/ds, d/d(mean): one float operation per standard kernel */
        const float dm = ((-((float)t * (r * r))) / (2.0f * s)) * j->inv_d;
        rms_norm_grad_finish(j, x, dy, acc, dx, r, dm);
    }
}

static OrtStatus *rms_norm_grad(const LlmOp *op, Args *a) {
    /* x, w, r, s, inv_d, acc (opt), dy terms... */
    const size_t rank = a->rank[0];
    if (rank < 1) return llm_fail(op, "x must have a last axis");
    const int64_t d = a->dims[0][rank - 1];
    const int64_t rows = d > 0 ? (int64_t)a->count[0] / d : 0;
    const int terms = (int)a->n_in - 6;
    int ok = d > 0 && terms >= 1 && (int64_t)a->count[1] == d && (int64_t)a->count[2] == rows &&
             (int64_t)a->count[3] == rows && a->count[4] == 1 && (!a->data[5] || a->count[5] == a->count[0]);
    for (int t = 0; ok && t < terms; ++t) ok = a->data[6 + t] && a->count[6 + t] == a->count[0];
    if (!ok) return llm_fail(op, "expects x, acc and the dy terms of one size, w of x's last dimension, r and s per row");
    NormJob j = {a->data[0], a->data[1], NULL, a->data[2], a->data[3], a->data[5], 0.0f,
                 *(const float *)a->data[4], NULL, NULL, NULL, NULL, NULL, d, terms, {0}};
    for (int t = 0; t < terms; ++t) j.dys[t] = a->data[6 + t];
    OrtStatus *st = llm_output(op, a, 0, a->dims[0], rank, (void **)&j.dx);
    if (st) return st;
    split_work(rms_norm_grad_rows, &j, rows, (int64_t)a->count[0] * (12 + 4 * terms));
    return NULL;
}

/* ------------------------------------------------------------ SiLU * mul */
typedef struct {
    const float *a, *s, *b, *dh, *dh2;
    float *h, *silu, *da, *db;
} SiluJob;

CLONES static void silu_mul_part(void *arg, int64_t b, int64_t e) {
    const SiluJob *j = (const SiluJob *)arg;
    for (int64_t i = b; i < e; ++i) {
        const float silu = j->a[i] * j->s[i];
        j->h[i] = silu * j->b[i];
        if (j->silu) j->silu[i] = silu;
    }
}

CLONES static void silu_mul_grad_part(void *arg, int64_t b, int64_t e) {
    const SiluJob *j = (const SiluJob *)arg;
    for (int64_t i = b; i < e; ++i) {
        const float dh = j->dh2 ? j->dh[i] + j->dh2[i] : j->dh[i];
        const float a = j->a[i], s = j->s[i];
        const float ds = dh * j->b[i];
        if (j->db) j->db[i] = dh * (a * s);
        j->da[i] = ds * s + (ds * a) * (s * (1.0f - s));
    }
}

static OrtStatus *silu_mul(const LlmOp *op, Args *a) {
    if (a->count[1] != a->count[0] || a->count[2] != a->count[0]) return llm_fail(op, "a, s and b must have one size");
    SiluJob j = {a->data[0], a->data[1], a->data[2], NULL, NULL, NULL, NULL, NULL, NULL};
    OrtStatus *st = llm_output(op, a, 0, a->dims[0], a->rank[0], (void **)&j.h);
    if (!st) st = llm_output(op, a, 1, a->dims[0], a->rank[0], (void **)&j.silu);
    if (st) return st;
    split_work(silu_mul_part, &j, (int64_t)a->count[0], (int64_t)a->count[0] * 20);
    return NULL;
}

static OrtStatus *silu_mul_grad(const LlmOp *op, Args *a) {
    const size_t n = a->count[0];
    if (a->count[1] != n || a->count[2] != n || a->count[3] != n || (a->data[4] && a->count[4] != n))
        return llm_fail(op, "dh, a, b, s (and dh2) must have one size");
    SiluJob j = {a->data[1], a->data[3], a->data[2], a->data[0], a->data[4], NULL, NULL, NULL, NULL};
    OrtStatus *st = llm_output(op, a, 0, a->dims[1], a->rank[1], (void **)&j.da);
    if (!st) st = llm_output(op, a, 1, a->dims[2], a->rank[2], (void **)&j.db);
    if (st) return st;
    split_work(silu_mul_grad_part, &j, (int64_t)n, (int64_t)n * 28);
    return NULL;
}

/* ------------------------------------------------------------ broadcasting */
/* The strides of a tensor of dims in[0..in_rank) broadcast into dims[0..rank)
 * (right-aligned; 0 along a dim of 1): 0 if it does not broadcast into them. */
static int broadcast_into(const int64_t *dims, size_t rank, const int64_t *in, size_t in_rank, int64_t *stride) {
    if (in_rank > rank) return 0;
    int64_t step = 1;
    for (int64_t k = (int64_t)rank - 1; k >= 0; --k) {
        const int64_t at = k - ((int64_t)rank - (int64_t)in_rank);
        const int64_t d = at >= 0 ? in[at] : 1;
        if (d != 1 && d != dims[k]) return 0;
        stride[k] = d == 1 ? 0 : step;
        step *= d;
    }
    return 1;
}

/* The offset, by ``stride``, of row ``row`` of dims[0..lead) (the rows of a
 * tensor whose last axis is not counted in lead). */
static inline int64_t row_offset(int64_t row, const int64_t *dims, int64_t lead, const int64_t *stride) {
    int64_t off = 0;
    for (int64_t k = lead - 1; k >= 0; --k) {
        off += (row % dims[k]) * stride[k];
        row /= dims[k];
    }
    return off;
}

/* ------------------------------------------------------------ RoPE */
typedef struct {
    const float *x, *cos, *sin;
    float *y;
    int64_t d, s;
} RopeJob;

CLONES static void rope_rows(void *arg, int64_t b, int64_t e) {
    const RopeJob *j = (const RopeJob *)arg;
    const int64_t d = j->d, h = d / 2;
    for (int64_t row = b; row < e; ++row) {
        const float *x = j->x + row * d, *c = j->cos + (row % j->s) * d, *sn = j->sin + (row % j->s) * d;
        float *y = j->y + row * d;
        for (int64_t i = 0; i < h; ++i) y[i] = x[i] * c[i] + (-x[i + h]) * sn[i];
        for (int64_t i = h; i < d; ++i) y[i] = x[i] * c[i] + x[i - h] * sn[i];
    }
}

/* dx = Sum(t0, t1, dy * cos) with t0 the Pad of -(dy * sin)[:h] at [h:] and t1
 * the Pad of (dy * sin)[h:] at [:h] (+0 elsewhere). */
CLONES static void rope_grad_rows(void *arg, int64_t b, int64_t e) {
    const RopeJob *j = (const RopeJob *)arg;
    const int64_t d = j->d, h = d / 2;
    for (int64_t row = b; row < e; ++row) {
        const float *dy = j->x + row * d, *c = j->cos + (row % j->s) * d, *sn = j->sin + (row % j->s) * d;
        float *dx = j->y + row * d;
        for (int64_t i = 0; i < h; ++i) dx[i] = (0.0f + dy[i + h] * sn[i + h]) + dy[i] * c[i];
        for (int64_t i = h; i < d; ++i) dx[i] = (-(dy[i - h] * sn[i - h]) + 0.0f) + dy[i] * c[i];
    }
}

static OrtStatus *rope_common(const LlmOp *op, Args *a, RopeJob *j) {
    const size_t rank = a->rank[0];
    if (rank < 2) return llm_fail(op, "x must have rank 2 or more");
    j->d = a->dims[0][rank - 1];
    j->s = a->dims[0][rank - 2];
    if (j->d <= 0 || j->d % 2 || j->s <= 0 || (int64_t)a->count[1] != j->s * j->d ||
        (int64_t)a->count[2] != j->s * j->d)
        return llm_fail(op, "expects an even last axis D and cos, sin of S x D elements");
    j->x = a->data[0];
    j->cos = a->data[1];
    j->sin = a->data[2];
    return llm_output(op, a, 0, a->dims[0], rank, (void **)&j->y);
}

static OrtStatus *rope(const LlmOp *op, Args *a) {
    RopeJob j;
    memset(&j, 0, sizeof(j));
    OrtStatus *st = rope_common(op, a, &j);
    if (st) return st;
    split_work(rope_rows, &j, (int64_t)a->count[0] / j.d, (int64_t)a->count[0] * 8);
    return NULL;
}

static OrtStatus *rope_grad(const LlmOp *op, Args *a) {
    RopeJob j;
    memset(&j, 0, sizeof(j));
    OrtStatus *st = rope_common(op, a, &j);
    if (st) return st;
    split_work(rope_grad_rows, &j, (int64_t)a->count[0] / j.d, (int64_t)a->count[0] * 8);
    return NULL;
}

/* The rotation of the attention rules' gradients (autodiff's ``rotate``):
 * x [.., D], cos and sin [.., half] broadcast into x's leading dims; the first
 * 2 half channels rotated by halves, the rest copied. */
typedef struct {
    const float *x, *cos, *sin;
    float *y;
    int64_t d, h, lead;
    int64_t dims[8], stride[8];
} RotateJob;

CLONES static void rotate_rows(void *arg, int64_t b, int64_t e) {
    const RotateJob *j = (const RotateJob *)arg;
    const int64_t d = j->d, h = j->h;
    for (int64_t row = b; row < e; ++row) {
        const int64_t off = row_offset(row, j->dims, j->lead, j->stride);
        const float *x = j->x + row * d, *c = j->cos + off, *sn = j->sin + off;
        float *y = j->y + row * d;
        for (int64_t i = 0; i < h; ++i) y[i] = x[i] * c[i] - x[i + h] * sn[i];
        for (int64_t i = 0; i < h; ++i) y[i + h] = x[i + h] * c[i] + x[i] * sn[i];
        for (int64_t i = 2 * h; i < d; ++i) y[i] = x[i];
    }
}

static OrtStatus *rotate_halves(const LlmOp *op, Args *a) {
    const size_t rank = a->rank[0], crank = a->rank[1];
    if (rank < 1 || rank > 8 || crank < 1 || a->rank[2] != crank ||
        memcmp(a->dims[1], a->dims[2], crank * sizeof(int64_t)))
        return llm_fail(op, "expects x of rank 1 to 8, and cos and sin of one shape");
    RotateJob j;
    memset(&j, 0, sizeof(j));
    j.x = a->data[0];
    j.cos = a->data[1];
    j.sin = a->data[2];
    j.d = a->dims[0][rank - 1];
    j.h = a->dims[1][crank - 1];
    j.lead = (int64_t)rank - 1;
    memcpy(j.dims, a->dims[0], rank * sizeof(int64_t));
    j.dims[rank - 1] = j.h; /* cos, sin broadcast into x[.., :half] */
    if (2 * j.h > j.d || !broadcast_into(j.dims, rank, a->dims[1], crank, j.stride))
        return llm_fail(op, "cos and sin must broadcast into x[..., :half], 2 half <= D");
    OrtStatus *st = llm_output(op, a, 0, a->dims[0], rank, (void **)&j.y);
    if (st || a->count[0] == 0 || j.d == 0) return st;
    split_work(rotate_rows, &j, (int64_t)a->count[0] / j.d, (int64_t)a->count[0] * 8);
    return NULL;
}

/* ------------------------------------------------------------ softmax */
typedef struct {
    const float *y, *dq;
    float *out;
    int64_t d;
    int plain; /* 1: no guard (y has no NaN to zero: SoftmaxGradPlainF32) */
    int64_t *kept; /* (opt) each row of out: its length to its last value that is not +-0 */
} SoftmaxJob;

/* The length of x[0..d) to its last element that is not +-0 (a NaN counts). */
static inline int64_t nonzero_length(const float *x, int64_t d) {
    int64_t hi = d;
    while (hi >= 16) {
        uint32_t bits[16], any = 0;
        memcpy(bits, x + hi - 16, sizeof(bits));
        for (int t = 0; t < 16; ++t) any |= bits[t] << 1;
        if (any) break;
        hi -= 16;
    }
    while (hi > 0) {
        uint32_t v;
        memcpy(&v, x + hi - 1, sizeof(v));
        if (v << 1) break;
        --hi;
    }
    return hi;
}

/* onnxruntime's Where(c, 0, v): v as it is (-0 stays -0) where c is false, +0
 * where it is true (its selections of the first operand are added to zeros,
 * those of the second copied; tests/kernels/ checks it on the onnxruntime in use). */
static inline float where_zero(int c, float v) { return c ? 0.0f : v; }

CLONES static void guard_part(void *arg, int64_t b, int64_t e) {
    const SoftmaxJob *j = (const SoftmaxJob *)arg;
    for (int64_t i = b; i < e; ++i) j->out[i] = where_zero(j->y[i] != j->y[i], j->y[i]);
}

CLONES static void softmax_grad_rows(void *arg, int64_t b, int64_t e) {
    const SoftmaxJob *j = (const SoftmaxJob *)arg;
    const int64_t d = j->d;
    for (int64_t row = b; row < e; ++row) {
        const float *y = j->y + row * d, *dq = j->dq + row * d;
        float *dx = j->out + row * d;
        double sum;
        if (j->plain) {
            SUM8(sum, d, i, (double)(dq[i] * y[i]));
            const float t = (float)sum;
            for (int64_t i = 0; i < d; ++i) dx[i] = y[i] * (dq[i] - t);
            if (j->kept) j->kept[row] = nonzero_length(dx, d); /* (the row just written: in cache) */
            continue;
        }
        SUM8(sum, d, i, (double)(where_zero(y[i] != y[i], dq[i]) * where_zero(y[i] != y[i], y[i])));
        const float t = (float)sum;
        for (int64_t i = 0; i < d; ++i) {
            const int c = y[i] != y[i];
            dx[i] = where_zero(c, y[i]) * (where_zero(c, dq[i]) - t);
        }
        if (j->kept) j->kept[row] = nonzero_length(dx, d);
    }
}

static OrtStatus *softmax_guard(const LlmOp *op, Args *a) {
    SoftmaxJob j = {a->data[0], NULL, NULL, 0, 0, NULL};
    OrtStatus *st = llm_output(op, a, 0, a->dims[0], a->rank[0], (void **)&j.out);
    if (st) return st;
    split_work(guard_part, &j, (int64_t)a->count[0], (int64_t)a->count[0] * 8);
    return NULL;
}

/* The gradient's rows, guarded or ``plain``. */
static OrtStatus *softmax_grad_run(const LlmOp *op, Args *a, int plain) {
    const size_t rank = a->rank[1];
    if (rank < 1 || a->count[0] != a->count[1]) return llm_fail(op, "dq and y must have one size");
    SoftmaxJob j = {a->data[1], a->data[0], NULL, a->dims[1][rank - 1], plain, NULL};
    if (j.d <= 0) return llm_fail(op, "y must have a non-empty last axis");
    OrtStatus *st = llm_output(op, a, 0, a->dims[1], rank, (void **)&j.out);
    if (!st) st = llm_output(op, a, 1, a->dims[1], rank - 1, (void **)&j.kept);
    if (st) return st;
    split_work(softmax_grad_rows, &j, (int64_t)a->count[1] / j.d, (int64_t)a->count[1] * 12);
    return NULL;
}

static OrtStatus *softmax_grad(const LlmOp *op, Args *a) { return softmax_grad_run(op, a, 0); }

/* The gradient as the rule writes it without a guard (GroupQueryAttention's,
 * whose probabilities have no NaN row): dq and y must have one shape, as
 * the kernel does not broadcast them (matched on named dims, on trust). */
static OrtStatus *softmax_grad_plain(const LlmOp *op, Args *a) {
    if (a->rank[0] != a->rank[1] || memcmp(a->dims[0], a->dims[1], a->rank[0] * sizeof(int64_t)))
        return llm_fail(op, "dq and y must have one shape");
    return softmax_grad_run(op, a, 1);
}

/* ------------------------------------------------------------ low-rank product plus a sum */
typedef struct {
    const float *c, *a, *b;
    float *y;
    int64_t k, n, rows;
} LowRankJob;

#define LOWRANK_COLS 32
#define LOWRANK_ROWS 4

/* Rows [r, r + LOWRANK_ROWS) x columns [j0, j0 + LOWRANK_COLS): each y is
 * c + the k products accumulated in order by fused multiply-adds (fmaf: one
 * rounding each, so every clone gives the same bits).  The block's sums stay
 * in registers over the k products, each row of b read once for its rows.
 * The next block's c and y are fetched ahead: read from memory after the
 * products, they stalled the loop (2.4x slower on an AMD EPYC without it).
 * (A prefetch past a row's end only warms a line; it never faults.) */
static inline __attribute__((always_inline)) void lowrank_block(const LowRankJob *j, int64_t r, int64_t j0) {
    float acc[LOWRANK_ROWS][LOWRANK_COLS];
    const float *b = j->b + j0, *a = j->a + r * j->k;
    for (int q = 0; q < LOWRANK_ROWS; ++q) /* the next block's c and y, one 64-byte line at a time */
        for (int t = 0; t < LOWRANK_COLS; t += 16) {
            __builtin_prefetch(j->c + (r + q) * j->n + j0 + LOWRANK_COLS + t, 0, 3);
            __builtin_prefetch(j->y + (r + q) * j->n + j0 + LOWRANK_COLS + t, 1, 3);
        }
    for (int q = 0; q < LOWRANK_ROWS; ++q)
        for (int t = 0; t < LOWRANK_COLS; ++t) acc[q][t] = a[q * j->k] * b[t];
    for (int64_t kk = 1; kk < j->k; ++kk) {
        const float *br = b + kk * j->n;
        for (int q = 0; q < LOWRANK_ROWS; ++q) {
            const float av = a[q * j->k + kk];
            for (int t = 0; t < LOWRANK_COLS; ++t) acc[q][t] = fmaf(av, br[t], acc[q][t]);
        }
    }
    for (int q = 0; q < LOWRANK_ROWS; ++q) {
        const float *c = j->c + (r + q) * j->n + j0;
        float *y = j->y + (r + q) * j->n + j0;
        for (int t = 0; t < LOWRANK_COLS; ++t) y[t] = c[t] + acc[q][t];
    }
}

/* One element the same way (the rows and columns past whole blocks). */
static inline __attribute__((always_inline)) void lowrank_one(const LowRankJob *j, int64_t r, int64_t t) {
    const float *a = j->a + r * j->k;
    float acc = a[0] * j->b[t];
    for (int64_t kk = 1; kk < j->k; ++kk) acc = fmaf(a[kk], j->b[kk * j->n + t], acc);
    j->y[r * j->n + t] = j->c[r * j->n + t] + acc;
}

/* Items are groups of LOWRANK_ROWS rows (the last group may be short). */
FMA_CLONES static void lowrank_rows(void *arg, int64_t b, int64_t e) {
    const LowRankJob *j = (const LowRankJob *)arg;
    const int64_t n = j->n, cols = n - n % LOWRANK_COLS;
    for (int64_t g = b; g < e; ++g) {
        const int64_t r0 = g * LOWRANK_ROWS, r1 = r0 + LOWRANK_ROWS < j->rows ? r0 + LOWRANK_ROWS : j->rows;
        if (r1 - r0 == LOWRANK_ROWS)
            for (int64_t j0 = 0; j0 < cols; j0 += LOWRANK_COLS) lowrank_block(j, r0, j0);
        for (int64_t r = r0; r < r1; ++r)
            for (int64_t t = r1 - r0 == LOWRANK_ROWS ? cols : 0; t < n; ++t) lowrank_one(j, r, t);
    }
}

/* out [K, N] = a^T b for a [M, K] of few columns, b [M, N] (LoRA's gradient
 * of its up-projection, dB = h^T dY): items are blocks of LOWRANK_TCOLS
 * columns of out, each summed over the M rows in order by fused
 * multiply-adds, LOWRANK_TROWS rows of out at a time in registers.  Each row
 * of b is fetched two blocks ahead in the first pass over it: a chunk reads 64
 * rows of b far apart, which the hardware does not fetch ahead by itself (3x
 * slower on an AMD EPYC without it). */
#define LOWRANK_TCOLS 32
#define LOWRANK_TROWS 8

typedef struct {
    const float *a, *b;
    float *out;
    int64_t m, k, n;
} LowRankTJob;

/* Rows [i0, i1) of the sums of out's block (k0, j0), summed from 0 and then
 * added to what the rows before left in out (a sum by chunks: closer to the
 * exact sum than one running sum over all rows). */
static inline __attribute__((always_inline)) void lowrank_t_block(const LowRankTJob *j, int64_t k0, int64_t j0,
                                                                  int64_t i0, int64_t i1) {
    float acc[LOWRANK_TROWS][LOWRANK_TCOLS];
    float *out = j->out + k0 * j->n + j0;
    for (int q = 0; q < LOWRANK_TROWS; ++q)
        for (int t = 0; t < LOWRANK_TCOLS; ++t) acc[q][t] = 0.0f;
    for (int64_t i = i0; i < i1; ++i) {
        const float *ar = j->a + i * j->k + k0, *br = j->b + i * j->n + j0;
        if (k0 == 0) { /* this row of b two blocks on (its 32 columns: two lines) */
            __builtin_prefetch(br + 2 * LOWRANK_TCOLS, 0, 3);
            __builtin_prefetch(br + 2 * LOWRANK_TCOLS + 16, 0, 3);
        }
        for (int q = 0; q < LOWRANK_TROWS; ++q)
            for (int t = 0; t < LOWRANK_TCOLS; ++t) acc[q][t] = fmaf(ar[q], br[t], acc[q][t]);
    }
    for (int q = 0; q < LOWRANK_TROWS; ++q)
        for (int t = 0; t < LOWRANK_TCOLS; ++t) out[q * j->n + t] = i0 ? out[q * j->n + t] + acc[q][t] : acc[q][t];
}

/* One element of out the same way (the rows and columns past whole blocks). */
static inline __attribute__((always_inline)) void lowrank_t_one(const LowRankTJob *j, int64_t kk, int64_t t,
                                                                int64_t i0, int64_t i1) {
    float acc = 0.0f;
    for (int64_t i = i0; i < i1; ++i) acc = fmaf(j->a[i * j->k + kk], j->b[i * j->n + t], acc);
    j->out[kk * j->n + t] = i0 ? j->out[kk * j->n + t] + acc : acc;
}

/* Items: blocks of columns of out.  The rows go by chunks of LOWRANK_TCHUNK
 * (their part of b stays in cache across the blocks); each element is summed
 * over all rows in order, whatever the split. */
#define LOWRANK_TCHUNK 64
FMA_CLONES static void lowrank_t_cols(void *arg, int64_t b, int64_t e) {
    const LowRankTJob *j = (const LowRankTJob *)arg;
    const int64_t rows = j->k - j->k % LOWRANK_TROWS;
    for (int64_t i0 = 0; i0 < j->m; i0 += LOWRANK_TCHUNK) {
        const int64_t i1 = i0 + LOWRANK_TCHUNK < j->m ? i0 + LOWRANK_TCHUNK : j->m;
        for (int64_t blk = b; blk < e; ++blk) {
            const int64_t j0 = blk * LOWRANK_TCOLS;
            const int64_t j1 = j0 + LOWRANK_TCOLS < j->n ? j0 + LOWRANK_TCOLS : j->n;
            if (j1 - j0 == LOWRANK_TCOLS)
                for (int64_t k0 = 0; k0 < rows; k0 += LOWRANK_TROWS) lowrank_t_block(j, k0, j0, i0, i1);
            for (int64_t kk = j1 - j0 == LOWRANK_TCOLS ? rows : 0; kk < j->k; ++kk)
                for (int64_t t = j0; t < j1; ++t) lowrank_t_one(j, kk, t, i0, i1);
        }
    }
}

static OrtStatus *lowrank_t(const LlmOp *op, Args *a) {
    if (a->rank[0] != 2 || a->rank[1] != 2 || a->dims[0][0] != a->dims[1][0])
        return llm_fail(op, "expects a [M, K] and b [M, N]");
    LowRankTJob j = {a->data[0], a->data[1], NULL, a->dims[0][0], a->dims[0][1], a->dims[1][1]};
    const int64_t dims[2] = {j.k, j.n};
    OrtStatus *st = llm_output(op, a, 0, dims, 2, (void **)&j.out);
    if (st || j.k == 0 || j.n == 0) return st;
    split_work(lowrank_t_cols, &j, (j.n + LOWRANK_TCOLS - 1) / LOWRANK_TCOLS, (j.m * (j.n + j.k) + j.k * j.n) * 4);
    return NULL;
}

static OrtStatus *lowrank_add(const LlmOp *op, Args *a) {
    const size_t rank = a->rank[0];
    if (rank < 1 || a->rank[2] != 2 || a->rank[1] != rank) return llm_fail(op, "expects c [.., N], a [.., K], b [K, N]");
    const int64_t k = a->dims[2][0], n = a->dims[2][1];
    if (k < 1 || a->dims[1][rank - 1] != k || a->dims[0][rank - 1] != n ||
        memcmp(a->dims[0], a->dims[1], (rank - 1) * sizeof(int64_t)))
        return llm_fail(op, "expects c [.., N], a [.., K], b [K, N] with one leading shape");
    LowRankJob j = {a->data[0], a->data[1], a->data[2], NULL, k, n, n ? (int64_t)a->count[0] / n : 0};
    OrtStatus *st = llm_output(op, a, 0, a->dims[0], rank, (void **)&j.y);
    if (st || a->count[0] == 0) return st;
    split_work(lowrank_rows, &j, (j.rows + LOWRANK_ROWS - 1) / LOWRANK_ROWS, (int64_t)a->count[0] * (8 + 2 * k));
    return NULL;
}

/* ------------------------------------------------------------ cross-entropy */
/* e^a to about a float ulp: a = n ln2 + r, |r| <= ln2 / 2 (ln2 in two parts, so
 * n * ln2's high part is exact), e^r by its Taylor polynomial of degree 7
 * (truncation below 6e-9), times 2^n from the exponent bits.  0 below -87.3
 * (under FLT_MIN), NaN stays NaN.  No branches: the loops calling it vectorize. */
#define EXP_ZERO_BELOW (-87.3f)
static inline float exp_of(float a) {
    const float x = a < EXP_ZERO_BELOW ? EXP_ZERO_BELOW : (a > 88.0f ? 88.0f : a);
    const float shift = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (x * 1.44269504f + shift) - shift;
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    const float v = p * scale;
    return a != a ? a : (a < EXP_ZERO_BELOW ? 0.0f : v);
}

/* Eight floats as one vector (GCC's and Clang's vector extension: any
 * target, the compiler splitting it where its registers are narrower). */
typedef float F8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));
/* The lanes of v in the order given (GCC's and Clang's spellings). */
#if defined(__clang__)
#define LANES(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define LANES(v, ...) __builtin_shuffle(v, (I8){__VA_ARGS__})
#endif

/* m = the larger of v and m, lane by lane, as v > m ? v : m (a NaN v never
 * wins): a compare and a select, where the compiler would need a licence for a
 * max.  (Vectors by pointer: no vector in a call's ABI.) */
static inline void keep_max(F8 *m, const F8 *v) {
    const I8 gt = *v > *m;
    *m = (F8)((gt & (I8)*v) | (~gt & (I8)*m));
}

/* The largest of the eight lanes, then of x[i..d) (a NaN never wins). */
static inline float max_rest(const F8 *mk, const float *x, int64_t i, int64_t d) {
    float mx = (*mk)[0];
    for (int k = 1; k < 8; ++k) mx = (*mk)[k] > mx ? (*mk)[k] : mx;
    for (; i < d; ++i) mx = x[i] > mx ? x[i] : mx;
    return mx;
}

/* The largest of x[0..d) (eight running maxima from x[0]; a NaN never wins a comparison). */
static inline float row_max(const float *x, int64_t d) {
    F8 mk = {x[0], x[0], x[0], x[0], x[0], x[0], x[0], x[0]};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        F8 v;
        memcpy(&v, x + i, sizeof(v));
        keep_max(&mk, &v);
    }
    return max_rest(&mk, x, i, d);
}

/* out[i] = e^(x[i] - mx) (out may be x); their sum in double (SUM8's order). */
static inline double exp_sum(const float *x, float mx, float *out, int64_t d) {
    for (int64_t i = 0; i < d; ++i) out[i] = exp_of(x[i] - mx);
    double sum;
    SUM8(sum, d, t, (double)out[t]);
    return sum;
}

/* ------------------------------------------------------------ masked softmax */
/* y = x + m over a row, and the largest y, in one pass (eight running maxima
 * from -inf: a row of NaN and -inf gets -inf, which makes it NaN below as
 * row_max's NaN or -inf does). */
static inline float add_max(const float *x, const float *m, float *y, int64_t d) {
    F8 mk = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        F8 a, b;
        memcpy(&a, x + i, sizeof(a));
        memcpy(&b, m + i, sizeof(b));
        const F8 v = a + b;
        memcpy(y + i, &v, sizeof(v));
        keep_max(&mk, &v);
    }
    for (int64_t t = i; t < d; ++t) y[t] = x[t] + m[t];
    return max_rest(&mk, y, i, d);
}

/* The row's length without its tail of values v with v - mx under
 * EXP_ZERO_BELOW (e^(v - mx) = 0 there): eight at a time from the end, then
 * one at a time. */
static inline int64_t kept_length(const float *y, float mx, int64_t d) {
    const F8 top = {mx, mx, mx, mx, mx, mx, mx, mx};
    const F8 below = {EXP_ZERO_BELOW, EXP_ZERO_BELOW, EXP_ZERO_BELOW, EXP_ZERO_BELOW,
                      EXP_ZERO_BELOW, EXP_ZERO_BELOW, EXP_ZERO_BELOW, EXP_ZERO_BELOW};
    int64_t hi = d;
    while (hi >= 8) {
        F8 v;
        memcpy(&v, y + hi - 8, sizeof(v));
        const I8 under = v - top < below; /* lanes of all ones where under */
        const I8 half = under & LANES(under, 4, 5, 6, 7, 0, 1, 2, 3);
        const I8 quarter = half & LANES(half, 2, 3, 0, 1, 2, 3, 0, 1);
        if (!(quarter[0] & quarter[1])) break;
        hi -= 8;
    }
    while (hi > 0 && y[hi - 1] - mx < EXP_ZERO_BELOW) --hi;
    return hi;
}

typedef struct {
    const float *in[2];
    float *y;
    int64_t d, rank;
    int64_t dims[8], stride[2][8]; /* y's dims; each input's strides, 0 where it broadcasts */
    int64_t *kept;                 /* (opt) each row: its length past which it is all +0 */
} MaskedJob;

/* y = the softmax of the row of sums y (mx their largest) whose values past
 * y[len] are -inf (not read), in place; the length past which it is all +0
 * (kept).  A row's masked tail (a causal
 * mask's keys after the query) is e^(v - max) = 0 by exp_of's own test, so it
 * is written as 0 without the exp; the sum is unchanged (its terms there are
 * +0).  A NaN row scales it too. */
static inline int64_t softmax_of_first(float *y, float mx, int64_t len, int64_t d) {
    const int64_t hi = kept_length(y, mx, len);
    const float inv = (float)(1.0 / exp_sum(y, mx, y, hi));
    for (int64_t i = hi; i < d; ++i) y[i] = 0.0f;
    const int64_t end = inv != inv ? d : hi;
    for (int64_t i = 0; i < end; ++i) y[i] = y[i] * inv;
    return end;
}

/* The same of a whole row of sums. */
static inline int64_t softmax_of_sums(float *y, float mx, int64_t d) { return softmax_of_first(y, mx, d, d); }

/* The row's v = x + m (x contiguous, m by stride sm, 0: one value) into y
 * (may be x), and the largest v, as the masked softmax takes them. */
static inline float sum_row(const float *x, const float *m, int64_t sm, float *y, int64_t d) {
    if (sm == 1) return add_max(x, m, y, d);
    for (int64_t i = 0; i < d; ++i) y[i] = x[i] + m[i * sm];
    return row_max(y, d);
}

/* Each row: v = a + b (the Add's float sums, broadcast), its max (eight
 * running maxima), e^(v - max), the sum in double, y = e * (1 / sum): the Add
 * and the Softmax over the last axis without writing a + b.  A row with a
 * NaN, or all -inf (a fully masked row), is NaN, as the standard Softmax's is. */
CLONES static void masked_softmax_rows(void *arg, int64_t b, int64_t e) {
    const MaskedJob *j = (const MaskedJob *)arg;
    const int64_t d = j->d, sa = j->stride[0][j->rank - 1], sb = j->stride[1][j->rank - 1];
    for (int64_t row = b; row < e; ++row) {
        const float *x = j->in[0] + row_offset(row, j->dims, j->rank - 1, j->stride[0]);
        const float *m = j->in[1] + row_offset(row, j->dims, j->rank - 1, j->stride[1]);
        float *y = j->y + row * d;
        float mx;
        if (sa && sb) {
            mx = add_max(x, m, y, d);
        } else {
            for (int64_t i = 0; i < d; ++i) y[i] = x[i * sa] + m[i * sb];
            mx = row_max(y, d);
        }
        const int64_t end = softmax_of_sums(y, mx, d);
        if (j->kept) j->kept[row] = end;
    }
}

static OrtStatus *masked_softmax(const LlmOp *op, Args *a) {
    const size_t rank = a->rank[0] > a->rank[1] ? a->rank[0] : a->rank[1];
    if (rank < 1 || rank > 8) return llm_fail(op, "expects inputs of rank 1 to 8");
    MaskedJob j;
    memset(&j, 0, sizeof(j));
    j.in[0] = a->data[0];
    j.in[1] = a->data[1];
    j.rank = (int64_t)rank;
    for (int64_t k = (int64_t)rank - 1; k >= 0; --k) { /* the Add's output dims */
        int64_t dk[2];
        for (int t = 0; t < 2; ++t) {
            const int64_t at = k - ((int64_t)rank - (int64_t)a->rank[t]);
            dk[t] = at >= 0 ? a->dims[t][at] : 1;
        }
        j.dims[k] = dk[0] == 1 ? dk[1] : dk[0];
    }
    if (!broadcast_into(j.dims, rank, a->dims[0], a->rank[0], j.stride[0]) ||
        !broadcast_into(j.dims, rank, a->dims[1], a->rank[1], j.stride[1]))
        return llm_fail(op, "the inputs do not broadcast together");
    j.d = j.dims[rank - 1];
    OrtStatus *st = llm_output(op, a, 0, j.dims, rank, (void **)&j.y);
    if (!st) st = llm_output(op, a, 1, j.dims, rank - 1, (void **)&j.kept);
    int64_t count = 1;
    for (size_t k = 0; k < rank; ++k) count *= j.dims[k];
    if (st || count == 0) return st;
    split_work(masked_softmax_rows, &j, count / j.d, count * 8);
    return NULL;
}

typedef struct {
    const float *x, *v;
    const int64_t *t;
    double *lse;
    const double *lse_in;
    float *out;
    int64_t c;
} XentJob;

/* Each row: its max, e^(x - max) into a row buffer, its sum in double:
 * lse = max + log(sum).  A NaN anywhere makes the sum NaN. */
CLONES static void xent_rows(void *arg, int64_t b, int64_t e) {
    const XentJob *j = (const XentJob *)arg;
    const int64_t c = j->c;
    float *buf = malloc((size_t)c * sizeof(float));
    for (int64_t row = b; row < e; ++row) {
        const float *x = j->x + row * c;
        if (!buf) {
            j->lse[row] = NAN; /* (no memory: xent() reports it) */
            continue;
        }
        const float mx = row_max(x, c);
        j->lse[row] = (double)mx + log(exp_sum(x, mx, buf, c));
    }
    free(buf);
}

static OrtStatus *xent(const LlmOp *op, Args *a) {
    if (a->rank[0] != 2 || a->count[1] != (size_t)a->dims[0][0] || a->count[2] != 1)
        return llm_fail(op, "expects scores [N, C], target [N] and one ignore index");
    const int64_t n = a->dims[0][0], c = a->dims[0][1];
    const int64_t *t = a->data[1], ignore = *(const int64_t *)a->data[2];
    if (c <= 0) return llm_fail(op, "expects at least one class");
    for (int64_t row = 0; row < n; ++row)
        if (t[row] != ignore && (t[row] < 0 || t[row] >= c)) return llm_fail(op, "a target is out of range");
    XentJob j = {a->data[0], NULL, t, NULL, NULL, NULL, c};
    float *loss = NULL;
    OrtStatus *st = llm_output(op, a, 0, NULL, 0, (void **)&loss);
    if (!st) st = llm_output(op, a, 1, a->dims[1], 1, (void **)&j.lse);
    if (st) return st;
    split_work(xent_rows, &j, n, (int64_t)a->count[0] * 4);
    double total = 0.0, kept = 0.0; /* in row order, whatever the split */
    for (int64_t row = 0; row < n; ++row)
        if (t[row] != ignore) {
            if (j.lse[row] != j.lse[row] && !(j.x[row * c] != j.x[row * c])) {
                int nan = 0; /* a NaN lse without a NaN score: the row buffer was not to be had */
                for (int64_t i = 0; i < c; ++i) nan |= j.x[row * c + i] != j.x[row * c + i];
                if (!nan) return llm_fail(op, "out of memory");
            }
            total += j.lse[row] - (double)j.x[row * c + t[row]];
            kept += 1.0;
        }
    *loss = (float)(total / kept); /* no kept row: 0 / 0, NaN, as the standard mean */
    return NULL;
}

CLONES static void xent_grad_rows(void *arg, int64_t b, int64_t e) {
    const XentJob *j = (const XentJob *)arg;
    const int64_t c = j->c;
    for (int64_t row = b; row < e; ++row) {
        const float *x = j->x + row * c;
        float *d = j->out + row * c;
        const double lse = j->lse_in[row];
        const float v = j->v[row];
        for (int64_t i = 0; i < c; ++i) d[i] = 0.0f - exp_of((float)((double)x[i] - lse)) * v;
        const int64_t t = j->t[row];
        d[t] = v - exp_of((float)((double)x[t] - lse)) * v;
    }
}

static OrtStatus *xent_grad(const LlmOp *op, Args *a) {
    if (a->rank[0] != 2) return llm_fail(op, "expects scores [N, C]");
    const int64_t n = a->dims[0][0], c = a->dims[0][1];
    if ((int64_t)a->count[1] != n || (int64_t)a->count[2] != n || (int64_t)a->count[3] != n)
        return llm_fail(op, "expects lse, target and v with one value per row of scores");
    const int64_t *t = a->data[2];
    for (int64_t row = 0; row < n; ++row)
        if (t[row] < 0 || t[row] >= c) return llm_fail(op, "a target is out of range");
    XentJob j = {a->data[0], a->data[3], t, NULL, a->data[1], NULL, c};
    OrtStatus *st = llm_output(op, a, 0, a->dims[0], 2, (void **)&j.out);
    if (st) return st;
    split_work(xent_grad_rows, &j, n, (int64_t)a->count[0] * 8);
    return NULL;
}

/* ------------------------------------------------------------ products over zero tails */
/* A causal or padding mask leaves attention's probabilities p, and their
 * gradient, exactly zero past each row's last kept key, and the products
 * that read them (o = p v, dv = p^T do, dq = ds k, dk^T = q^T ds) multiply
 * those zeros all the same: about half of the work under a causal mask.
 * These kernels find each row's length to its last nonzero (any value but
 * +-0: NaN counts) and leave out the products of the zeros past it; the
 * rest is summed over k in chunks of TAIL_CHUNK by fused multiply-adds,
 * the chunks' sums then in order, in blocks of TAIL_ROWS x TAIL_COLS sums
 * kept in registers, then multiplied by alpha
 * (the Mul that scaled the product) where given.  Only what a zero times a
 * finite value adds (+-0) is left out: where the other operand holds an
 * infinity or a NaN facing a skipped zero, the standard product is NaN and
 * these are not. */
enum { TAIL_A, TAIL_AT, TAIL_B }; /* the tailed operand: a [m, k]; a stored [k, m] (out = a^T b); b [k, n] */
#define TAIL_ROWS 8
#define TAIL_COLS 32
#define TAIL_CHUNK 32 /* k summed by chunks, their sums then in order: closer to the exact sum */

typedef struct {
    const float *a, *b, *tailed;
    float *out;
    float alpha;
    int scaled, mode;
    int64_t m, k, n, batch, tail_rows, tail_len, blocks;
    int64_t *kept; /* [batch, tail_rows] */
} TailJob;

static void tail_lengths(void *arg, int64_t b, int64_t e) {
    const TailJob *j = (const TailJob *)arg;
    for (int64_t r = b; r < e; ++r) j->kept[r] = nonzero_length(j->tailed + r * j->tail_len, j->tail_len);
}

/* The k range [*k0, *k1) outside which the block of rows [r0, r0 + rows) and
 * columns from c0 multiplies only zeros of the tailed operand. */
static inline void tail_range(const TailJob *j, const int64_t *kept, int64_t r0, int64_t rows, int64_t c0,
                              int64_t *k0, int64_t *k1) {
    if (j->mode == TAIL_A) {
        int64_t hi = 0;
        for (int64_t q = 0; q < rows; ++q) hi = kept[r0 + q] > hi ? kept[r0 + q] : hi;
        *k0 = 0, *k1 = hi;
        return;
    }
    const int64_t from = j->mode == TAIL_AT ? r0 : c0; /* row kk reaches the block where kept[kk] > from */
    int64_t lo = j->k, hi = 0;
    for (int64_t kk = 0; kk < j->k; ++kk)
        if (kept[kk] > from) {
            lo = kk < lo ? kk : lo;
            hi = kk + 1;
        }
    *k0 = lo, *k1 = hi > lo ? hi : lo;
}

/* out's rows [r0, r0 + rows) x columns [c0, c0 + TAIL_COLS), a's element (r,
 * kk) at a[r * sr + kk * sk].  Each chunk's sums stay in registers (TAIL_ROWS
 * x TAIL_COLS: 16 of AVX-512's 32 vector registers), then go into the
 * block of out, which holds the sum of the chunks before (in cache: the
 * block is small) and is scaled at the end.  A chunk starts from its first
 * product plus +0, and the first chunk is added to +0, as a sum from +0 would
 * be (a lone -0 product sums to +0). */
static inline __attribute__((always_inline)) void tail_block(const TailJob *j, const float *a, int64_t sr, int64_t sk,
                                                             const float *b, float *out, int64_t r0, int64_t rows,
                                                             int64_t c0, int64_t k0, int64_t k1) {
    float part[TAIL_ROWS][TAIL_COLS];
    float *o = out + r0 * j->n + c0;
    const int64_t n = j->n;
    if (k1 <= k0)
        for (int q = 0; q < rows; ++q)
            for (int t = 0; t < TAIL_COLS; ++t) o[q * n + t] = 0.0f;
    for (int64_t kc = k0; kc < k1; kc += TAIL_CHUNK) {
        const int64_t kend = kc + TAIL_CHUNK < k1 ? kc + TAIL_CHUNK : k1;
        {
            const float *br = b + kc * n + c0;
            for (int q = 0; q < TAIL_ROWS; ++q) {
                const float av = q < rows ? a[(r0 + q) * sr + kc * sk] : 0.0f;
                for (int t = 0; t < TAIL_COLS; ++t) part[q][t] = fmaf(av, br[t], 0.0f);
            }
        }
        for (int64_t kk = kc + 1; kk < kend; ++kk) {
            const float *br = b + kk * n + c0;
            for (int q = 0; q < TAIL_ROWS; ++q) {
                const float av = q < rows ? a[(r0 + q) * sr + kk * sk] : 0.0f;
                for (int t = 0; t < TAIL_COLS; ++t) part[q][t] = fmaf(av, br[t], part[q][t]);
            }
        }
        if (kc == k0)
            for (int q = 0; q < rows; ++q)
                for (int t = 0; t < TAIL_COLS; ++t) o[q * n + t] = 0.0f + part[q][t];
        else
            for (int q = 0; q < rows; ++q)
                for (int t = 0; t < TAIL_COLS; ++t) o[q * n + t] += part[q][t];
    }
    if (j->scaled)
        for (int q = 0; q < rows; ++q)
            for (int t = 0; t < TAIL_COLS; ++t) o[q * n + t] *= j->alpha;
}

static inline float tail_one(const TailJob *j, const float *a, int64_t sr, int64_t sk, const float *b, int64_t r,
                             int64_t c, int64_t k0, int64_t k1) {
    float acc = 0.0f;
    for (int64_t kc = k0; kc < k1; kc += TAIL_CHUNK) {
        const int64_t kend = kc + TAIL_CHUNK < k1 ? kc + TAIL_CHUNK : k1;
        float part = 0.0f;
        for (int64_t kk = kc; kk < kend; ++kk) part = fmaf(a[r * sr + kk * sk], b[kk * j->n + c], part);
        acc += part;
    }
    return j->scaled ? acc * j->alpha : acc;
}

/* TAIL_A's and TAIL_AT's items: blocks of TAIL_ROWS rows of one matrix of the batch. */
FMA_CLONES static void tail_items(void *arg, int64_t b, int64_t e) {
    const TailJob *j = (const TailJob *)arg;
    const int64_t sr = j->mode == TAIL_AT ? 1 : j->k, sk = j->mode == TAIL_AT ? j->m : 1;
    const int64_t cols = j->n - j->n % TAIL_COLS;
    for (int64_t item = b; item < e; ++item) {
        const int64_t bi = item / j->blocks, r0 = item % j->blocks * TAIL_ROWS;
        const int64_t rows = j->m - r0 < TAIL_ROWS ? j->m - r0 : TAIL_ROWS;
        const float *a = j->a + bi * j->m * j->k, *bm = j->b + bi * j->k * j->n;
        float *out = j->out + bi * j->m * j->n;
        const int64_t *kept = j->kept + bi * j->tail_rows;
        int64_t k0, k1;
        tail_range(j, kept, r0, rows, 0, &k0, &k1);
        for (int64_t c0 = 0; c0 < cols; c0 += TAIL_COLS) {
            if (rows == TAIL_ROWS)
                tail_block(j, a, sr, sk, bm, out, r0, TAIL_ROWS, c0, k0, k1);
            else
                tail_block(j, a, sr, sk, bm, out, r0, rows, c0, k0, k1);
        }
        if (cols < j->n) {
            for (int64_t q = 0; q < rows; ++q)
                for (int64_t c = cols; c < j->n; ++c)
                    out[(r0 + q) * j->n + c] = tail_one(j, a, sr, sk, bm, r0 + q, c, k0, k1);
        }
    }
}

/* TAIL_B's items: blocks of TAIL_COLS columns of one matrix (the last may be
 * narrower), each over all rows: the block's rows of b, which its k range
 * depends on, stay in cache across the row blocks. */
FMA_CLONES static void tail_col_items(void *arg, int64_t b, int64_t e) {
    const TailJob *j = (const TailJob *)arg;
    const int64_t cblocks = (j->n + TAIL_COLS - 1) / TAIL_COLS;
    for (int64_t item = b; item < e; ++item) {
        const int64_t bi = item / cblocks, c0 = item % cblocks * TAIL_COLS;
        const float *a = j->a + bi * j->m * j->k, *bm = j->b + bi * j->k * j->n;
        float *out = j->out + bi * j->m * j->n;
        int64_t k0, k1;
        tail_range(j, j->kept + bi * j->tail_rows, 0, 0, c0, &k0, &k1);
        for (int64_t r0 = 0; r0 < j->m; r0 += TAIL_ROWS) {
            const int64_t rows = j->m - r0 < TAIL_ROWS ? j->m - r0 : TAIL_ROWS;
            if (c0 + TAIL_COLS > j->n) {
                for (int64_t q = 0; q < rows; ++q)
                    for (int64_t c = c0; c < j->n; ++c)
                        out[(r0 + q) * j->n + c] = tail_one(j, a, j->k, 1, bm, r0 + q, c, k0, k1);
            } else if (rows == TAIL_ROWS) {
                tail_block(j, a, j->k, 1, bm, out, r0, TAIL_ROWS, c0, k0, k1);
            } else {
                tail_block(j, a, j->k, 1, bm, out, r0, rows, c0, k0, k1);
            }
        }
    }
}

/* a [.., M, K] (TAIL_AT: [.., K, M]), b [.., K, N], alpha (opt, one value) -> out [.., M, N]. */
static OrtStatus *tail_product(const LlmOp *op, Args *a, int mode) {
    const size_t rank = a->rank[0];
    if (rank < 2 || a->rank[1] != rank || memcmp(a->dims[0], a->dims[1], (rank - 2) * sizeof(int64_t)))
        return llm_fail(op, "expects a [.., M, K] and b [.., K, N] with one leading shape");
    TailJob j;
    memset(&j, 0, sizeof(j));
    j.mode = mode;
    j.m = a->dims[0][rank - (mode == TAIL_AT ? 1 : 2)];
    j.k = a->dims[0][rank - (mode == TAIL_AT ? 2 : 1)];
    j.n = a->dims[1][rank - 1];
    if (a->dims[1][rank - 2] != j.k) return llm_fail(op, "a's and b's inner dims differ");
    if (a->data[2]) {
        if (a->count[2] != 1) return llm_fail(op, "alpha is one value");
        j.scaled = 1, j.alpha = *(const float *)a->data[2];
    }
    int64_t dims[8];
    memcpy(dims, a->dims[0], (rank - 2) * sizeof(int64_t));
    dims[rank - 2] = j.m, dims[rank - 1] = j.n;
    j.batch = 1;
    for (size_t i = 0; i + 2 < rank; ++i) j.batch *= dims[i];
    j.a = a->data[0], j.b = a->data[1];
    OrtStatus *st = llm_output(op, a, 0, dims, rank, (void **)&j.out);
    if (st || j.batch * j.m * j.n == 0) return st;
    j.tailed = mode == TAIL_B ? j.b : j.a;
    j.tail_rows = mode == TAIL_A ? j.m : j.k;
    j.tail_len = mode == TAIL_A ? j.k : mode == TAIL_AT ? j.m : j.n;
    int64_t *scanned = NULL;
    if (a->data[3]) { /* the rows' bounds from the kernel that wrote the tailed operand */
        if ((int64_t)a->count[3] != j.batch * j.tail_rows) return llm_fail(op, "kept has one value per tailed row");
        const int64_t *kept = (const int64_t *)a->data[3];
        for (int64_t r = 0; r < j.batch * j.tail_rows; ++r)
            if (kept[r] < 0 || kept[r] > j.tail_len) return llm_fail(op, "a kept length is out of range");
        j.kept = (int64_t *)kept;
    } else {
        scanned = (int64_t *)malloc((size_t)(j.batch * j.tail_rows) * sizeof(int64_t) + 1);
        if (!scanned) return llm_fail(op, "out of memory");
        j.kept = scanned;
        split_work(tail_lengths, &j, j.batch * j.tail_rows, j.batch * j.tail_rows * j.tail_len * 2);
    }
    const int64_t bytes = j.batch * (j.m * j.k + j.k * j.n + j.m * j.n) * 4;
    j.blocks = (j.m + TAIL_ROWS - 1) / TAIL_ROWS;
    if (mode == TAIL_B)
        split_work(tail_col_items, &j, j.batch * ((j.n + TAIL_COLS - 1) / TAIL_COLS), bytes);
    else
        split_work(tail_items, &j, j.batch * j.blocks, bytes);
    free(scanned);
    return NULL;
}

static OrtStatus *tail_matmul(const LlmOp *op, Args *a) { return tail_product(op, a, TAIL_A); }
static OrtStatus *tail_matmul_ta(const LlmOp *op, Args *a) { return tail_product(op, a, TAIL_AT); }
static OrtStatus *tail_matmul_b(const LlmOp *op, Args *a) { return tail_product(op, a, TAIL_B); }

/* ------------------------------------------------------------ the scores' product in the masked softmax */
/* y = Softmax(a b + mask) over the last axis, without writing a b: each block
 * of TAIL_ROWS rows of the scores is summed (as the tail products sum) into
 * the rows of y, then each row takes the mask and the softmax as
 * MaskedSoftmaxF32's rows do.  A row's columns past its mask's last value that
 * is not -inf are not multiplied: a finite score there gives -inf, e^-inf =
 * 0, and they take +0 in its place.  (A NaN or +inf score facing the mask's
 * -inf makes the standard row NaN; here it is left out, as the tail
 * products leave out what faces a skipped zero.) */
typedef struct {
    TailJob t; /* the product: t.a [.., M, K], t.b [.., K, N], t.out = y */
    const float *mask;
    int64_t rank, dims[8], stride[8]; /* y's dims; the mask's strides into them */
    int64_t *kept;
} ScoresJob;

/* The length of the mask's row (stride sm; 0: one value) to its last value that is not -inf. */
static inline int64_t unmasked_length(const float *m, int64_t sm, int64_t d) {
    int64_t hi = d;
    if (sm == 1)
        while (hi >= 16) { /* sixteen at a time from the end */
            int all = 1;
            for (int t = 0; t < 16; ++t) all &= m[hi - 16 + t] == -INFINITY;
            if (!all) break;
            hi -= 16;
        }
    while (hi > 0 && m[(hi - 1) * sm] == -INFINITY) --hi;
    return hi;
}

FMA_CLONES static void scores_items(void *arg, int64_t b, int64_t e) {
    const ScoresJob *j = (const ScoresJob *)arg;
    const TailJob *t = &j->t;
    const int64_t d = t->n, sm = j->stride[j->rank - 1];
    for (int64_t item = b; item < e; ++item) {
        const int64_t bi = item / t->blocks, r0 = item % t->blocks * TAIL_ROWS;
        const int64_t rows = t->m - r0 < TAIL_ROWS ? t->m - r0 : TAIL_ROWS;
        const float *a = t->a + bi * t->m * t->k, *bm = t->b + bi * t->k * t->n, *mrow[TAIL_ROWS];
        float *out = t->out + bi * t->m * d;
        int64_t len[TAIL_ROWS], cols = 0;
        for (int64_t q = 0; q < rows; ++q) {
            mrow[q] = j->mask + row_offset(bi * t->m + r0 + q, j->dims, j->rank - 1, j->stride);
            len[q] = unmasked_length(mrow[q], sm, d);
            cols = len[q] > cols ? len[q] : cols;
        }
        int64_t c0 = 0;
        for (; c0 + TAIL_COLS <= d && c0 < cols; c0 += TAIL_COLS) {
            if (rows == TAIL_ROWS)
                tail_block(t, a, t->k, 1, bm, out, r0, TAIL_ROWS, c0, 0, t->k);
            else
                tail_block(t, a, t->k, 1, bm, out, r0, rows, c0, 0, t->k);
        }
        for (int64_t q = 0; q < rows; ++q) {
            float *y = out + (r0 + q) * d;
            for (int64_t c = c0; c < len[q]; ++c) y[c] = tail_one(t, a, t->k, 1, bm, r0 + q, c, 0, t->k);
            /* (past len, sums of -inf: they change no max, and are written as +0;
             * a row all -inf is NaN, as MaskedSoftmaxF32's) */
            if (!len[q])
                for (int64_t c = 0; c < d; ++c) y[c] = -INFINITY;
            const float mx = len[q] ? sum_row(y, mrow[q], sm, y, len[q]) : -INFINITY;
            const int64_t end = softmax_of_first(y, mx, len[q] ? len[q] : d, d);
            if (j->kept) j->kept[bi * t->m + r0 + q] = end;
        }
    }
}

/* a [.., M, K], b [.., K, N] (one leading shape), mask (broadcast into [.., M, N]) -> y, kept (opt). */
static OrtStatus *matmul_masked_softmax(const LlmOp *op, Args *a) {
    const size_t rank = a->rank[0];
    if (rank < 2 || rank > 8 || a->rank[1] != rank || memcmp(a->dims[0], a->dims[1], (rank - 2) * sizeof(int64_t)))
        return llm_fail(op, "expects a [.., M, K] and b [.., K, N] with one leading shape");
    ScoresJob j;
    memset(&j, 0, sizeof(j));
    j.t.m = a->dims[0][rank - 2], j.t.k = a->dims[0][rank - 1], j.t.n = a->dims[1][rank - 1];
    if (a->dims[1][rank - 2] != j.t.k) return llm_fail(op, "a's and b's inner dims differ");
    memcpy(j.dims, a->dims[0], (rank - 1) * sizeof(int64_t));
    j.dims[rank - 1] = j.t.n;
    j.rank = (int64_t)rank;
    if (!broadcast_into(j.dims, rank, a->dims[2], a->rank[2], j.stride))
        return llm_fail(op, "the mask does not broadcast into the scores");
    if (j.t.n == 0) return llm_fail(op, "the scores' rows are empty");
    j.t.batch = 1;
    for (size_t i = 0; i + 2 < rank; ++i) j.t.batch *= j.dims[i];
    j.t.a = a->data[0], j.t.b = a->data[1], j.mask = a->data[2];
    OrtStatus *st = llm_output(op, a, 0, j.dims, rank, (void **)&j.t.out);
    if (!st) st = llm_output(op, a, 1, j.dims, rank - 1, (void **)&j.kept);
    if (st || j.t.batch * j.t.m == 0) return st;
    j.t.blocks = (j.t.m + TAIL_ROWS - 1) / TAIL_ROWS;
    split_work(scores_items, &j, j.t.batch * j.t.blocks,
               j.t.batch * (j.t.m * j.t.k + j.t.k * j.t.n + 2 * j.t.m * j.t.n) * 4);
    return NULL;
}

/* ------------------------------------------------------------ n-bit weights */
typedef struct {
    const uint8_t *b, *zp;
    const float *scales, *zpf;
    float *w;
    int64_t k, blocks, block, bits, blob, zp_row;
} NBitsJob;

/* Code i of a row of bytes packed ``bits`` at a time, low bits first. */
static inline int code_at(const uint8_t *row, int64_t i, int64_t bits) {
    const int64_t bit = i * bits;
    return (row[bit >> 3] >> (bit & 7)) & ((1 << bits) - 1);
}

CLONES static void dequantize_rows(void *arg, int64_t b, int64_t e) {
    const NBitsJob *j = (const NBitsJob *)arg;
    const float center = (float)(1 << (j->bits - 1));
    for (int64_t n = b; n < e; ++n) {
        const uint8_t *row = j->b + n * j->blocks * j->blob;
        float *w = j->w + n * j->k;
        for (int64_t blk = 0; blk < j->blocks; ++blk) {
            const int64_t at = n * j->blocks + blk;
            const float z = j->zp ? (float)code_at(j->zp + n * j->zp_row, blk, j->bits) : j->zpf ? j->zpf[at] : center;
            const float scale = j->scales[at];
            const int64_t first = blk * j->block, stop = first + j->block < j->k ? first + j->block : j->k;
            const uint8_t *bytes = row + blk * j->blob;
            if (j->bits == 4) {
                for (int64_t i = first; i + 1 < stop; i += 2) {
                    const uint8_t v = bytes[(i - first) >> 1];
                    w[i] = ((float)(v & 15) - z) * scale;
                    w[i + 1] = ((float)(v >> 4) - z) * scale;
                }
                if ((stop - first) & 1) w[stop - 1] = ((float)(bytes[(stop - 1 - first) >> 1] & 15) - z) * scale;
            } else {
                for (int64_t i = first; i < stop; ++i) w[i] = ((float)code_at(bytes, i - first, j->bits) - z) * scale;
            }
        }
    }
}

static OrtStatus *dequantize_nbits(const LlmOp *op, Args *a) {
    if (a->count[2] != 4) return llm_fail(op, "G must hold K, N, bits and block_size");
    const int64_t *g = a->data[2];
    const int64_t k = g[0], n = g[1], bits = g[2], block = g[3];
    if (k <= 0 || n <= 0 || !(bits == 2 || bits == 4 || bits == 8) || block < 1 || (block * bits) % 8)
        return llm_fail(op, "bad geometry: K, N > 0, bits 2, 4 or 8, block_size a whole number of bytes");
    const int64_t blocks = (k + block - 1) / block, blob = block * bits / 8;
    if ((int64_t)a->count[0] != n * blocks * blob) return llm_fail(op, "B must hold N x blocks x blob bytes");
    if ((int64_t)a->count[1] != n * blocks) return llm_fail(op, "scales must hold N x blocks values");
    NBitsJob j = {a->data[0], a->data[3], a->data[1], a->data[4], NULL, k, blocks, block, bits, blob, 0};
    if (j.zp) {
        j.zp_row = (int64_t)a->count[3] / n;
        if (j.zp_row * n != (int64_t)a->count[3] || j.zp_row * 8 < blocks * bits)
            return llm_fail(op, "packed zero points must hold a row of codes for each of N");
    }
    if (j.zpf && (int64_t)a->count[4] != n * blocks) return llm_fail(op, "float zero points must be N x blocks");
    const int64_t dims[2] = {n, k};
    OrtStatus *st = llm_output(op, a, 0, dims, 2, (void **)&j.w);
    if (st) return st;
    split_work(dequantize_rows, &j, n, n * k * 4);
    return NULL;
}

static OrtStatus *llm_compute(void *kernel, OrtKernelContext *ctx) { COMPUTE_WITH(ctx, llm_compute_in(kernel, ctx)); }

/* ------------------------------------------------------------ op table */
static const LlmOp *as_llm(const CustomOp *op) { return (const LlmOp *)op; }
static void llm_compute_v1(void *kernel, OrtKernelContext *ctx) {
    OrtStatus *st = llm_compute(kernel, ctx);
    if (st) API(API_ReleaseStatus, ReleaseStatusFn)(st);
}
static const char *llm_name(const CustomOp *op) { return as_llm(op)->name; }
static int llm_in_type(const CustomOp *op, size_t i) { return as_llm(op)->in_type[i]; }
static size_t llm_in_count(const CustomOp *op) { return (size_t)as_llm(op)->n_in; }
static int llm_out_type(const CustomOp *op, size_t i) { return as_llm(op)->out_type[i]; }
static size_t llm_out_count(const CustomOp *op) { return (size_t)as_llm(op)->n_out; }
static int llm_in_char(const CustomOp *op, size_t i) {
    if (as_llm(op)->variadic && i + 1 == (size_t)as_llm(op)->n_in) return INPUT_OUTPUT_VARIADIC;
    return as_llm(op)->opt_in & (1u << i) ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}
static int llm_out_char(const CustomOp *op, size_t i) {
    return as_llm(op)->opt_out & (1u << i) ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

#define F ELEM_FLOAT
#define I ELEM_INT64
#define D ELEM_DOUBLE
#define L(...) (__VA_ARGS__)
#define ARRAY(...) {__VA_ARGS__}
#define LLM_OP(NAME, NI, IN, OPT_IN, NO, OUT, OPT_OUT, FN) LLM_OPV(NAME, NI, IN, OPT_IN, NO, OUT, OPT_OUT, FN, 0)
#define LLM_OPV(NAME, NI, IN, OPT_IN, NO, OUT, OPT_OUT, FN, VARIADIC)                                \
    {{16, op_create_kernel, llm_name, op_provider, llm_in_type, llm_in_count, llm_out_type, llm_out_count, \
      llm_compute_v1, op_destroy_kernel, llm_in_char, llm_out_char, op_default_memory, op_one, op_one,     \
      op_one, op_one, op_create_kernel_v2, llm_compute, NULL, NULL, NULL, NULL, NULL, NULL, NULL},         \
     NAME, NI, NO, ARRAY IN, ARRAY OUT, OPT_IN, OPT_OUT, FN, VARIADIC}

static LlmOp g_llm_ops[] = {
    LLM_OP("RmsNormF32", 3, L(F, F, F), 0, 4, L(F, F, F, F), 0xCu, rms_norm),
    LLM_OPV("RmsNormGradF32", 7, L(F, F, F, F, F, F, F), 0x20u, 1, L(F), 0, rms_norm_grad, 1),
    LLM_OP("SiluMulF32", 3, L(F, F, F), 0, 2, L(F, F), 0x2u, silu_mul),
    LLM_OP("SiluMulGradF32", 5, L(F, F, F, F, F), 0x10u, 2, L(F, F), 0x2u, silu_mul_grad),
    LLM_OP("RopeF32", 3, L(F, F, F), 0, 1, L(F), 0, rope),
    LLM_OP("RopeGradF32", 3, L(F, F, F), 0, 1, L(F), 0, rope_grad),
    LLM_OP("RotateHalvesF32", 3, L(F, F, F), 0, 1, L(F), 0, rotate_halves),
    LLM_OP("LowRankMatMulAddF32", 3, L(F, F, F), 0, 1, L(F), 0, lowrank_add),
    LLM_OP("LowRankTransAF32", 2, L(F, F), 0, 1, L(F), 0, lowrank_t),
    LLM_OP("SoftmaxGuardF32", 1, L(F), 0, 1, L(F), 0, softmax_guard),
    LLM_OP("SoftmaxGradF32", 2, L(F, F), 0, 2, L(F, I), 0x2u, softmax_grad),
    LLM_OP("SoftmaxGradPlainF32", 2, L(F, F), 0, 2, L(F, I), 0x2u, softmax_grad_plain),
    LLM_OP("MaskedSoftmaxF32", 2, L(F, F), 0, 2, L(F, I), 0x2u, masked_softmax),
    LLM_OP("MatMulMaskedSoftmaxF32", 3, L(F, F, F), 0, 2, L(F, I), 0x2u, matmul_masked_softmax),
    LLM_OP("CrossEntropyF32", 3, L(F, I, I), 0, 2, L(F, D), 0, xent),
    LLM_OP("CrossEntropyGradF32", 4, L(F, D, I, F), 0, 1, L(F), 0, xent_grad),
    LLM_OP("TailMatMulF32", 4, L(F, F, F, I), 0xCu, 1, L(F), 0, tail_matmul),
    LLM_OP("TailMatMulTransAF32", 4, L(F, F, F, I), 0xCu, 1, L(F), 0, tail_matmul_ta),
    LLM_OP("MatMulTailBF32", 4, L(F, F, F, I), 0xCu, 1, L(F), 0, tail_matmul_b),
    LLM_OP("DequantizeNBitsF32", 5, L(ELEM_UINT8, F, I, ELEM_UINT8, F), 0x18u, 1, L(F), 0, dequantize_nbits),
};

OrtStatus *onnxtrain_add_llm_ops(OrtCustomOpDomain *domain) {
    for (size_t i = 0; i < sizeof(g_llm_ops) / sizeof(g_llm_ops[0]); ++i) {
        OrtStatus *st = API(API_CustomOpDomain_Add, DomainAddFn)(domain, &g_llm_ops[i].op);
        if (st) return st;
    }
    return NULL;
}
