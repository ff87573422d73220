/* onnxtrain's fused kernels: an onnxruntime custom-op library.
 *
 * Ops per element type (F32: float, F64: double), in the domain
 * "ai.onnxtrain.kernels":
 *
 *   AdamUpdateF32 / AdamUpdateF64
 *     inputs : p, g, m, v, b1, c1, b2, c2, eps, step, decay
 *              (p, g, m, v of one shape; the other seven hold one element each)
 *     outputs: p_new, m_new, v_new
 *
 *     m_new = b1*m + c1*g
 *     v_new = b2*v + c2*(g*g)
 *     p_new = p*decay - step*(m_new / (sqrt(v_new) + eps))
 *
 * and the per-tensor updates of the ai.onnx.preview.training optimizers as
 * onnxtrain/optim/spec_ops.py writes them (the rules SpecAdam, Momentum,
 * Nesterov, Adagrad; nc is a WeightDecay call the kernel takes in).  These
 * take one-element scalars first (nc and post optional: '' when the lowering
 * has no such operation), then any number of tensors, k inputs each (a
 * variadic input: one node updates many tensors), and give per tensor its
 * new state in the order shown.  gr below is nc*x + g with nc, else g.
 *
 *   SpecAdamF32/F64  alpha, 1-alpha, beta, 1-beta, eps, r, [nc], [post];
 *                    (x, g, v, h)... -> (x', v', h')...
 *       v' = alpha*v + (1-alpha)*gr
 *       h' = beta*h + ((1-beta)*gr)*gr
 *       x' = x - (r*v') / (sqrt(h') + eps)        [then x' = post*x']
 *   MomentumF32/F64  alpha, beta, r, [nc];  (x, g, v)... -> (x', v')...
 *       v' = alpha*v + beta*gr;  x' = x - r*v'
 *   NesterovF32/F64  alpha, beta, alpha2, r, [nc];  (x, g, v)... -> (x', v')...
 *       v' = alpha*v + beta*gr;  x' = x - r*(gr + alpha2*v')
 *   AdagradF32/F64   eps, r, [nc];  (x, g, h)... -> (x', h')...
 *       h' = h + gr*gr;  x' = x - (r*gr) / (sqrt(h') + eps)
 *
 * and the step size of the spec's Adam, which the lowering writes as ten
 * one-element kernels (the rule AdamStepSize):
 *
 *   AdamStepSizeF32/F64  r, t (int64), one_h, beta, one_v, alpha, zero (int64)
 *                        -> r' (every input one element; r' of their
 *                        broadcast shape)
 *       T = (float or double) t
 *       r' = t > zero ? (r * sqrt(one_h - pow(beta, T))) / (one_v - pow(alpha, T)) : r
 *       with libm's powf/sqrtf (pow/sqrt for F64): what onnxruntime's Cast,
 *       Pow (std::pow of a scalar base), Sub, Sqrt, Mul, Div, Greater and
 *       Where compute, one operation each.
 *
 * and one forward op that onnxruntime runs slowly (fuse_layers.fuse_max_pools):
 *
 *   MaxPoolIndicesF32  X (float, N x C x H x W), G (int64: kh, kw, sh, sw,
 *                      pad_top, pad_left, oh, ow) -> Y (N x C x oh x ow), I
 *       MaxPool with its Indices output, 2-D, dilation 1, row-major indices,
 *       pads smaller than the window: per window, scanned row by row, the
 *       first element, replaced by each later one greater than the one kept;
 *       I = (n*C + c)*H*W + h*W + w.  These are the values onnxruntime's
 *       MaxPool gives, NaN, infinities and ties included (a NaN wins only
 *       as a window's first element).
 *       onnxruntime computes the Indices output in a general loop, 10-15x
 *       slower than MaxPool without it.
 *
 *   ReluGradF32 / ReluGradF64   y, dy -> dx (one shape)
 *       dx = (y > 0 ? dy : 0) + 0, the gradient of Relu as the rule writes it,
 *       Where(Greater(y, 0), dy, 0); onnxruntime's Where takes 10-30x the
 *       time of a Mul of the same size (fuse_layers.fuse_relu_grads).
 *
 * and, for convolution training (fuse_layers, nchwc.py):
 *
 *   Im2ColF32   X (N x C x H x W), G (kh, kw, sh, sw, dh, dw, pad_top,
 *               pad_left, oh, ow) -> the column matrix (C*kh*kw x N*oh*ow),
 *       row (c, i, j) = tap (i, j) of channel c over the batch, zero in the
 *       padding: what a weight gradient's strided Slices stack, in one pass.
 *   Col2ImF32   cols (C*kh*kw x N*oh*ow), G (the same ten, then C, N, H, W)
 *               -> Y (N x C x H x W): its inverse, summing taps in row
 *       order as onnxruntime's ConvTranspose does after its GEMM.
 *   ReorderFilterF32   W (M x C x kh x kw), G (block, flip, blocked) -> the
 *       filter in the layout of onnxruntime's NCHWc Conv (flip: that of the
 *       stride-1 transposed window, C x M, taps reversed).
 *   BatchNormGradF32   x, dy (N x C x ...), scale (C), eps (1) -> dx,
 *       dscale, dbias: training-mode BatchNormalization's gradient, sums in
 *       double (the same values to float32 rounding, not the same bits).
 *   ScatterAddZerosF32   size (1, int64), indices, updates -> zeros(size)
 *       with updates[k] added at indices[k] in order (MaxPool's gradient
 *       where windows overlap).
 *
 * Each optimizer op computes one update rule of onnxtrain/optim/updates.py
 * (AdamUpdate: the rule Adam, which the builder's Adam/AdamW and ONNX Runtime
 * training's AdamW apply; the others: the spec ops' rules), and takes the
 * operands the rule's FusedKernel names, in that order; kernels/fuse.py puts
 * it in place of each call of the rule.  In every op but BatchNormGrad, every operation is one
 * IEEE operation in the same order as in the standard kernels it replaces
 * (multiplication and addition are commutative in IEEE arithmetic, so operand
 * order does not matter), and the library is compiled with -ffp-contract=off
 * (no fused multiply-adds), so the results are bitwise those of the standard
 * kernels: one pass over memory instead of one per operation.
 *
 * The library needs no onnxruntime headers: ort_api.h declares the part of
 * the C API it uses.  llm_kernels.c, compiled into the same library, adds the
 * LLM training kernels to the domain (onnxtrain_add_llm_ops).
 */

#include "ort_api.h"

const OrtApi *g_api = NULL;
int g_pool = 0;

enum { KIND_ADAM_UPDATE, KIND_SPEC_ADAM, KIND_MOMENTUM, KIND_NESTEROV, KIND_ADAGRAD, KIND_MAX_POOL, KIND_RELU_GRAD,
       KIND_IM2COL, KIND_REORDER_FILTER, KIND_BN_GRAD, KIND_SCATTER_ADD, KIND_COL2IM, KIND_STEP_SIZE };

typedef struct OpDef {
    CustomOp op;          /* first member: ORT hands back &op */
    const char *name;
    int elem_type;
    int kind;
    /* Spec optimizer ops: leading one-element inputs, the slots of the
     * optional nc and post among them (-1: none), tensors in and out per
     * optimized tensor. */
    int n_scalars, nc_slot, post_slot, per_in, per_out;
} OpDef;

#define N_INPUTS 11
#define N_OUTPUTS 3
#define N_TENSORS 4
#define MAX_SCALARS 8

/* One element of the update: every operation rounds as the standard kernels do. */
#define ADAM_LOOP(T, SQRT)                                                                 \
    const T b1 = s[0], c1 = s[1], b2 = s[2], c2 = s[3], eps = s[4], step = s[5],           \
            decay = s[6];                                                                  \
    for (size_t i = 0; i < n; ++i) {                                                       \
        const T gi = g[i];                                                                 \
        const T m1 = b1 * m[i] + c1 * gi;                                                  \
        const T v1 = b2 * v[i] + c2 * (gi * gi);                                           \
        const T upd = step * (m1 / (SQRT(v1) + eps));                                      \
        pn[i] = p[i] * decay - upd;                                                        \
        mn[i] = m1;                                                                        \
        vn[i] = v1;                                                                        \
    }

#define DEFINE_ADAM(T, SQRT, SUFFIX)                                                       \
    /* Any buffers: element i is read before it is written, so in place is exact. */       \
    static void adam_##SUFFIX##_any(size_t n, const T *p, const T *g, const T *m,         \
                                    const T *v, T *pn, T *mn, T *vn, const T *s) {         \
        ADAM_LOOP(T, SQRT)                                                                 \
    }                                                                                      \
    /* Distinct buffers: vectorized without alias checks, with AVX2 where the CPU has it. */ \
    CLONES                                                                                 \
    static void adam_##SUFFIX##_distinct(size_t n, const T *restrict p, const T *restrict g, \
                                         const T *restrict m, const T *restrict v,         \
                                         T *restrict pn, T *restrict mn, T *restrict vn,   \
                                         const T *restrict s) {                            \
        ADAM_LOOP(T, SQRT)                                                                 \
    }                                                                                      \
    typedef struct {                                                                       \
        T *const *in, *const *out;                                                         \
        const T *s;                                                                        \
    } AdamJob_##SUFFIX;                                                                    \
    /* Elements [b, e) of a split update. */                                               \
    static void adam_##SUFFIX##_part(void *arg, int64_t b, int64_t e) {                    \
        const AdamJob_##SUFFIX *j = (const AdamJob_##SUFFIX *)arg;                         \
        adam_##SUFFIX##_distinct((size_t)(e - b), j->in[0] + b, j->in[1] + b, j->in[2] + b, \
                                 j->in[3] + b, j->out[0] + b, j->out[1] + b, j->out[2] + b, j->s); \
    }                                                                                      \
    static void adam_##SUFFIX(size_t n, void *const *in, void *const *out, const T *s) {   \
        int overlap = 0;                                                                   \
        for (int k = 0; k < N_OUTPUTS; ++k)                                                \
            for (int j = 0; j < N_TENSORS; ++j)                                            \
                overlap |= ranges_overlap(out[k], in[j], n * sizeof(T));                   \
        if (overlap) {                                                                     \
            adam_##SUFFIX##_any(n, in[0], in[1], in[2], in[3], out[0], out[1], out[2], s); \
        } else {                                                                           \
            AdamJob_##SUFFIX job = {(T *const *)in, (T *const *)out, s};                   \
            split_work(adam_##SUFFIX##_part, &job, (int64_t)n,                             \
                       (int64_t)(n * sizeof(T) * (N_TENSORS + N_OUTPUTS)));                \
        }                                                                                  \
    }

static int ranges_overlap(const void *a, const void *b, size_t bytes) {
    const char *x = (const char *)a, *y = (const char *)b;
    return x < y + bytes && y < x + bytes;
}

DEFINE_ADAM(float, sqrtf, f32)
DEFINE_ADAM(double, sqrt, f64)

static OrtStatus *adam_compute(void *kernel, OrtKernelContext *ctx) {
    const OpDef *def = (const OpDef *)kernel;
    size_t n_inputs = 0;
    OrtStatus *st = API(API_KernelContext_GetInputCount, InputCountFn)(ctx, &n_inputs);
    if (st) return st;
    if (n_inputs != N_INPUTS) return fail("AdamUpdate: expects 11 inputs");
    void *data[N_INPUTS];
    size_t count0 = 0, rank = 0;
    int64_t dims[8];
    for (size_t i = 0; i < N_INPUTS; ++i) {
        const OrtValue *value = NULL;
        st = API(API_KernelContext_GetInput, GetInputFn)(ctx, i, &value);
        if (st) return st;
        if (!value) return fail("AdamUpdate: missing input");
        int elem = 0;
        size_t count = 0;
        st = describe(value, &elem, &count, i == 0 ? dims : NULL, &rank);
        if (st) return st;
        if (elem != def->elem_type) return fail("AdamUpdate: input of the wrong element type");
        if (i == 0) count0 = count;
        else if (i < N_TENSORS && count != count0)
            return fail("AdamUpdate: p, g, m and v must have the same number of elements");
        else if (i >= N_TENSORS && count != 1)
            return fail("AdamUpdate: scalar inputs must hold exactly one element");
        st = API(API_GetTensorMutableData, MutableDataFn)((OrtValue *)value, &data[i]);
        if (st) return st;
    }
    void *out[N_OUTPUTS];
    for (size_t k = 0; k < N_OUTPUTS; ++k) {
        OrtValue *value = NULL;
        st = API(API_KernelContext_GetOutput, GetOutputFn)(ctx, k, dims, rank, &value);
        if (st) return st;
        st = API(API_GetTensorMutableData, MutableDataFn)(value, &out[k]);
        if (st) return st;
    }
    if (def->elem_type == ELEM_FLOAT) {
        float s[7];
        for (int j = 0; j < 7; ++j) s[j] = *(const float *)data[N_TENSORS + j];
        adam_f32(count0, data, out, s);
    } else {
        double s[7];
        for (int j = 0; j < 7; ++j) s[j] = *(const double *)data[N_TENSORS + j];
        adam_f64(count0, data, out, s);
    }
    return NULL;
}

/* ------------------------------------------------- spec optimizer updates */
/* One loop body per op; A and B are the op's state tensors (SpecAdam: v, h;
 * Momentum, Nesterov: v; Adagrad: h), s its scalars.  NC and POST are 0 or 1
 * at compile time: whether the lowering has the nc*x + g and post*x' steps.
 * Each line is the standard kernels' operations, one IEEE operation each. */
#define SPEC_ADAM_BODY(T, SQRT, NC, POST)                                                  \
    const T alpha = s[0], oma = s[1], beta = s[2], omb = s[3], eps = s[4], r = s[5],       \
            nc = s[6], post = s[7];                                                        \
    for (size_t i = 0; i < n; ++i) {                                                       \
        const T x = X[i];                                                                  \
        const T gr = NC ? nc * x + G[i] : G[i];                                            \
        const T v1 = alpha * A[i] + oma * gr;                                              \
        const T h1 = beta * B[i] + (omb * gr) * gr;                                        \
        const T x1 = x - (r * v1) / (SQRT(h1) + eps);                                      \
        XO[i] = POST ? post * x1 : x1;                                                     \
        AO[i] = v1;                                                                        \
        BO[i] = h1;                                                                        \
    }
#define MOMENTUM_BODY(T, SQRT, NC, POST)                                                   \
    const T alpha = s[0], beta = s[1], r = s[2], nc = s[3];                                \
    (void)B; (void)BO;                                                                     \
    for (size_t i = 0; i < n; ++i) {                                                       \
        const T x = X[i];                                                                  \
        const T gr = NC ? nc * x + G[i] : G[i];                                            \
        const T v1 = alpha * A[i] + beta * gr;                                             \
        XO[i] = x - r * v1;                                                                \
        AO[i] = v1;                                                                        \
    }
#define NESTEROV_BODY(T, SQRT, NC, POST)                                                   \
    const T alpha = s[0], beta = s[1], alpha2 = s[2], r = s[3], nc = s[4];                 \
    (void)B; (void)BO;                                                                     \
    for (size_t i = 0; i < n; ++i) {                                                       \
        const T x = X[i];                                                                  \
        const T gr = NC ? nc * x + G[i] : G[i];                                            \
        const T v1 = alpha * A[i] + beta * gr;                                             \
        XO[i] = x - r * (gr + alpha2 * v1);                                                \
        AO[i] = v1;                                                                        \
    }
#define ADAGRAD_BODY(T, SQRT, NC, POST)                                                    \
    const T eps = s[0], r = s[1], nc = s[2];                                               \
    (void)B; (void)BO;                                                                     \
    for (size_t i = 0; i < n; ++i) {                                                       \
        const T x = X[i];                                                                  \
        const T gr = NC ? nc * x + G[i] : G[i];                                            \
        const T h1 = A[i] + gr * gr;                                                       \
        XO[i] = x - (r * gr) / (SQRT(h1) + eps);                                           \
        AO[i] = h1;                                                                        \
    }

#define LOOP_ARGS(T, R)                                                                    \
    size_t n, const T *R X, const T *R G, const T *R A, const T *R B, T *R XO, T *R AO,    \
        T *R BO, const T *R s

typedef void (*Loopf32_t)(LOOP_ARGS(float, ));
typedef void (*Loopf64_t)(LOOP_ARGS(double, ));

/* Each variant twice: for any buffers (element i is read before it is
 * written, so in place is exact) and for distinct ones (vectorized without
 * alias checks, with AVX2 where the CPU has it). */
#define DEFINE_LOOP(NAME, BODY, T, SQRT, NC, POST)                                         \
    static void NAME##_any(LOOP_ARGS(T, )) { BODY(T, SQRT, NC, POST) }                     \
    CLONES static void NAME##_distinct(LOOP_ARGS(T, restrict)) { BODY(T, SQRT, NC, POST) }

#define DEFINE_LOOPS(T, SQRT, SUF)                                                         \
    DEFINE_LOOP(spec_adam_##SUF##_00, SPEC_ADAM_BODY, T, SQRT, 0, 0)                       \
    DEFINE_LOOP(spec_adam_##SUF##_01, SPEC_ADAM_BODY, T, SQRT, 0, 1)                       \
    DEFINE_LOOP(spec_adam_##SUF##_10, SPEC_ADAM_BODY, T, SQRT, 1, 0)                       \
    DEFINE_LOOP(spec_adam_##SUF##_11, SPEC_ADAM_BODY, T, SQRT, 1, 1)                       \
    DEFINE_LOOP(momentum_##SUF##_0, MOMENTUM_BODY, T, SQRT, 0, 0)                          \
    DEFINE_LOOP(momentum_##SUF##_1, MOMENTUM_BODY, T, SQRT, 1, 0)                          \
    DEFINE_LOOP(nesterov_##SUF##_0, NESTEROV_BODY, T, SQRT, 0, 0)                          \
    DEFINE_LOOP(nesterov_##SUF##_1, NESTEROV_BODY, T, SQRT, 1, 0)                          \
    DEFINE_LOOP(adagrad_##SUF##_0, ADAGRAD_BODY, T, SQRT, 0, 0)                            \
    DEFINE_LOOP(adagrad_##SUF##_1, ADAGRAD_BODY, T, SQRT, 1, 0)                            \
    /* [kind - KIND_SPEC_ADAM][nc][post][distinct] */                                      \
    static const Loop##SUF##_t loops_##SUF[4][2][2][2] = {                                 \
        {{{spec_adam_##SUF##_00_any, spec_adam_##SUF##_00_distinct},                        \
          {spec_adam_##SUF##_01_any, spec_adam_##SUF##_01_distinct}},                       \
         {{spec_adam_##SUF##_10_any, spec_adam_##SUF##_10_distinct},                        \
          {spec_adam_##SUF##_11_any, spec_adam_##SUF##_11_distinct}}},                      \
        {{{momentum_##SUF##_0_any, momentum_##SUF##_0_distinct},                            \
          {momentum_##SUF##_0_any, momentum_##SUF##_0_distinct}},                           \
         {{momentum_##SUF##_1_any, momentum_##SUF##_1_distinct},                            \
          {momentum_##SUF##_1_any, momentum_##SUF##_1_distinct}}},                          \
        {{{nesterov_##SUF##_0_any, nesterov_##SUF##_0_distinct},                            \
          {nesterov_##SUF##_0_any, nesterov_##SUF##_0_distinct}},                           \
         {{nesterov_##SUF##_1_any, nesterov_##SUF##_1_distinct},                            \
          {nesterov_##SUF##_1_any, nesterov_##SUF##_1_distinct}}},                          \
        {{{adagrad_##SUF##_0_any, adagrad_##SUF##_0_distinct},                              \
          {adagrad_##SUF##_0_any, adagrad_##SUF##_0_distinct}},                             \
         {{adagrad_##SUF##_1_any, adagrad_##SUF##_1_distinct},                              \
          {adagrad_##SUF##_1_any, adagrad_##SUF##_1_distinct}}},                            \
    };

DEFINE_LOOPS(float, sqrtf, f32)
DEFINE_LOOPS(double, sqrt, f64)

/* One spec update of one tensor: its loop, buffers and scalars. */
typedef struct {
    int f64;
    Loopf32_t lf;
    Loopf64_t ld;
    void *in[4], *out[3];
    const float *sf;
    const double *sd;
} SpecJob;

/* Elements [b, e) of a spec update (a tensor the op does not use stays NULL). */
static void spec_part(void *arg, int64_t b, int64_t e) {
    const SpecJob *j = (const SpecJob *)arg;
    const size_t n = (size_t)(e - b);
#define AT(T, p) ((p) ? (T *)(p) + b : NULL)
    if (j->f64)
        j->ld(n, AT(double, j->in[0]), AT(double, j->in[1]), AT(double, j->in[2]), AT(double, j->in[3]),
              AT(double, j->out[0]), AT(double, j->out[1]), AT(double, j->out[2]), j->sd);
    else
        j->lf(n, AT(float, j->in[0]), AT(float, j->in[1]), AT(float, j->in[2]), AT(float, j->in[3]),
              AT(float, j->out[0]), AT(float, j->out[1]), AT(float, j->out[2]), j->sf);
#undef AT
}

static OrtStatus *op_fail(const OpDef *def, const char *what) { return named_fail(def->name, what); }

static OrtStatus *spec_compute(const OpDef *def, OrtKernelContext *ctx) {
    size_t n_in = 0, n_out = 0;
    OrtStatus *st = API(API_KernelContext_GetInputCount, InputCountFn)(ctx, &n_in);
    if (!st) st = API(API_KernelContext_GetOutputCount, InputCountFn)(ctx, &n_out);
    if (st) return st;
    const size_t ns = (size_t)def->n_scalars, pi = (size_t)def->per_in, po = (size_t)def->per_out;
    if (n_in < ns + pi || (n_in - ns) % pi)
        return op_fail(def, "expects its scalars, then k inputs per optimized tensor");
    const size_t nt = (n_in - ns) / pi;
    if (n_out != nt * po) return op_fail(def, "expects k outputs per optimized tensor");

    /* The scalars, as given (the element type of the op; no conversion). */
    float sf[MAX_SCALARS] = {0};
    double sd[MAX_SCALARS] = {0};
    int present[MAX_SCALARS] = {0};
    for (size_t i = 0; i < ns; ++i) {
        const OrtValue *value = NULL;
        st = API(API_KernelContext_GetInput, GetInputFn)(ctx, i, &value);
        if (st) return st;
        if (!value) {
            if ((int)i == def->nc_slot || (int)i == def->post_slot) continue;
            return op_fail(def, "a required scalar input is missing");
        }
        int elem = 0;
        size_t count = 0;
        void *data = NULL;
        st = describe(value, &elem, &count, NULL, NULL);
        if (st) return st;
        if (elem != def->elem_type) return op_fail(def, "input of the wrong element type");
        if (count != 1) return op_fail(def, "scalar inputs must hold exactly one element");
        st = API(API_GetTensorMutableData, MutableDataFn)((OrtValue *)value, &data);
        if (st) return st;
        if (def->elem_type == ELEM_FLOAT) sf[i] = *(const float *)data;
        else sd[i] = *(const double *)data;
        present[i] = 1;
    }
    const int nc = def->nc_slot >= 0 && present[def->nc_slot];
    const int post = def->post_slot >= 0 && present[def->post_slot];
    const size_t width = def->elem_type == ELEM_FLOAT ? sizeof(float) : sizeof(double);

    for (size_t t = 0; t < nt; ++t) {
        void *in[4] = {NULL, NULL, NULL, NULL}, *out[3] = {NULL, NULL, NULL};
        size_t count0 = 0, rank = 0;
        int64_t dims[8];
        for (size_t k = 0; k < pi; ++k) {
            const OrtValue *value = NULL;
            st = API(API_KernelContext_GetInput, GetInputFn)(ctx, ns + t * pi + k, &value);
            if (st) return st;
            if (!value) return op_fail(def, "missing tensor input");
            int elem = 0;
            size_t count = 0;
            st = describe(value, &elem, &count, k == 0 ? dims : NULL, &rank);
            if (st) return st;
            if (elem != def->elem_type) return op_fail(def, "input of the wrong element type");
            if (k == 0) count0 = count;
            else if (count != count0)
                return op_fail(def, "the tensors of one update must have the same number of elements");
            st = API(API_GetTensorMutableData, MutableDataFn)((OrtValue *)value, &in[k]);
            if (st) return st;
        }
        for (size_t k = 0; k < po; ++k) {
            OrtValue *value = NULL;
            st = API(API_KernelContext_GetOutput, GetOutputFn)(ctx, t * po + k, dims, rank, &value);
            if (st) return st;
            st = API(API_GetTensorMutableData, MutableDataFn)(value, &out[k]);
            if (st) return st;
        }
        if (count0 == 0) continue;
        int overlap = 0;
        for (size_t k = 0; k < po; ++k)
            for (size_t j = 0; j < pi; ++j)
                overlap |= ranges_overlap(out[k], in[j], count0 * width);
        const int kind = def->kind - KIND_SPEC_ADAM;
        SpecJob job = {def->elem_type != ELEM_FLOAT, loops_f32[kind][nc][post][!overlap],
                       loops_f64[kind][nc][post][!overlap], {in[0], in[1], in[2], in[3]},
                       {out[0], out[1], out[2]}, sf, sd};
        if (overlap) spec_part(&job, 0, (int64_t)count0); /* in place: one pass, in order */
        else split_work(spec_part, &job, (int64_t)count0, (int64_t)(count0 * width * (pi + po)));
    }
    return NULL;
}

/* The inputs of a layer op: X, a float tensor of rank ``rank`` (its dims
 * and data), and G, its ``ng`` int64 geometry values. */
static OrtStatus *layer_inputs(const OpDef *def, OrtKernelContext *ctx, size_t rank, size_t ng,
                               int64_t *dims, const float **x, const int64_t **g) {
    const OrtValue *xv = NULL, *gv = NULL;
    OrtStatus *st = API(API_KernelContext_GetInput, GetInputFn)(ctx, 0, &xv);
    if (!st) st = API(API_KernelContext_GetInput, GetInputFn)(ctx, 1, &gv);
    if (st) return st;
    if (!xv || !gv) return op_fail(def, "missing input");
    int elem = 0;
    size_t count = 0, xrank = 0, grank = 0;
    int64_t gdims[8];
    st = describe(xv, &elem, &count, dims, &xrank);
    if (st) return st;
    if (elem != ELEM_FLOAT || xrank != rank) return op_fail(def, "X must be a float tensor of the op's rank");
    st = describe(gv, &elem, &count, gdims, &grank);
    if (st) return st;
    if (elem != ELEM_INT64 || count != ng) return op_fail(def, "G must hold its int64 geometry");
    void *xd = NULL, *gd = NULL;
    st = API(API_GetTensorMutableData, MutableDataFn)((OrtValue *)xv, &xd);
    if (!st) st = API(API_GetTensorMutableData, MutableDataFn)((OrtValue *)gv, &gd);
    *x = (const float *)xd;
    *g = (const int64_t *)gd;
    return st;
}

/* ------------------------------------------------------------ MaxPool */
/* One channel plane: every window scanned in row-major order from its first
 * element, which a later one replaces only when greater (so ties keep the
 * first, and a NaN wins only in first place, as in onnxruntime).  Every
 * window holds an element: the pads are smaller than the window. */
CLONES static void max_pool_plane(const float *x, int64_t h, int64_t w, const int64_t *g,
                                  int64_t base, float *y, int64_t *idx) {
    const int64_t kh = g[0], kw = g[1], sh = g[2], sw = g[3], pt = g[4], pl = g[5];
    const int64_t oh = g[6], ow = g[7];
    for (int64_t ph = 0; ph < oh; ++ph) {
        int64_t h0 = ph * sh - pt, h1 = h0 + kh;
        if (h0 < 0) h0 = 0;
        if (h1 > h) h1 = h;
        for (int64_t pw = 0; pw < ow; ++pw) {
            int64_t w0 = pw * sw - pl, w1 = w0 + kw;
            if (w0 < 0) w0 = 0;
            if (w1 > w) w1 = w;
            float best = x[h0 * w + w0];
            int64_t at = h0 * w + w0;
            for (int64_t r = h0; r < h1; ++r) {
                const float *row = x + r * w;
                for (int64_t c = w0; c < w1; ++c) {
                    const int gt = row[c] > best; /* selects, not branches (see ReluGrad) */
                    best = gt ? row[c] : best;
                    at = gt ? r * w + c : at;
                }
            }
            y[ph * ow + pw] = best;
            idx[ph * ow + pw] = base + at;
        }
    }
}

/* The common 2x2 window, stride 2, no padding: four taps, no bounds. */
CLONES static void max_pool_plane_2x2(const float *x, int64_t w, int64_t oh, int64_t ow,
                                      int64_t base, float *y, int64_t *idx) {
    for (int64_t ph = 0; ph < oh; ++ph) {
        const float *r0 = x + 2 * ph * w, *r1 = r0 + w;
        for (int64_t pw = 0; pw < ow; ++pw) {
            const int64_t c = 2 * pw;
            const int64_t top = 2 * ph * w + c, bottom = top + w;
            float best = r0[c];
            int64_t at = top;
            int gt = r0[c + 1] > best;
            best = gt ? r0[c + 1] : best;
            at = gt ? top + 1 : at;
            gt = r1[c] > best;
            best = gt ? r1[c] : best;
            at = gt ? bottom : at;
            gt = r1[c + 1] > best;
            best = gt ? r1[c + 1] : best;
            at = gt ? bottom + 1 : at;
            y[ph * ow + pw] = best;
            idx[ph * ow + pw] = base + at;
        }
    }
}

typedef struct {
    const float *x;
    float *y;
    int64_t *idx;
    const int64_t *g;
    int64_t h, w;
    int two;
} PoolJob;

/* Planes [begin, end) (each written by one thread: the same bits however split). */
static void max_pool_part(void *arg, int64_t begin, int64_t end) {
    const PoolJob *j = (const PoolJob *)arg;
    const int64_t plane = j->h * j->w, out_plane = j->g[6] * j->g[7];
    for (int64_t p = begin; p < end; ++p) {
        const float *x = j->x + p * plane;
        float *y = j->y + p * out_plane;
        int64_t *idx = j->idx + p * out_plane;
        if (j->two) max_pool_plane_2x2(x, j->w, j->g[6], j->g[7], p * plane, y, idx);
        else max_pool_plane(x, j->h, j->w, j->g, p * plane, y, idx);
    }
}

static OrtStatus *max_pool_compute(const OpDef *def, OrtKernelContext *ctx) {
    int64_t dims[8];
    const float *x = NULL;
    const int64_t *g = NULL;
    OrtStatus *st = layer_inputs(def, ctx, 4, 8, dims, &x, &g);
    if (st) return st;
    void *yd = NULL, *id = NULL;
    for (int k = 0; k < 8; ++k)
        if (g[k] < (k < 4 ? 1 : 0)) return op_fail(def, "bad window geometry");
    if (g[4] >= g[0] || g[5] >= g[1]) return op_fail(def, "padding must be smaller than the window");
    const int64_t n = dims[0], c = dims[1], h = dims[2], w = dims[3];
    int64_t ydims[4] = {n, c, g[6], g[7]};
    st = output_data(ctx, 0, ydims, 4, &yd);
    if (!st) st = output_data(ctx, 1, ydims, 4, &id);
    if (st) return st;
    const int two = g[0] == 2 && g[1] == 2 && g[2] == 2 && g[3] == 2 && g[4] == 0 && g[5] == 0 &&
                    2 * g[6] <= h && 2 * g[7] <= w;
    PoolJob job = {x, (float *)yd, (int64_t *)id, g, h, w, two};
    split_work(max_pool_part, &job, n * c, n * c * h * w * (int64_t)sizeof(float));
    return NULL;
}

/* ------------------------------------------------------------ Relu's gradient */
/* onnxruntime's Where(c, a, b) adds (c ? a : 0) and (c ? 0 : b), so a -0.0
 * it selects comes out as +0.0: the "+ 0" here does the same.  The selection
 * is a bit mask, not a branch: a Relu's signs are as good as random, and a
 * mispredicted branch per element made a branching loop as slow as Where. */
#define DEFINE_RELU_GRAD(T, BITS, SUFFIX)                                                  \
    CLONES static void relu_grad_##SUFFIX(size_t n, const T *y, const T *dy, T *dx) {      \
        for (size_t i = 0; i < n; ++i) {                                                   \
            BITS bits;                                                                     \
            T v;                                                                           \
            memcpy(&bits, &dy[i], sizeof bits);                                            \
            bits &= (BITS)0 - (BITS)(y[i] > (T)0);                                         \
            memcpy(&v, &bits, sizeof v);                                                   \
            dx[i] = v + (T)0;                                                              \
        }                                                                                  \
    }
DEFINE_RELU_GRAD(float, uint32_t, f32)
DEFINE_RELU_GRAD(double, uint64_t, f64)

typedef struct {
    const void *y, *dy;
    void *dx;
    int f32;
} ReluJob;

static void relu_grad_part(void *arg, int64_t begin, int64_t end) {
    const ReluJob *j = (const ReluJob *)arg;
    if (j->f32)
        relu_grad_f32((size_t)(end - begin), (const float *)j->y + begin, (const float *)j->dy + begin,
                      (float *)j->dx + begin);
    else
        relu_grad_f64((size_t)(end - begin), (const double *)j->y + begin, (const double *)j->dy + begin,
                      (double *)j->dx + begin);
}

static OrtStatus *relu_grad_compute(const OpDef *def, OrtKernelContext *ctx) {
    const OrtValue *yv = NULL, *dyv = NULL;
    OrtStatus *st = API(API_KernelContext_GetInput, GetInputFn)(ctx, 0, &yv);
    if (!st) st = API(API_KernelContext_GetInput, GetInputFn)(ctx, 1, &dyv);
    if (st) return st;
    if (!yv || !dyv) return op_fail(def, "missing input");
    int elem = 0, elem2 = 0;
    size_t count = 0, count2 = 0, rank = 0, rank2 = 0;
    int64_t dims[8], dims2[8];
    st = describe(yv, &elem, &count, dims, &rank);
    if (!st) st = describe(dyv, &elem2, &count2, dims2, &rank2);
    if (st) return st;
    if (elem != def->elem_type || elem2 != def->elem_type) return op_fail(def, "input of the wrong element type");
    if (rank != rank2 || memcmp(dims, dims2, rank * sizeof(int64_t)) != 0)
        return op_fail(def, "y and dy must have the same shape");
    void *y = NULL, *dy = NULL, *dx = NULL;
    st = API(API_GetTensorMutableData, MutableDataFn)((OrtValue *)yv, &y);
    if (!st) st = API(API_GetTensorMutableData, MutableDataFn)((OrtValue *)dyv, &dy);
    if (!st) st = output_data(ctx, 0, dims, rank, &dx);
    if (st) return st;
    if (count == 0) return NULL;
    ReluJob job = {y, dy, dx, def->elem_type == ELEM_FLOAT};
    const int64_t size = def->elem_type == ELEM_FLOAT ? 4 : 8;
    split_work(relu_grad_part, &job, (int64_t)count, (int64_t)count * size);
    return NULL;
}

/* ------------------------------------------------------------ im2col */
/* Row (c, i, j) of the column matrix: tap (i, j) of channel c over the whole
 * batch, zero where the tap falls in the padding.  Plain copies: the values
 * are X's own, bit for bit. */
static void im2col_row(const float *x, int64_t n, int64_t c_stride, int64_t h, int64_t w,
                       const int64_t *g, int64_t i, int64_t j, float *out) {
    const int64_t sh = g[2], sw = g[3], dh = g[4], dw = g[5], pt = g[6], pl = g[7];
    const int64_t oh = g[8], ow = g[9];
    /* valid output columns: 0 <= q*sw + j*dw - pl < w */
    const int64_t off = j * dw - pl;
    int64_t q0 = off >= 0 ? 0 : (-off + sw - 1) / sw;
    int64_t q1 = w - off <= 0 ? 0 : (w - off + sw - 1) / sw;
    if (q1 > ow) q1 = ow;
    if (q0 > q1) q0 = q1;
    for (int64_t b = 0; b < n; ++b) {
        const float *plane = x + b * c_stride;
        for (int64_t y = 0; y < oh; ++y, out += ow) {
            const int64_t r = y * sh + i * dh - pt;
            if (r < 0 || r >= h) {
                memset(out, 0, (size_t)ow * sizeof(float));
                continue;
            }
            const float *row = plane + r * w + off;
            if (q0) memset(out, 0, (size_t)q0 * sizeof(float));
            if (sw == 1) memcpy(out + q0, row + q0, (size_t)(q1 - q0) * sizeof(float));
            else
                for (int64_t q = q0; q < q1; ++q) out[q] = row[q * sw];
            if (q1 < ow) memset(out + q1, 0, (size_t)(ow - q1) * sizeof(float));
        }
    }
}

typedef struct {
    const float *x;
    float *out;
    const int64_t *g;
    int64_t n, c, h, w;
} Im2ColJob;

static void im2col_part(void *arg, int64_t begin, int64_t end) {
    const Im2ColJob *j = (const Im2ColJob *)arg;
    const int64_t taps = j->g[0] * j->g[1], cols = j->n * j->g[8] * j->g[9];
    for (int64_t ch = begin; ch < end; ++ch)
        for (int64_t t = 0; t < taps; ++t)
            im2col_row(j->x + ch * j->h * j->w, j->n, j->c * j->h * j->w, j->h, j->w, j->g, t / j->g[1],
                       t % j->g[1], j->out + (ch * taps + t) * cols);
}

static OrtStatus *im2col_compute(const OpDef *def, OrtKernelContext *ctx) {
    int64_t dims[8];
    const float *x = NULL;
    const int64_t *g = NULL;
    OrtStatus *st = layer_inputs(def, ctx, 4, 10, dims, &x, &g);
    if (st) return st;
    void *od = NULL;
    for (int k = 0; k < 10; ++k)
        if (g[k] < (k < 6 ? 1 : 0)) return op_fail(def, "bad window geometry");
    const int64_t n = dims[0], c = dims[1], h = dims[2], w = dims[3];
    const int64_t taps = g[0] * g[1], cols = n * g[8] * g[9];
    int64_t odims[2] = {c * taps, cols};
    st = output_data(ctx, 0, odims, 2, &od);
    if (st) return st;
    Im2ColJob job = {x, (float *)od, g, n, c, h, w};
    split_work(im2col_part, &job, c, c * taps * cols * (int64_t)sizeof(float));
    return NULL;
}

/* ------------------------------------------------------------ col2im */
/* The inverse of Im2Col: Y (N x C x H x W) = 0, then for each column-matrix
 * row (c, i, j), in that order, every entry added where its tap lands.
 * onnxruntime's ConvTranspose does the same per image after its GEMM, in the
 * same order, so the sums round alike. */
typedef struct {
    const float *cols;
    float *y;
    const int64_t *g;
    int64_t n, h, w;
} Col2ImJob;

static void col2im_part(void *arg, int64_t begin, int64_t end) {
    const Col2ImJob *j = (const Col2ImJob *)arg;
    const int64_t *g = j->g;
    const int64_t kh = g[0], kw = g[1], sh = g[2], sw = g[3], dh = g[4], dw = g[5], pt = g[6], pl = g[7];
    const int64_t oh = g[8], ow = g[9], n = j->n, h = j->h, w = j->w, c = g[10];
    const int64_t p = oh * ow, width = n * p;
    for (int64_t ch = begin; ch < end; ++ch) {
        for (int64_t b = 0; b < n; ++b) memset(j->y + (b * c + ch) * h * w, 0, (size_t)(h * w) * sizeof(float));
        for (int64_t i = 0; i < kh; ++i)
            for (int64_t k = 0; k < kw; ++k) {
                const float *row = j->cols + ((ch * kh + i) * kw + k) * width;
                for (int64_t b = 0; b < n; ++b) {
                    float *plane = j->y + (b * c + ch) * h * w;
                    for (int64_t y = 0; y < oh; ++y) {
                        const int64_t r = y * sh - pt + i * dh;
                        if (r < 0 || r >= h) continue;
                        const float *src = row + b * p + y * ow;
                        float *dst = plane + r * w;
                        for (int64_t x = 0; x < ow; ++x) {
                            const int64_t q = x * sw - pl + k * dw;
                            if (q >= 0 && q < w) dst[q] += src[x];
                        }
                    }
                }
            }
    }
}

static OrtStatus *col2im_compute(const OpDef *def, OrtKernelContext *ctx) {
    int64_t dims[8];
    const float *cols = NULL;
    const int64_t *g = NULL;
    OrtStatus *st = layer_inputs(def, ctx, 2, 14, dims, &cols, &g);
    if (st) return st;
    for (int k = 0; k < 14; ++k)
        if (g[k] < (k < 6 || k >= 8 ? 1 : 0)) return op_fail(def, "bad window geometry");
    const int64_t c = g[10], n = g[11], h = g[12], w = g[13];
    if (dims[0] != c * g[0] * g[1] || dims[1] != n * g[8] * g[9])
        return op_fail(def, "the column matrix does not fit the geometry");
    int64_t odims[4] = {n, c, h, w};
    void *od = NULL;
    st = output_data(ctx, 0, odims, 4, &od);
    if (st) return st;
    Col2ImJob job = {cols, (float *)od, g, n, h, w};
    split_work(col2im_part, &job, c, n * c * h * w * (int64_t)sizeof(float));
    return NULL;
}

/* ------------------------------------------------------------ NCHWc filters */
/* A conv filter in the blocked layout of onnxruntime's com.microsoft.nchwc
 * Conv (block b, onnxruntime's own, passed in).  The filter is W (M x C x kh
 * x kw) itself, or, with flip, W' (C x M x kh x kw): W'[c, m, i, j] =
 * W[m, c, kh-1-i, kw-1-j], the filter of the stride-1 transposed window.
 * Of the filter F (O x I x kh x kw), out holds, for blocked inputs,
 * [O/b][I/b][kh][kw][b (input)][b (output)], and for plain NCHW inputs,
 * [O/b][I][kh][kw][b (output)].  O (and, blocked, I) are multiples of b. */
typedef struct {
    const float *w;
    float *out;
    int64_t m, c, kh, kw, b;
    int flip, blocked, avx2;
} ReorderJob;

#if defined(__GNUC__) && defined(__x86_64__) && !defined(ONNXTRAIN_NO_CLONES)
#include <immintrin.h>
#define HAVE_TILE8
/* Rows r..r+7 of a tile at x (row stride ss), columns j..j+7, transposed
 * into the eight output rows dst[k] (eight floats each). */
__attribute__((target("avx2"))) static void transpose8(const float *x, int64_t ss, float *const *dst) {
    __m256 r0 = _mm256_loadu_ps(x), r1 = _mm256_loadu_ps(x + ss), r2 = _mm256_loadu_ps(x + 2 * ss),
           r3 = _mm256_loadu_ps(x + 3 * ss), r4 = _mm256_loadu_ps(x + 4 * ss), r5 = _mm256_loadu_ps(x + 5 * ss),
           r6 = _mm256_loadu_ps(x + 6 * ss), r7 = _mm256_loadu_ps(x + 7 * ss);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
           t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
           t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
           u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
           u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
           u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(dst[0], _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(dst[1], _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(dst[2], _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(dst[3], _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(dst[4], _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(dst[5], _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(dst[6], _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(dst[7], _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* One blocked tile, unflipped: rows bo of x (stride ss) hold b * taps
 * values in (bi, t) order; out row t * b + bi takes column bi * taps + t.
 * A transpose of b x (b * taps), eight by eight (b is a multiple of 8). */
__attribute__((target("avx2"))) static void tile_transpose(const float *x, int64_t ss, int64_t b, int64_t taps,
                                                           float *out) {
    const int64_t cols = b * taps;
    for (int64_t r = 0; r < b; r += 8) {
        int64_t col = 0;
        for (; col + 8 <= cols; col += 8) {
            float *dst[8];
            for (int k = 0; k < 8; ++k) dst[k] = out + (((col + k) % taps) * b + (col + k) / taps) * b + r;
            transpose8(x + r * ss + col, ss, dst);
        }
        for (; col < cols; ++col)
            for (int k = 0; k < 8; ++k) out[((col % taps) * b + col / taps) * b + r + k] = x[(r + k) * ss + col];
    }
}

/* One blocked tile, flipped: row bi of W (at x + bi * ss) holds b * taps
 * values in (bo, t) order; out row (taps-1-t) * b + bi takes them for t,
 * bo = 0..b-1.  Per row a transpose of b x taps, eight by eight. */
__attribute__((target("avx2"))) static void tile_flip(const float *x, int64_t ss, int64_t b, int64_t taps,
                                                      float *out) {
    for (int64_t bi = 0; bi < b; ++bi) {
        const float *z = x + bi * ss;
        for (int64_t bo = 0; bo < b; bo += 8) {
            int64_t t = 0;
            for (; t + 8 <= taps; t += 8) {
                float *dst[8];
                for (int k = 0; k < 8; ++k) dst[k] = out + ((taps - 1 - (t + k)) * b + bi) * b + bo;
                transpose8(z + bo * taps + t, taps, dst);
            }
            for (; t < taps; ++t)
                for (int k = 0; k < 8; ++k) out[((taps - 1 - t) * b + bi) * b + bo + k] = z[(bo + k) * taps + t];
        }
    }
}
#endif

/* Output blocks [begin, end). */
static void reorder_filter_part(void *arg, int64_t begin, int64_t end) {
    const ReorderJob *j = (const ReorderJob *)arg;
    const float *w = j->w;
    const int64_t m = j->m, c = j->c, b = j->b, taps = j->kh * j->kw;
    const int flip = j->flip;
    const int64_t i_n = flip ? m : c;
    const int64_t ib = j->blocked ? b : 1, tile = taps * ib * b;
    float *out = j->out + begin * b * i_n * taps;
    /* One (output block, input block) tile at a time, W read in its own
     * order (taps innermost), the tile (a few KB) written scattered. */
    for (int64_t o0 = begin * b; o0 < end * b; o0 += b)
        for (int64_t i0 = 0; i0 < i_n; i0 += ib, out += tile) {
#ifdef HAVE_TILE8
            if (j->blocked && b % 8 == 0 && j->avx2) {
                if (flip) tile_flip(w + (i0 * c + o0) * taps, c * taps, b, taps, out);
                else tile_transpose(w + (o0 * c + i0) * taps, c * taps, b, taps, out);
                continue;
            }
#endif
            if (!flip) {
                for (int64_t bo = 0; bo < b; ++bo)
                    for (int64_t bi = 0; bi < ib; ++bi) {
                        const float *src = w + ((o0 + bo) * c + i0 + bi) * taps;
                        for (int64_t t = 0; t < taps; ++t) out[(t * ib + bi) * b + bo] = src[t];
                    }
            } else { /* F[o, i, t] = W[i, o, taps-1-t] */
                for (int64_t bi = 0; bi < ib; ++bi)
                    for (int64_t bo = 0; bo < b; ++bo) {
                        const float *src = w + ((i0 + bi) * c + o0 + bo) * taps;
                        for (int64_t t = 0; t < taps; ++t) out[((taps - 1 - t) * ib + bi) * b + bo] = src[t];
                    }
            }
        }
}

static OrtStatus *reorder_filter_compute(const OpDef *def, OrtKernelContext *ctx) {
    int64_t dims[8];
    const float *w = NULL;
    const int64_t *g = NULL;
    OrtStatus *st = layer_inputs(def, ctx, 4, 3, dims, &w, &g);
    if (st) return st;
    void *od = NULL;
    const int64_t m = dims[0], c = dims[1], b = g[0];
    const int flip = g[1] != 0, blocked = g[2] != 0;
    const int64_t o_n = flip ? c : m, i_n = flip ? m : c;
    if (b < 1 || o_n % b || (blocked && i_n % b)) return op_fail(def, "channels are not whole blocks");
    int64_t odims[4] = {o_n, i_n, dims[2], dims[3]};
    st = output_data(ctx, 0, odims, 4, &od);
    if (st) return st;
    ReorderJob job = {w, (float *)od, m, c, dims[2], dims[3], b, flip, blocked, 0};
#ifdef HAVE_TILE8
    job.avx2 = __builtin_cpu_supports("avx2");
#endif
    split_work(reorder_filter_part, &job, o_n / b, m * c * dims[2] * dims[3] * (int64_t)sizeof(float));
    return NULL;
}

/* ------------------------------------------------------------ BatchNorm gradient */
/* Training-mode BatchNormalization's backward pass, per channel c over its
 * M = N * S elements (x viewed as N x C x S):
 *   mean = sum(x) / M, var = sum((x - mean)^2) / M, inv = 1 / sqrt(var + eps)
 *   xhat = (x - mean) * inv
 *   dbias = sum(dy), dscale = sum(dy * xhat)
 *   dx = inv * (scale * dy - scale * dbias / M - xhat * scale * dscale / M)
 * (the rule's dx = inv * (g - mean(g) - xhat * mean(g * xhat)), g = dy * scale).
 * Sums in double: two passes over x and dy instead of the fifteen the
 * standard kernels take; the same values to float32 rounding. */
typedef struct {
    const float *x, *dy, *scale;
    float *dx, *dscale, *dbias;
    int64_t n, c, s;
    double eps;
} BnJob;

static void bn_grad_part(void *arg, int64_t begin, int64_t end) {
    const BnJob *j = (const BnJob *)arg;
    const int64_t n = j->n, s = j->s, cs = j->c * s;
    const double m = (double)(n * s);
    for (int64_t ch = begin; ch < end; ++ch) {
        const float *x = j->x + ch * s, *dy = j->dy + ch * s;
        /* One pass for all four sums, about the channel's first element (so
         * the variance does not cancel: d is small where x is near its mean). */
        const double x0 = x[0];
        double sd = 0, sq = 0, sdy = 0, sdyd = 0;
        for (int64_t b = 0; b < n; ++b)
            for (int64_t i = 0; i < s; ++i) {
                const double d = x[b * cs + i] - x0, g = dy[b * cs + i];
                sd += d;
                sq += d * d;
                sdy += g;
                sdyd += g * d;
            }
        const double md = sd / m, mean = x0 + md;
        double var = sq / m - md * md;
        if (var < 0) var = 0;
        const double inv = 1.0 / sqrt(var + j->eps);
        const double scale = j->scale[ch];
        const double dscale = (sdyd - md * sdy) * inv, dbias = sdy;
        j->dscale[ch] = (float)dscale;
        j->dbias[ch] = (float)dbias;
        /* dx = a * dy + bx * x + k, folded per channel */
        const double a = inv * scale;
        const double bx = -inv * inv * scale * dscale / m;
        const double k = -a * dbias / m - bx * mean;
        float *dx = j->dx + ch * s;
        for (int64_t b = 0; b < n; ++b)
            for (int64_t i = 0; i < s; ++i)
                dx[b * cs + i] = (float)(a * dy[b * cs + i] + bx * x[b * cs + i] + k);
    }
}

static OrtStatus *bn_grad_compute(const OpDef *def, OrtKernelContext *ctx) {
    const OrtValue *in[4] = {NULL, NULL, NULL, NULL};
    OrtStatus *st = NULL;
    for (int k = 0; k < 4 && !st; ++k) st = API(API_KernelContext_GetInput, GetInputFn)(ctx, (size_t)k, &in[k]);
    if (st) return st;
    for (int k = 0; k < 4; ++k)
        if (!in[k]) return op_fail(def, "missing input");
    int elem = 0, elem2 = 0;
    size_t count = 0, count2 = 0, rank = 0, rank2 = 0;
    int64_t dims[8], dims2[8];
    st = describe(in[0], &elem, &count, dims, &rank);
    if (!st) st = describe(in[1], &elem2, &count2, dims2, &rank2);
    if (st) return st;
    if (elem != ELEM_FLOAT || elem2 != ELEM_FLOAT || rank < 3 || rank != rank2 ||
        memcmp(dims, dims2, rank * sizeof(int64_t)) != 0)
        return op_fail(def, "x and dy must be float tensors of one shape, rank 3 or more");
    int64_t s = 1;
    for (size_t k = 2; k < rank; ++k) s *= dims[k];
    const int64_t c = dims[1];
    size_t sc_count = 0, eps_count = 0;
    st = describe(in[2], &elem, &sc_count, NULL, NULL);
    if (st) return st;
    if (elem != ELEM_FLOAT || (int64_t)sc_count != c) return op_fail(def, "scale must hold one float per channel");
    st = describe(in[3], &elem, &eps_count, NULL, NULL);
    if (st) return st;
    if (elem != ELEM_FLOAT || eps_count != 1) return op_fail(def, "epsilon must be one float");
    void *xd = NULL, *dyd = NULL, *scd = NULL, *epsd = NULL, *dxd = NULL, *dsd = NULL, *dbd = NULL;
    int64_t cdims[1] = {c};
    st = API(API_GetTensorMutableData, MutableDataFn)((OrtValue *)in[0], &xd);
    if (!st) st = API(API_GetTensorMutableData, MutableDataFn)((OrtValue *)in[1], &dyd);
    if (!st) st = API(API_GetTensorMutableData, MutableDataFn)((OrtValue *)in[2], &scd);
    if (!st) st = API(API_GetTensorMutableData, MutableDataFn)((OrtValue *)in[3], &epsd);
    if (!st) st = output_data(ctx, 0, dims, rank, &dxd);
    if (!st) st = output_data(ctx, 1, cdims, 1, &dsd);
    if (!st) st = output_data(ctx, 2, cdims, 1, &dbd);
    if (st) return st;
    if (dims[0] * s == 0) {
        for (int64_t k = 0; k < c; ++k) ((float *)dsd)[k] = ((float *)dbd)[k] = 0.0f;
        return NULL;
    }
    BnJob job = {(const float *)xd, (const float *)dyd, (const float *)scd, (float *)dxd, (float *)dsd,
                 (float *)dbd, dims[0], c, s, (double)*(const float *)epsd};
    split_work(bn_grad_part, &job, c, (int64_t)count * (int64_t)sizeof(float));
    return NULL;
}

/* ------------------------------------------------------------ scatter-add into zeros */
/* out = zeros(size); out[idx[k]] += upd[k] for k in order (a negative index
 * counts from the end), as ScatterElements(ConstantOfShape(size), idx, upd,
 * axis=0, reduction="add") computes it: each element's sum from +0.0 in the
 * order of k, so the same bits. */
static void zero_part(void *arg, int64_t begin, int64_t end) {
    memset((float *)arg + begin, 0, (size_t)(end - begin) * sizeof(float));
}

static OrtStatus *scatter_add_compute(const OpDef *def, OrtKernelContext *ctx) {
    const OrtValue *in[3] = {NULL, NULL, NULL};
    OrtStatus *st = NULL;
    for (int k = 0; k < 3 && !st; ++k) st = API(API_KernelContext_GetInput, GetInputFn)(ctx, (size_t)k, &in[k]);
    if (st) return st;
    for (int k = 0; k < 3; ++k)
        if (!in[k]) return op_fail(def, "missing input");
    int elem = 0;
    size_t scount = 0, icount = 0, ucount = 0;
    st = describe(in[0], &elem, &scount, NULL, NULL);
    if (st) return st;
    if (elem != ELEM_INT64 || scount != 1) return op_fail(def, "size must be one int64");
    st = describe(in[1], &elem, &icount, NULL, NULL);
    if (st) return st;
    if (elem != ELEM_INT64) return op_fail(def, "indices must be int64");
    st = describe(in[2], &elem, &ucount, NULL, NULL);
    if (st) return st;
    if (elem != ELEM_FLOAT || ucount != icount) return op_fail(def, "updates must be float, one per index");
    void *sd = NULL, *id = NULL, *ud = NULL, *od = NULL;
    st = API(API_GetTensorMutableData, MutableDataFn)((OrtValue *)in[0], &sd);
    if (!st) st = API(API_GetTensorMutableData, MutableDataFn)((OrtValue *)in[1], &id);
    if (!st) st = API(API_GetTensorMutableData, MutableDataFn)((OrtValue *)in[2], &ud);
    if (st) return st;
    const int64_t n = *(const int64_t *)sd;
    if (n < 0) return op_fail(def, "negative size");
    const int64_t *idx = (const int64_t *)id;
    for (size_t k = 0; k < icount; ++k)
        if (idx[k] < -n || idx[k] >= n) return op_fail(def, "index out of range");
    int64_t odims[1] = {n};
    st = output_data(ctx, 0, odims, 1, &od);
    if (st) return st;
    float *out = (float *)od;
    const float *upd = (const float *)ud;
    split_work(zero_part, out, n, n * (int64_t)sizeof(float));
    for (size_t k = 0; k < icount; ++k) {
        const int64_t at = idx[k] < 0 ? idx[k] + n : idx[k];
        out[at] = out[at] + upd[k];
    }
    return NULL;
}

/* ------------------------------------------------------------ Adam's step size */
static OrtStatus *step_size_compute(const OpDef *def, OrtKernelContext *ctx) {
    const OrtValue *in[7] = {NULL};
    void *data[7] = {NULL};
    int64_t dims[8], out_dims[8];
    size_t rank = 0, out_rank = 0;
    OrtStatus *st = NULL;
    for (int k = 0; k < 7; ++k) {
        st = API(API_KernelContext_GetInput, GetInputFn)(ctx, (size_t)k, &in[k]);
        if (st) return st;
        if (!in[k]) return op_fail(def, "missing input");
        int elem = 0;
        size_t count = 0;
        st = describe(in[k], &elem, &count, dims, &rank);
        if (st) return st;
        const int want = (k == 1 || k == 6) ? ELEM_INT64 : def->elem_type;
        if (elem != want || count != 1) return op_fail(def, "expects one-element inputs of its types");
        if (rank > out_rank) out_rank = rank;
        st = API(API_GetTensorMutableData, MutableDataFn)((OrtValue *)in[k], &data[k]);
        if (st) return st;
    }
    for (size_t d = 0; d < out_rank; ++d) out_dims[d] = 1;
    void *od = NULL;
    st = output_data(ctx, 0, out_dims, out_rank, &od);
    if (st) return st;
    const int64_t t = *(const int64_t *)data[1], zero = *(const int64_t *)data[6];
    if (def->elem_type == ELEM_FLOAT) {
        const float r = *(const float *)data[0], T = (float)t;
        const float h = *(const float *)data[2] - powf(*(const float *)data[3], T);
        const float v = *(const float *)data[4] - powf(*(const float *)data[5], T);
        const float adjusted = (r * sqrtf(h)) / v;
        *(float *)od = t > zero ? adjusted : r;
    } else {
        const double r = *(const double *)data[0], T = (double)t;
        const double h = *(const double *)data[2] - pow(*(const double *)data[3], T);
        const double v = *(const double *)data[4] - pow(*(const double *)data[5], T);
        const double adjusted = (r * sqrt(h)) / v;
        *(double *)od = t > zero ? adjusted : r;
    }
    return NULL;
}

static OrtStatus *compute_kind(void *kernel, OrtKernelContext *ctx) {
    const OpDef *def = (const OpDef *)kernel;
    if (def->kind == KIND_STEP_SIZE) return step_size_compute(def, ctx);
    if (def->kind == KIND_SCATTER_ADD) return scatter_add_compute(def, ctx);
    if (def->kind == KIND_BN_GRAD) return bn_grad_compute(def, ctx);
    if (def->kind == KIND_IM2COL) return im2col_compute(def, ctx);
    if (def->kind == KIND_COL2IM) return col2im_compute(def, ctx);
    if (def->kind == KIND_REORDER_FILTER) return reorder_filter_compute(def, ctx);
    if (def->kind == KIND_MAX_POOL) return max_pool_compute(def, ctx);
    if (def->kind == KIND_RELU_GRAD) return relu_grad_compute(def, ctx);
    return def->kind == KIND_ADAM_UPDATE ? adam_compute(kernel, ctx) : spec_compute(def, ctx);
}

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx) { COMPUTE_WITH(ctx, compute_kind(kernel, ctx)); }

/* ------------------------------------------------------------ op table */
static const OpDef *as_def(const CustomOp *op) { return (const OpDef *)op; }
static int is_pool(const CustomOp *op) { return as_def(op)->kind == KIND_MAX_POOL; }
static int is_relu(const CustomOp *op) { return as_def(op)->kind == KIND_RELU_GRAD; }
/* Layer ops of two inputs: X and its int64 geometry. */
static int is_im2col(const CustomOp *op) {
    return as_def(op)->kind == KIND_IM2COL || as_def(op)->kind == KIND_REORDER_FILTER ||
           as_def(op)->kind == KIND_COL2IM;
}
static int is_bn(const CustomOp *op) { return as_def(op)->kind == KIND_BN_GRAD; }
static int is_scatter(const CustomOp *op) { return as_def(op)->kind == KIND_SCATTER_ADD; }
static int is_step(const CustomOp *op) { return as_def(op)->kind == KIND_STEP_SIZE; }
static int is_spec(const CustomOp *op) {
    return as_def(op)->kind != KIND_ADAM_UPDATE && !is_pool(op) && !is_relu(op) && !is_im2col(op) &&
           !is_bn(op) && !is_scatter(op) && !is_step(op);
}
static void compute_v1(void *kernel, OrtKernelContext *ctx) {
    OrtStatus *st = compute(kernel, ctx);
    if (st) API(API_ReleaseStatus, ReleaseStatusFn)(st);
}
static const char *get_name(const CustomOp *op) { return as_def(op)->name; }
static int input_type(const CustomOp *op, size_t i) {
    if (is_scatter(op)) return i < 2 ? ELEM_INT64 : ELEM_FLOAT;
    if (is_step(op)) return (i == 1 || i == 6) ? ELEM_INT64 : as_def(op)->elem_type;
    return (is_pool(op) || is_im2col(op)) && i == 1 ? ELEM_INT64 : as_def(op)->elem_type;
}
/* Spec ops: the scalars, then one variadic input holding every tensor. */
static size_t input_count(const CustomOp *op) {
    if (is_step(op)) return 7;
    if (is_bn(op)) return 4;
    if (is_scatter(op)) return 3;
    if (is_pool(op) || is_relu(op) || is_im2col(op)) return 2;
    return is_spec(op) ? (size_t)as_def(op)->n_scalars + 1 : N_INPUTS;
}
static int output_type(const CustomOp *op, size_t i) {
    return is_pool(op) && i == 1 ? ELEM_INT64 : as_def(op)->elem_type;
}
static size_t output_count(const CustomOp *op) {
    if (is_pool(op)) return 2;
    if (is_bn(op)) return 3;
    return is_spec(op) || is_relu(op) || is_im2col(op) || is_scatter(op) || is_step(op) ? 1 : N_OUTPUTS;
}
static int input_characteristic(const CustomOp *op, size_t i) {
    const OpDef *def = as_def(op);
    if (!is_spec(op)) return INPUT_OUTPUT_REQUIRED;
    if (i >= (size_t)def->n_scalars) return INPUT_OUTPUT_VARIADIC;
    return ((int)i == def->nc_slot || (int)i == def->post_slot) ? INPUT_OUTPUT_OPTIONAL
                                                                 : INPUT_OUTPUT_REQUIRED;
}
static int output_characteristic(const CustomOp *op, size_t i) {
    (void)i;
    return is_spec(op) ? INPUT_OUTPUT_VARIADIC : INPUT_OUTPUT_REQUIRED;
}
static int input_min_arity(const CustomOp *op) { return is_spec(op) ? as_def(op)->per_in : 1; }
static int output_min_arity(const CustomOp *op) { return is_spec(op) ? as_def(op)->per_out : 1; }

#define OP_DEF(NAME, ELEM, KIND, NS, NC, POST, PI, PO)                                      \
    {{16, op_create_kernel, get_name, op_provider, input_type, input_count, output_type,    \
      output_count, compute_v1, op_destroy_kernel, input_characteristic, output_characteristic, \
      op_default_memory, input_min_arity, op_one, output_min_arity, op_one, op_create_kernel_v2, compute, \
      NULL, NULL, NULL, NULL, NULL, NULL, NULL},                                            \
     NAME, ELEM, KIND, NS, NC, POST, PI, PO}

static OpDef g_ops[] = {
    OP_DEF("AdamUpdateF32", ELEM_FLOAT, KIND_ADAM_UPDATE, 0, -1, -1, 0, 0),
    OP_DEF("AdamUpdateF64", ELEM_DOUBLE, KIND_ADAM_UPDATE, 0, -1, -1, 0, 0),
    OP_DEF("SpecAdamF32", ELEM_FLOAT, KIND_SPEC_ADAM, 8, 6, 7, 4, 3),
    OP_DEF("SpecAdamF64", ELEM_DOUBLE, KIND_SPEC_ADAM, 8, 6, 7, 4, 3),
    OP_DEF("MomentumF32", ELEM_FLOAT, KIND_MOMENTUM, 4, 3, -1, 3, 2),
    OP_DEF("MomentumF64", ELEM_DOUBLE, KIND_MOMENTUM, 4, 3, -1, 3, 2),
    OP_DEF("NesterovF32", ELEM_FLOAT, KIND_NESTEROV, 5, 4, -1, 3, 2),
    OP_DEF("NesterovF64", ELEM_DOUBLE, KIND_NESTEROV, 5, 4, -1, 3, 2),
    OP_DEF("AdagradF32", ELEM_FLOAT, KIND_ADAGRAD, 3, 2, -1, 3, 2),
    OP_DEF("AdagradF64", ELEM_DOUBLE, KIND_ADAGRAD, 3, 2, -1, 3, 2),
    OP_DEF("MaxPoolIndicesF32", ELEM_FLOAT, KIND_MAX_POOL, 0, -1, -1, 0, 0),
    OP_DEF("ReluGradF32", ELEM_FLOAT, KIND_RELU_GRAD, 0, -1, -1, 0, 0),
    OP_DEF("ReluGradF64", ELEM_DOUBLE, KIND_RELU_GRAD, 0, -1, -1, 0, 0),
    OP_DEF("Im2ColF32", ELEM_FLOAT, KIND_IM2COL, 0, -1, -1, 0, 0),
    OP_DEF("ReorderFilterF32", ELEM_FLOAT, KIND_REORDER_FILTER, 0, -1, -1, 0, 0),
    OP_DEF("BatchNormGradF32", ELEM_FLOAT, KIND_BN_GRAD, 0, -1, -1, 0, 0),
    OP_DEF("ScatterAddZerosF32", ELEM_FLOAT, KIND_SCATTER_ADD, 0, -1, -1, 0, 0),
    OP_DEF("Col2ImF32", ELEM_FLOAT, KIND_COL2IM, 0, -1, -1, 0, 0),
    OP_DEF("AdamStepSizeF32", ELEM_FLOAT, KIND_STEP_SIZE, 0, -1, -1, 0, 0),
    OP_DEF("AdamStepSizeF64", ELEM_DOUBLE, KIND_STEP_SIZE, 0, -1, -1, 0, 0),
};

/* The API table is addressed by index: check a few entries at both ends of
 * the range used before trusting it. */
static int api_looks_right(void) {
    OrtStatus *st = API(API_CreateStatus, CreateStatusFn)(STATUS_FAIL, "onnxtrain-probe");
    if (!st) return 0;
    int ok = API(API_GetErrorCode, GetErrorCodeFn)(st) == STATUS_FAIL &&
             strcmp(API(API_GetErrorMessage, GetErrorMessageFn)(st), "onnxtrain-probe") == 0;
    API(API_ReleaseStatus, ReleaseStatusFn)(st);
    return ok;
}

__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options,
                                                                      const OrtApiBase *base) {
    const OrtApi *api = base->GetApi(16);
    if (!api) return NULL; /* too old: the domain stays unregistered and loading fails cleanly */
    g_api = api;
    g_pool = base->GetApi(17) != NULL;
    if (!api_looks_right()) {
        g_api = NULL;
        return NULL;
    }
    OrtCustomOpDomain *domain = NULL;
    OrtStatus *st = API(API_CreateCustomOpDomain, CreateDomainFn)("ai.onnxtrain.kernels", &domain);
    if (st) return st;
    for (size_t i = 0; i < sizeof(g_ops) / sizeof(g_ops[0]); ++i) {
        st = API(API_CustomOpDomain_Add, DomainAddFn)(domain, &g_ops[i].op);
        if (st) return st;
    }
    st = onnxtrain_add_llm_ops(domain);
    if (st) return st;
    /* The domain lives as long as the process: sessions may outlive any owner. */
    return API(API_AddCustomOpDomain, AddDomainFn)(options, domain);
}

/* For the loader's self-check. */
__attribute__((visibility("default"))) int onnxtrain_kernels_abi(void) { return 3; }
