/* The onnxruntime C API as onnxtrain's kernel library uses it, shared by its
 * sources (optim_kernels.c, llm_kernels.c): no onnxruntime headers.
 *
 * The onnxruntime C API is a table of function pointers that only ever grows
 * at its end (its ABI contract), so the few entries used here are addressed
 * by index: all in the part frozen since API version 1 but one,
 * KernelContext_ParallelFor, from version 17 (used where the runtime's table
 * has it: g_pool).  The
 * OrtCustomOp struct below is declared in the layout of API version 16, the
 * first with status-returning kernels.  g_api is set when the library
 * registers its ops (optim_kernels.c, RegisterCustomOps). */
#ifndef ONNXTRAIN_ORT_API_H
#define ONNXTRAIN_ORT_API_H

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

enum { ELEM_FLOAT = 1, ELEM_UINT8 = 2, ELEM_INT64 = 7, ELEM_DOUBLE = 11 };
enum { STATUS_FAIL = 1, STATUS_INVALID_ARGUMENT = 2 };

/* Indices into the OrtApi table (the version-1 part, and one of version 17). */
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
    API_KernelContext_GetOutputCount = 89,
    API_KernelContext_GetInput = 90,
    API_KernelContext_GetOutput = 91,
    API_ReleaseStatus = 93,
    API_ReleaseTensorTypeAndShapeInfo = 99,
    API_KernelContext_ParallelFor = 274, /* from API version 17 (g_pool) */
};

extern const OrtApi *g_api;
/* Whether the runtime has KernelContext_ParallelFor (API version 17, onnxruntime 1.17). */
extern int g_pool;
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
typedef OrtStatus *(*ParallelForFn)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *);

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

enum { INPUT_OUTPUT_REQUIRED = 0, INPUT_OUTPUT_OPTIONAL = 1, INPUT_OUTPUT_VARIADIC = 2 };

/* Helpers each source gets a private copy of (unused ones are dropped). */
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#endif
static OrtStatus *fail(const char *msg) {
    return API(API_CreateStatus, CreateStatusFn)(STATUS_INVALID_ARGUMENT, msg);
}

/* A status naming the op: "<op>: <what>". */
static OrtStatus *named_fail(const char *name, const char *what) {
    char msg[240];
    size_t k = strlen(name);
    if (k > 60) k = 60;
    memcpy(msg, name, k);
    memcpy(msg + k, ": ", 2);
    strncpy(msg + k + 2, what, sizeof(msg) - k - 3);
    msg[sizeof(msg) - 1] = '\0';
    return fail(msg);
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
        if (!st && *rank > 8) st = fail("tensors of rank > 8 are not supported");
        if (!st) st = API(API_GetDimensions, DimsFn)(info, dims, *rank);
    }
    API(API_ReleaseTensorTypeAndShapeInfo, ReleaseInfoFn)(info);
    return st;
}

/* Output ``index`` of shape dims (rank values), and its data. */
static OrtStatus *output_data(OrtKernelContext *ctx, size_t index, const int64_t *dims, size_t rank, void **data) {
    OrtValue *value = NULL;
    OrtStatus *st = API(API_KernelContext_GetOutput, GetOutputFn)(ctx, index, dims, rank, &value);
    return st ? st : API(API_GetTensorMutableData, MutableDataFn)(value, data);
}

#if defined(__GNUC__) && defined(__x86_64__) && !defined(ONNXTRAIN_NO_CLONES)
#define CLONES __attribute__((target_clones("avx2", "default")))
/* For products written with fmaf (one rounding: the same bits in every
 * clone, the default one calling libm's): clones with the FMA instructions,
 * chosen by the CPU's features.  Not "arch=haswell": GCC picks an arch= clone
 * by the CPU's model (__builtin_cpu_is), so an AMD or a later Intel core
 * without AVX-512 ran the default clone, a libm call per fmaf. */
#define FMA_CLONES __attribute__((target_clones("avx512f", "fma", "default")))
#else
#define CLONES
#define FMA_CLONES
#endif

/* ------------------------------------------------------------ threads */
/* The optimizer updates and the layer kernels are bound by memory traffic,
 * which one core does not saturate.  From POOL_SPLIT_MIN_BYTES of traffic a
 * kernel splits its items into contiguous ranges of at least POOL_PART_BYTES
 * (at most POOL_PARTS), which the session's own intra-op pool runs
 * (KernelContext_ParallelFor), its threads taking them as they come free:
 * they are awake between kernels (spinning) or a wake-up away, and a session
 * of one thread runs the ranges in turn.  (Short-lived helper threads, which
 * the library started before, cost tens of microseconds each and contended
 * with the pool's spinning threads: docs/fused-kernels.md.)  Each output
 * element is written by one range, in the order one thread would: the results
 * do not depend on the split.  (An update in place, whose outputs share its
 * inputs' buffers, runs in one pass on this thread.) */
#define POOL_SPLIT_MIN_BYTES (64 << 10)
#define POOL_PART_BYTES (32 << 10)
#define POOL_PARTS 16

typedef void (*PartFn)(void *, int64_t, int64_t);

/* The kernel context of the compute call running on this thread: each
 * library's compute entry sets it (COMPUTE_WITH) for the call's length. */
static __thread OrtKernelContext *t_ctx;
#define COMPUTE_WITH(ctx, call)           \
    do {                                  \
        OrtKernelContext *saved_ = t_ctx; \
        t_ctx = (ctx);                    \
        OrtStatus *st_ = (call);          \
        t_ctx = saved_;                   \
        return st_;                       \
    } while (0)

typedef struct {
    PartFn fn;
    void *arg;
    int64_t items, parts;
} Split;

static void run_range(void *p, size_t k) {
    const Split *s = (const Split *)p;
    s->fn(s->arg, s->items * (int64_t)k / s->parts, s->items * ((int64_t)k + 1) / s->parts);
}

/* fn(arg, begin, end) over [0, items), ``bytes`` the memory it moves: split
 * over the pool, or in one call (small work, no pool, or the pool refused
 * before running anything). */
static void split_work(PartFn fn, void *arg, int64_t items, int64_t bytes) {
    int64_t parts = bytes >= POOL_SPLIT_MIN_BYTES ? bytes / POOL_PART_BYTES : 1;
    if (parts > POOL_PARTS) parts = POOL_PARTS;
    if (parts > items) parts = items;
    if (parts > 1 && t_ctx && g_pool) {
        Split s = {fn, arg, items, parts};
        OrtStatus *st = API(API_KernelContext_ParallelFor, ParallelForFn)(t_ctx, run_range, (size_t)parts, 0, &s);
        if (!st) return;
        API(API_ReleaseStatus, ReleaseStatusFn)(st);
    }
    fn(arg, 0, items);
}

/* OrtCustomOp members every op of the library shares: the kernel is the op
 * itself (no state), on the CPU provider, inputs in CPU memory. */
static void *op_create_kernel(const CustomOp *op, const OrtApi *api, const OrtKernelInfo *info) {
    (void)api; (void)info;
    return (void *)op;
}
static OrtStatus *op_create_kernel_v2(const CustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                      void **kernel) {
    (void)api; (void)info;
    *kernel = (void *)op;
    return NULL;
}
static void op_destroy_kernel(void *kernel) { (void)kernel; }
static const char *op_provider(const CustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int op_default_memory(const CustomOp *op, size_t i) { (void)op; (void)i; return 0; }
static int op_one(const CustomOp *op) { (void)op; return 1; }

#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

/* llm_kernels.c: adds its ops to the library's domain. */
OrtStatus *onnxtrain_add_llm_ops(OrtCustomOpDomain *domain);

#endif
