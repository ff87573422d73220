/* onnxtrain's fused optimizer kernels: an onnxruntime custom-op library.
 *
 * One op per element type, in the domain "ai.onnxtrain.kernels":
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
 * This is the Adam/AdamW update that onnxtrain's optimizer builder writes as
 * eleven standard ONNX kernels (see onnxtrain/fuse.py, fuse_adam_updates).
 * Every operation is one IEEE operation in the same order as there, and the
 * library is compiled with -ffp-contract=off (no fused multiply-adds), so the
 * results are bitwise those of the standard kernels: one pass over memory
 * instead of eleven.
 *
 * The library needs no onnxruntime headers.  The onnxruntime C API is a table
 * of function pointers that only ever grows at its end (its ABI contract); the
 * few entries used here sit in the part frozen since API version 1, so they
 * are addressed by index.  The OrtCustomOp struct below is declared in the
 * layout of API version 16, the first with status-returning kernels.
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef void OrtApi; /* used only as a table of function pointers */

typedef struct OrtApiBase {
    const OrtApi *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

enum { ELEM_FLOAT = 1, ELEM_DOUBLE = 11 };
enum { STATUS_FAIL = 1, STATUS_INVALID_ARGUMENT = 2 };

/* Indices into the OrtApi table (all in the version-1 part). */
enum {
    API_CreateStatus = 0,
    API_GetErrorCode = 1,
    API_GetErrorMessage = 2,
    API_CreateCustomOpDomain = 26,
    API_CustomOpDomain_Add = 27,
    API_AddCustomOpDomain = 28,
    API_GetTensorMutableData = 51,
    API_GetTensorElementType = 60,
    API_GetDimensionsCount = 61,
    API_GetDimensions = 62,
    API_GetTensorShapeElementCount = 64,
    API_GetTensorTypeAndShape = 65,
    API_KernelContext_GetInputCount = 88,
    API_KernelContext_GetInput = 90,
    API_KernelContext_GetOutput = 91,
    API_ReleaseStatus = 93,
    API_ReleaseTensorTypeAndShapeInfo = 99,
};

static const OrtApi *g_api = NULL;
#define API(index, type) ((type)(((void *const *)g_api)[index]))

typedef OrtStatus *(*CreateStatusFn)(int, const char *);
typedef int (*GetErrorCodeFn)(const OrtStatus *);
typedef const char *(*GetErrorMessageFn)(const OrtStatus *);
typedef void (*ReleaseStatusFn)(OrtStatus *);
typedef OrtStatus *(*CreateDomainFn)(const char *, OrtCustomOpDomain **);
typedef OrtStatus *(*DomainAddFn)(OrtCustomOpDomain *, void *);
typedef OrtStatus *(*AddDomainFn)(OrtSessionOptions *, OrtCustomOpDomain *);
typedef OrtStatus *(*MutableDataFn)(OrtValue *, void **);
typedef OrtStatus *(*ElementTypeFn)(const OrtTensorTypeAndShapeInfo *, int *);
typedef OrtStatus *(*DimsCountFn)(const OrtTensorTypeAndShapeInfo *, size_t *);
typedef OrtStatus *(*DimsFn)(const OrtTensorTypeAndShapeInfo *, int64_t *, size_t);
typedef OrtStatus *(*ElementCountFn)(const OrtTensorTypeAndShapeInfo *, size_t *);
typedef OrtStatus *(*TypeAndShapeFn)(const OrtValue *, OrtTensorTypeAndShapeInfo **);
typedef OrtStatus *(*InputCountFn)(const OrtKernelContext *, size_t *);
typedef OrtStatus *(*GetInputFn)(const OrtKernelContext *, size_t, const OrtValue **);
typedef OrtStatus *(*GetOutputFn)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **);
typedef void (*ReleaseInfoFn)(OrtTensorTypeAndShapeInfo *);

/* OrtCustomOp, layout of API version 16 onwards (later fields unused). */
typedef struct CustomOp {
    uint32_t version;
    void *(*CreateKernel)(const struct CustomOp *, const OrtApi *, const OrtKernelInfo *);
    const char *(*GetName)(const struct CustomOp *);
    const char *(*GetExecutionProviderType)(const struct CustomOp *);
    int (*GetInputType)(const struct CustomOp *, size_t);
    size_t (*GetInputTypeCount)(const struct CustomOp *);
    int (*GetOutputType)(const struct CustomOp *, size_t);
    size_t (*GetOutputTypeCount)(const struct CustomOp *);
    void (*KernelCompute)(void *, OrtKernelContext *);
    void (*KernelDestroy)(void *);
    int (*GetInputCharacteristic)(const struct CustomOp *, size_t);
    int (*GetOutputCharacteristic)(const struct CustomOp *, size_t);
    int (*GetInputMemoryType)(const struct CustomOp *, size_t);
    int (*GetVariadicInputMinArity)(const struct CustomOp *);
    int (*GetVariadicInputHomogeneity)(const struct CustomOp *);
    int (*GetVariadicOutputMinArity)(const struct CustomOp *);
    int (*GetVariadicOutputHomogeneity)(const struct CustomOp *);
    OrtStatus *(*CreateKernelV2)(const struct CustomOp *, const OrtApi *, const OrtKernelInfo *, void **);
    OrtStatus *(*KernelComputeV2)(void *, OrtKernelContext *);
    /* Declared so the struct has its full size; version 16 leaves them unread. */
    void *InferOutputShapeFn;
    void *GetStartVersion;
    void *GetEndVersion;
    void *GetMayInplace;
    void *ReleaseMayInplace;
    void *GetAliasMap;
    void *ReleaseAliasMap;
} CustomOp;

typedef struct OpDef {
    CustomOp op;          /* first member: ORT hands back &op */
    const char *name;
    int elem_type;
} OpDef;

#define N_INPUTS 11
#define N_OUTPUTS 3
#define N_TENSORS 4

static OrtStatus *fail(const char *msg) {
    return API(API_CreateStatus, CreateStatusFn)(STATUS_INVALID_ARGUMENT, msg);
}

/* Element type, element count and (optionally) dims of a value. */
static OrtStatus *describe(const OrtValue *value, int *elem, size_t *count, int64_t *dims, size_t *rank) {
    OrtTensorTypeAndShapeInfo *info = NULL;
    OrtStatus *st = API(API_GetTensorTypeAndShape, TypeAndShapeFn)(value, &info);
    if (st) return st;
    st = API(API_GetTensorElementType, ElementTypeFn)(info, elem);
    if (!st) st = API(API_GetTensorShapeElementCount, ElementCountFn)(info, count);
    if (!st && dims) {
        st = API(API_GetDimensionsCount, DimsCountFn)(info, rank);
        if (!st && *rank > 8) st = fail("AdamUpdate: tensors of rank > 8 are not supported");
        if (!st) st = API(API_GetDimensions, DimsFn)(info, dims, *rank);
    }
    API(API_ReleaseTensorTypeAndShapeInfo, ReleaseInfoFn)(info);
    return st;
}

#if defined(__GNUC__) && defined(__x86_64__) && !defined(ONNXTRAIN_NO_CLONES)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

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
    static void adam_##SUFFIX(size_t n, void *const *in, void *const *out, const T *s) {   \
        int overlap = 0;                                                                   \
        for (int k = 0; k < N_OUTPUTS; ++k)                                                \
            for (int j = 0; j < N_TENSORS; ++j)                                            \
                overlap |= ranges_overlap(out[k], in[j], n * sizeof(T));                   \
        if (overlap)                                                                       \
            adam_##SUFFIX##_any(n, in[0], in[1], in[2], in[3], out[0], out[1], out[2], s); \
        else                                                                               \
            adam_##SUFFIX##_distinct(n, in[0], in[1], in[2], in[3], out[0], out[1], out[2], s); \
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

/* ------------------------------------------------------------ op table */
static const OpDef *as_def(const CustomOp *op) { return (const OpDef *)op; }
static void *create_kernel(const CustomOp *op, const OrtApi *api, const OrtKernelInfo *info) {
    (void)api; (void)info;
    return (void *)op;
}
static OrtStatus *create_kernel_v2(const CustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                   void **kernel) {
    (void)api; (void)info;
    *kernel = (void *)op;
    return NULL;
}
static void compute_v1(void *kernel, OrtKernelContext *ctx) {
    OrtStatus *st = adam_compute(kernel, ctx);
    if (st) API(API_ReleaseStatus, ReleaseStatusFn)(st);
}
static void destroy_kernel(void *kernel) { (void)kernel; }
static const char *get_name(const CustomOp *op) { return as_def(op)->name; }
static const char *get_provider(const CustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int input_type(const CustomOp *op, size_t i) { (void)i; return as_def(op)->elem_type; }
static size_t input_count(const CustomOp *op) { (void)op; return N_INPUTS; }
static int output_type(const CustomOp *op, size_t i) { (void)i; return as_def(op)->elem_type; }
static size_t output_count(const CustomOp *op) { (void)op; return N_OUTPUTS; }
static int required(const CustomOp *op, size_t i) { (void)op; (void)i; return 0; }
static int default_memory(const CustomOp *op, size_t i) { (void)op; (void)i; return 0; }
static int one(const CustomOp *op) { (void)op; return 1; }

#define OP_DEF(NAME, ELEM)                                                                  \
    {{16, create_kernel, get_name, get_provider, input_type, input_count, output_type,      \
      output_count, compute_v1, destroy_kernel, required, required, default_memory, one, one, \
      one, one, create_kernel_v2, adam_compute, NULL, NULL, NULL, NULL, NULL, NULL, NULL},   \
     NAME, ELEM}

static OpDef g_ops[] = {
    OP_DEF("AdamUpdateF32", ELEM_FLOAT),
    OP_DEF("AdamUpdateF64", ELEM_DOUBLE),
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
    /* The domain lives as long as the process: sessions may outlive any owner. */
    return API(API_AddCustomOpDomain, AddDomainFn)(options, domain);
}

/* For the loader's self-check. */
__attribute__((visibility("default"))) int onnxtrain_kernels_abi(void) { return 1; }
