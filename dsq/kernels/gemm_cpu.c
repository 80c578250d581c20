/* Exact GEMMs on the CPU's bf16 units (docs/dsq.md, "GEMM units").
 *
 * A GEMM whose two operands hold only values that are bf16 numbers gives, on a unit that
 * multiplies bf16 and accumulates in float32, the float32 GEMM's result up to the order of the
 * float32 sums: the product of two bf16 numbers (8 significant bits each) has at most 16
 * significant bits and is exact in float32. What can break it, and is checked here:
 *
 *   - a value that is not a bf16 number (low 16 bits of its float32 pattern not zero);
 *   - a value below bf16's normal range: the dot-product instruction (vdpbf16ps) treats
 *     subnormal inputs as zero and flushes subnormal results to zero, where the float32 GEMM keeps
 *     them. The conversion refuses every nonzero finite value below 2^-63 in magnitude, so every
 *     product of two accepted values is at least 2^-126, a normal float32.
 *   - a NaN whose payload sits in the low bits (it would truncate to infinity).
 *
 * A partial sum that cancels below 2^-126 is still flushed; its absolute error is below 2^-126
 * per addition, far inside the tolerance of float32 summation order that the tests state.
 *
 * The conversions report whether every value passed; the host runs the float32 GEMM when one did
 * not, so a result is never less exact than the check promises. The GEMM itself is oneDNN's
 * matmul primitive (bf16 source and weights, float32 destination), whose primitives are cached
 * by shape and layout: a training step reuses a few dozen of them.
 */
#include <dnnl.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* 1 when the float32 pattern u is a bf16 number that the bf16 unit multiplies exactly: zero,
 * an infinity, a NaN with a high payload, or a normal value of magnitude at least 2^-63. */
static inline int fits_bf16(uint32_t u) {
    uint32_t magnitude = u & 0x7FFFFFFFu;
    /* branch-free, so that the conversion loops vectorize */
    return ((u & 0xFFFFu) == 0) & ((magnitude == 0) | (magnitude >= ((127u - 63u) << 23)));
}

/* dst[i, j, l] = the bf16 pattern of src[i, j, l] for a [n0, n1, n2] block, each array with
 * its own element strides (the caller orders the dimensions so that the last one is the
 * innermost in memory). Returns 1 when every value fits (fits_bf16), else 0, and dst is then
 * unspecified. */
int dsq_to_bf16(const float *src, int64_t s0, int64_t s1, int64_t s2, uint16_t *dst, int64_t t0,
                int64_t t1, int64_t t2, int64_t n0, int64_t n1, int64_t n2) {
    int ok = 1;
    int64_t rows = n0 * n1;
#pragma omp parallel for reduction(& : ok) schedule(static) if (rows * n2 >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *from = src + (r / n1) * s0 + (r % n1) * s1;
        uint16_t *to = dst + (r / n1) * t0 + (r % n1) * t1;
        int row_ok = 1;
        if (s2 == 1 && t2 == 1) {
            for (int64_t l = 0; l < n2; l++) {
                uint32_t u = bits_of(from[l]);
                row_ok &= fits_bf16(u);
                to[l] = (uint16_t)(u >> 16);
            }
        } else {
            for (int64_t l = 0; l < n2; l++) {
                uint32_t u = bits_of(from[l * s2]);
                row_ok &= fits_bf16(u);
                to[l * t2] = (uint16_t)(u >> 16);
            }
        }
        ok &= row_ok;
    }
    return ok;
}

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* hi[i, j, l] + lo[i, j, l] == src[i, j, l] exactly, as two bf16 patterns, for a [n0, n1, n2]
 * block with strides as in dsq_to_bf16 (hi and lo share the destination strides): hi is src
 * with its significand cut to bf16's 8 bits (the top 16 bits of its float32 pattern), lo =
 * src - hi, which float32 holds exactly (hi is src truncated toward zero, so the difference is
 * src's low significand bits). Returns 1 when every value splits into two numbers the bf16 unit
 * multiplies exactly (fits_bf16 for both: src has at most 16 significant bits and neither part
 * is below 2^-63), else 0, and hi and lo are then unspecified. A non-finite value does not split:
 * the float32 GEMM takes the call. */
int dsq_split_bf16(const float *src, int64_t s0, int64_t s1, int64_t s2, uint16_t *hi,
                   uint16_t *lo, int64_t t0, int64_t t1, int64_t t2, int64_t n0, int64_t n1,
                   int64_t n2) {
    int ok = 1;
    int64_t rows = n0 * n1;
#pragma omp parallel for reduction(& : ok) schedule(static) if (rows * n2 >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *from = src + (r / n1) * s0 + (r % n1) * s1;
        int64_t at = (r / n1) * t0 + (r % n1) * t1;
        int row_ok = 1;
        for (int64_t l = 0; l < n2; l++) {
            uint32_t u = bits_of(from[l * s2]);
            uint32_t h = u & 0xFFFF0000u;
            uint32_t v = bits_of(float_of(u) - float_of(h));
            uint32_t magnitude = u & 0x7FFFFFFFu;
            /* x itself in range too: where subnormal inputs are flushed (DAZ), x - h of a
             * subnormal x would give h = v = 0 */
            row_ok &= ((u & 0x7F800000u) != 0x7F800000u) &
                      ((magnitude == 0) | (magnitude >= ((127u - 63u) << 23))) & fits_bf16(h) &
                      fits_bf16(v);
            hi[at + l * t2] = (uint16_t)(h >> 16);
            lo[at + l * t2] = (uint16_t)(v >> 16);
        }
        ok &= row_ok;
    }
    return ok;
}

/* ---------------------------------------------------------------------------- the GEMM */
#define KEY_LEN 13
#define CACHE_SLOTS 8192 /* a power of two; the table is emptied when half full */

typedef struct {
    int64_t key[KEY_LEN];
    dnnl_primitive_t primitive; /* NULL: a free slot */
    dnnl_memory_desc_t a, b, c, bias;
} entry_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static dnnl_engine_t engine;
static dnnl_stream_t stream;
static entry_t cache[CACHE_SLOTS];
static int cached;

static void forget(entry_t *e) {
    dnnl_primitive_destroy(e->primitive);
    dnnl_memory_desc_destroy(e->a);
    dnnl_memory_desc_destroy(e->b);
    dnnl_memory_desc_destroy(e->c);
    if (e->bias) dnnl_memory_desc_destroy(e->bias);
    memset(e, 0, sizeof *e);
}

static uint64_t hash_of(const int64_t *key) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a over the key's words */
    for (int i = 0; i < KEY_LEN; i++) h = (h ^ (uint64_t)key[i]) * 1099511628211ull;
    return h;
}

/* The cached primitive for key, created on first use (open addressing, linear probing); NULL
 * when oneDNN refuses it. The host pads every dimension to a few sizes per octave
 * (dsq/kernels/onednn.py), so a training run meets a few hundred keys; should one ever meet more,
 * the table is emptied rather than kept by an eviction policy. */
static entry_t *primitive_for(const int64_t *key) {
    uint64_t slot = hash_of(key) & (CACHE_SLOTS - 1);
    while (cache[slot].primitive) {
        if (!memcmp(cache[slot].key, key, sizeof(int64_t) * KEY_LEN)) return &cache[slot];
        slot = (slot + 1) & (CACHE_SLOTS - 1);
    }
    if (cached >= CACHE_SLOTS / 2) {
        for (int i = 0; i < CACHE_SLOTS; i++)
            if (cache[i].primitive) forget(&cache[i]);
        cached = 0;
        slot = hash_of(key) & (CACHE_SLOTS - 1);
    }
    entry_t e;
    memset(&e, 0, sizeof e);
    memcpy(e.key, key, sizeof(int64_t) * KEY_LEN);
    int64_t batch = key[0], m = key[1], n = key[2], k = key[3];
    dnnl_dims_t dims_a = {batch, m, k}, strides_a = {key[4], key[5], key[6]};
    dnnl_dims_t dims_b = {batch, k, n}, strides_b = {key[7], key[8], key[9]};
    dnnl_dims_t dims_c = {batch, m, n}, strides_c = {m * n, n, 1};
    dnnl_dims_t dims_bias = {1, 1, n}, strides_bias = {n, n, 1};
    int has_bias = (int)key[10], accumulate = (int)key[11];
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t post_ops = NULL;
    dnnl_primitive_desc_t desc = NULL;
    int ok = dnnl_memory_desc_create_with_strides(&e.a, 3, dims_a, dnnl_bf16, strides_a) == 0 &&
             dnnl_memory_desc_create_with_strides(&e.b, 3, dims_b, dnnl_bf16, strides_b) == 0 &&
             dnnl_memory_desc_create_with_strides(&e.c, 3, dims_c, dnnl_f32, strides_c) == 0 &&
             (!has_bias || dnnl_memory_desc_create_with_strides(&e.bias, 3, dims_bias, dnnl_f32,
                                                                strides_bias) == 0) &&
             dnnl_primitive_attr_create(&attr) == 0;
    if (ok && accumulate) /* c += a b: a sum post-op, in float32 */
        ok = dnnl_post_ops_create(&post_ops) == 0 &&
             dnnl_post_ops_append_sum(post_ops, 1.0f, 0, dnnl_data_type_undef) == 0 &&
             dnnl_primitive_attr_set_post_ops(attr, post_ops) == 0;
    ok = ok && dnnl_matmul_primitive_desc_create(&desc, engine, e.a, e.b, e.bias, e.c, attr) == 0 &&
         dnnl_primitive_create(&e.primitive, desc) == 0;
    if (desc) dnnl_primitive_desc_destroy(desc);
    if (post_ops) dnnl_post_ops_destroy(post_ops);
    if (attr) dnnl_primitive_attr_destroy(attr);
    if (!ok) {
        if (e.primitive) dnnl_primitive_destroy(e.primitive);
        if (e.a) dnnl_memory_desc_destroy(e.a);
        if (e.b) dnnl_memory_desc_destroy(e.b);
        if (e.c) dnnl_memory_desc_destroy(e.c);
        if (e.bias) dnnl_memory_desc_destroy(e.bias);
        return NULL;
    }
    cache[slot] = e;
    cached++;
    return &cache[slot];
}

/* c[batch, m, n] (contiguous float32) = a[batch, m, k] @ b[batch, k, n] (+ bias[n]), a and b
 * bf16 with the given element strides (any layout oneDNN reads: a transposed view is a stride).
 * With accumulate, c += a @ b instead. Returns 0, or 1 when oneDNN has no engine or stream, 2
 * when it refuses the shape, 3 when the execution fails. */
int dsq_gemm_bf16(const uint16_t *a, const uint16_t *b, float *c, const float *bias,
                  int64_t batch, int64_t m, int64_t n, int64_t k, int64_t sa0, int64_t sa1,
                  int64_t sa2, int64_t sb0, int64_t sb1, int64_t sb2, int accumulate) {
    int64_t key[KEY_LEN] = {batch, m, n, k, sa0, sa1, sa2, sb0, sb1, sb2, bias != NULL,
                            accumulate != 0, 0};
    int status = 0;
    pthread_mutex_lock(&lock);
    if (!engine) {
        dnnl_engine_t made = NULL;
        if (dnnl_engine_create(&made, dnnl_cpu, 0) != 0 ||
            dnnl_stream_create(&stream, made, dnnl_stream_default_flags) != 0) {
            if (made) dnnl_engine_destroy(made);
            status = 1;
        } else {
            engine = made;
        }
    }
    entry_t *e = status ? NULL : primitive_for(key);
    if (!status && !e) status = 2;
    if (!status) {
        dnnl_memory_t ma = NULL, mb = NULL, mc = NULL, mbias = NULL;
        int made = dnnl_memory_create(&ma, e->a, engine, (void *)a) == 0 &&
                   dnnl_memory_create(&mb, e->b, engine, (void *)b) == 0 &&
                   dnnl_memory_create(&mc, e->c, engine, c) == 0 &&
                   (!bias || dnnl_memory_create(&mbias, e->bias, engine, (void *)bias) == 0);
        dnnl_exec_arg_t args[4] = {
            {DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}, {DNNL_ARG_BIAS, mbias}};
        if (!made || dnnl_primitive_execute(e->primitive, stream, bias ? 4 : 3, args) != 0 ||
            dnnl_stream_wait(stream) != 0)
            status = 3;
        if (ma) dnnl_memory_destroy(ma);
        if (mb) dnnl_memory_destroy(mb);
        if (mc) dnnl_memory_destroy(mc);
        if (mbias) dnnl_memory_destroy(mbias);
    }
    pthread_mutex_unlock(&lock);
    return status;
}
