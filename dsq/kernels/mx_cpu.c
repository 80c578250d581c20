/* C kernels for the OCP MX formats and NVFP4 on the CPU (docs/formats.md, "MX formats",
 * "NVFP4").
 *
 * They compute, bit for bit, what dsq/formats/mx.py and dsq/formats/nvfp4.py define: quantize,
 * the codes of a pack and the decode of an unpack, for float32 rows [rows, n] with the blocks
 * along the rows (a partial last block per row is a block of its own). mx_ops.cpp compiles this
 * file as C++ and registers each entry point as a torch custom op; the host glue
 * (dsq/formats/mx_c.py) lays the tensor out. Every pointer is to contiguous memory the caller
 * owns. Built with OpenMP, large calls run on as many threads as dsq_mx_set_threads last said;
 * results do not depend on the number of threads (blocks are independent, a max does not depend
 * on its order).
 *
 * An element type is given by its mantissa bits m, smallest normal exponent emin, largest power
 * exponent emax, largest normal value and whether it is INT8 (Element, below). Why float32 is
 * exact here (the reference works in float64):
 *   - the block's scale s = floor(log2 max|x|) - emax comes from the exponent field of the
 *     integer max of |x|'s bits, which is >= 0x7F800000 iff the block holds a NaN or an
 *     infinity; a subnormal or zero max reads -127, and the clamp to [-127, 127] gives the
 *     reference's s (every subnormal maximum has floor(log2) - emax <= -127);
 *   - v = x * 2^-s is exact: 2^-s is a float32 for s in [-127, 127], and v < 2^(emax+1) cannot
 *     overflow; where it underflows below 2^-126 it is far below half the element's smallest
 *     step (2^-17 at most), so it rounds to a zero of the same sign either way;
 *   - E(v): the step of v's binade is 2^k, k = max(floor(log2|v|), emin) - m, read from |v|'s
 *     exponent field; (|v| + 1.5 * 2^(k+23)) - 1.5 * 2^(k+23) rounds |v| to a multiple of 2^k,
 *     half to even, under the default rounding mode (|v| < 2^(k+m+1) keeps the sum in one
 *     binade of step 2^k), and the subtraction is exact; then the saturation, the sign of v
 *     restored (INT8: + 0.0f makes a zero +0.0);
 *   - E(v) * 2^s is exact: an element of at most 7 significant bits whose last one lies at or
 *     above 2^(emin - m - 127) >= 2^-143 is a float32 number.
 * NVFP4 is float32 arithmetic by definition: each operation below is the definition's, in its
 * order, and C's float operations round as torch's do (IEEE, nearest even). The build uses no
 * -ffast-math and no contraction into fused multiply-adds (dsq/kernels/cpu.py FLAGS).
 *
 * Codes (the pack payload): an element's code is sign | biased exponent | mantissa (the bits of
 * torch's float8 types for the fp8 elements), INT8's two's complement of 64 E(v); a block's
 * scale code is s + 127, 255 for a block holding NaN or an infinity (its element codes 0).
 * NVFP4's block code is its E4M3 scale's bits, 0x7F (E4M3's NaN) for such a block. Streams hold
 * code i at bits [i * w, (i + 1) * w), least significant bit first.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static int mx_team = 1; /* threads of the parallel loops: the caller's count */

void dsq_mx_set_threads(int count) { mx_team = count > 0 ? count : 1; }

#define MX_PARALLEL_MIN 32768 /* values below which one thread beats waking the others */
#define MX_CHUNK 8192         /* values per task of a pass over blocks */
static const uint32_t MX_NONFINITE = 0x7F800000u;

static inline uint32_t mx_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float mx_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* 2^k as float32 for integer k in [-149, 127]. */
static inline float mx_pow2(int k) {
    return k > -127 ? mx_float((uint32_t)(k + 127) << 23) : mx_float(1u << (k + 149));
}

typedef struct {
    int man_bits;     /* m */
    int emin;         /* the smallest normal exponent (INT8: 0) */
    int emax;         /* the exponent of the largest power of two (INT8: 0) */
    float max_normal; /* the largest finite value */
    int integer;      /* INT8: two's complement codes, zero is +0.0 */
    int bits;         /* the code's width */
    float zero;       /* added to E(v): +0.0f turns -0.0 into +0.0 (INT8), -0.0f changes nothing */
} Element;

/* E(v): the element value nearest to v, ties to even, saturated, sign kept (INT8: +0.0). */
static inline float element_round(float v, const Element *e) {
    const float a = __builtin_fabsf(v);
    const int ev = (int)(mx_bits(a) >> 23) - 127;
    const int k = (ev > e->emin ? ev : e->emin) - e->man_bits;
    const float magic = mx_float(((uint32_t)(k + 150) << 23) | 0x400000u); /* 1.5 * 2^(k+23) */
    float r = (a + magic) - magic;
    r = r < e->max_normal ? r : e->max_normal;
    return __builtin_copysignf(r, v) + e->zero;
}

/* The code of an element value q (finite, on the element's grid). Branch-free (both codes are
 * computed and one is chosen), so that loops of it vectorize: a branch on normal against
 * subnormal elements mispredicts on every other value of ordinary data. `below` is
 * 2^(man_bits - emin), the count of smallest steps in one unit. */
static inline uint8_t element_code(float q, const Element *e, float below) {
    const uint32_t sign = (mx_bits(q) >> 31) << (e->bits - 1);
    const float a = __builtin_fabsf(q);
    const uint32_t u = mx_bits(a);
    const uint32_t field = (u >> 23) - 127u - (uint32_t)e->emin + 1u;
    const uint32_t normal =
        (field << e->man_bits) | ((u >> (23 - e->man_bits)) & ((1u << e->man_bits) - 1));
    /* below the smallest normal: the number of smallest steps (capped so that the conversion
     * is defined; the result is dropped for a normal element) */
    const float steps = a * below;
    const uint32_t subnormal = (uint32_t)(int32_t)(steps < 255.0f ? steps : 255.0f);
    const uint32_t keep = 0u - (uint32_t)((u >> 23) >= (uint32_t)(e->emin + 127));
    return (uint8_t)(sign | (normal & keep) | (subnormal & ~keep));
}

static inline uint32_t mx_abs_max(const float *x, int64_t count) {
    uint32_t amax = 0;
    for (int64_t i = 0; i < count; i++) {
        const uint32_t a = mx_bits(x[i]) & 0x7FFFFFFFu;
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* The block's scale exponent s (steps 2-3 of docs/formats.md, "MX formats"). */
static inline int mx_scale(uint32_t amax, int emax) {
    const int s = (int)(amax >> 23) - 127 - emax;
    return s < -127 ? -127 : (s > 127 ? 127 : s);
}

/* One block: the values (out) or the codes (codes, and its scale code), of `count` floats. */
static inline void mx_block(const float *restrict x, float *restrict out, uint8_t *restrict codes,
                            uint8_t *scale, int64_t count, const Element *e) {
    const uint32_t amax = mx_abs_max(x, count);
    if (amax >= MX_NONFINITE) {
        if (out)
            for (int64_t i = 0; i < count; i++) out[i] = __builtin_nanf("");
        if (codes) memset(codes, 0, (size_t)count);
        if (scale) *scale = 255;
        return;
    }
    const int s = mx_scale(amax, e->emax);
    const float down = mx_pow2(-s), up = mx_pow2(s);
    const Element local = *e; /* a copy the stores cannot alias, so that the loops vectorize */
    if (out)
        for (int64_t i = 0; i < count; i++) out[i] = element_round(x[i] * down, &local) * up;
    if (codes && local.integer) {
        for (int64_t i = 0; i < count; i++)
            codes[i] = (uint8_t)(int32_t)(element_round(x[i] * down, &local) * 64.0f);
    } else if (codes) {
        const float below = mx_pow2(local.man_bits - local.emin);
        for (int64_t i = 0; i < count; i++)
            codes[i] = element_code(element_round(x[i] * down, &local), &local, below);
    }
    if (scale) *scale = (uint8_t)(s + 127);
}

/* The blocks of rows [rows, n], blocks of `block` along each row: values into out [rows, n], or
 * codes into codes [rows, n] and scales [rows, ceil(n / block)] (either pointer pair may be
 * null). */
static void mx_rows(const float *x, float *out, uint8_t *codes, uint8_t *scales, int64_t rows,
                    int64_t n, int64_t block, const Element *e) {
    const int64_t per_row = (n + block - 1) / block, total = rows * per_row;
    const int64_t per_task = MX_CHUNK / block + 1;
#pragma omp parallel for schedule(static) num_threads(mx_team) if (rows * n >= MX_PARALLEL_MIN)
    for (int64_t start = 0; start < total; start += per_task) {
        const int64_t end = total - start < per_task ? total : start + per_task;
        for (int64_t b = start; b < end; b++) {
            const int64_t r = b / per_row, j = (b % per_row) * block;
            const int64_t at = r * n + j, count = n - j < block ? n - j : block;
            if (count == 32 && block == 32) /* the common case, inlined with a constant length */
                mx_block(x + at, out ? out + at : 0, codes ? codes + at : 0,
                         scales ? scales + b : 0, 32, e);
            else
                mx_block(x + at, out ? out + at : 0, codes ? codes + at : 0,
                         scales ? scales + b : 0, count, e);
        }
    }
}

static Element element_of(int bits, int man_bits, int emin, int emax, float max_normal,
                          int integer) {
    Element e = {man_bits, emin, emax, max_normal, integer, bits, integer ? 0.0f : -0.0f};
    return e;
}

void dsq_mx_quantize(const float *x, float *out, int64_t rows, int64_t n, int64_t block,
                     int bits, int man_bits, int emin, int emax, float max_normal, int integer) {
    const Element e = element_of(bits, man_bits, emin, emax, max_normal, integer);
    mx_rows(x, out, 0, 0, rows, n, block, &e);
}

void dsq_mx_codes(const float *x, uint8_t *codes, uint8_t *scales, int64_t rows, int64_t n,
                  int64_t block, int bits, int man_bits, int emin, int emax, float max_normal,
                  int integer) {
    const Element e = element_of(bits, man_bits, emin, emax, max_normal, integer);
    mx_rows(x, 0, codes, scales, rows, n, block, &e);
}

/* ---------------------------------------------------------------------------- streams */
/* The stream of `count` codes at `bits` in {4, 6, 8} (bytes: ceil(count * bits / 8)). */
void dsq_mx_pack_stream(const uint8_t *codes, uint8_t *stream, int64_t count, int bits) {
    if (bits == 8) {
        memcpy(stream, codes, (size_t)count);
        return;
    }
    const int per = bits == 4 ? 2 : 4, bytes = bits == 4 ? 1 : 3;
    const int64_t groups = count / per;
    if (bits == 4) {
#pragma omp parallel for simd schedule(static) num_threads(mx_team) if (count >= MX_PARALLEL_MIN)
        for (int64_t g = 0; g < groups; g++)
            stream[g] = (uint8_t)(codes[2 * g] | (codes[2 * g + 1] << 4));
    } else {
#pragma omp parallel for schedule(static) num_threads(mx_team) if (count >= MX_PARALLEL_MIN)
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *c = codes + 4 * g;
            const uint32_t w = c[0] | (c[1] << 6) | ((uint32_t)c[2] << 12) | ((uint32_t)c[3] << 18);
            stream[3 * g] = (uint8_t)w;
            stream[3 * g + 1] = (uint8_t)(w >> 8);
            stream[3 * g + 2] = (uint8_t)(w >> 16);
        }
    }
    const int64_t rest = count - groups * per;
    if (rest > 0) {
        uint32_t w = 0;
        for (int64_t i = 0; i < rest; i++) w |= (uint32_t)codes[groups * per + i] << (bits * i);
        const int64_t used = (rest * bits + 7) / 8;
        for (int64_t i = 0; i < used; i++) stream[groups * bytes + i] = (uint8_t)(w >> (8 * i));
    }
}

/* Code i of a stream at `bits` in {4, 6, 8}. */
static inline uint32_t stream_code(const uint8_t *stream, int64_t i, int bits) {
    if (bits == 8) return stream[i];
    if (bits == 4) return (stream[i >> 1] >> ((i & 1) * 4)) & 0xF;
    const int64_t bit = i * 6, at = bit >> 3;
    const int shift = (int)(bit & 7);
    uint32_t w = stream[at];
    if (shift > 2) w |= (uint32_t)stream[at + 1] << 8;
    return (w >> shift) & 0x3F;
}

/* Values [rows, n] of an MX stream and its scales [rows, ceil(n / block)], each code's value
 * looked up in `table` [2^bits]. */
void dsq_mx_decode(const uint8_t *stream, const uint8_t *scales, const float *table, float *out,
                   int64_t rows, int64_t n, int64_t block, int bits) {
    const int64_t per_row = (n + block - 1) / block, total = rows * per_row;
    const int64_t per_task = MX_CHUNK / block + 1;
#pragma omp parallel for schedule(static) num_threads(mx_team) if (rows * n >= MX_PARALLEL_MIN)
    for (int64_t start = 0; start < total; start += per_task) {
        const int64_t end = total - start < per_task ? total : start + per_task;
        for (int64_t b = start; b < end; b++) {
            const int64_t r = b / per_row, j = (b % per_row) * block;
            const int64_t at = r * n + j, count = n - j < block ? n - j : block;
            float *o = out + at;
            if (scales[b] == 255) {
                for (int64_t i = 0; i < count; i++) o[i] = __builtin_nanf("");
                continue;
            }
            const float up = mx_pow2((int)scales[b] - 127);
            if (bits == 8) {
                const uint8_t *c = stream + at;
                for (int64_t i = 0; i < count; i++) o[i] = table[c[i]] * up;
            } else {
                for (int64_t i = 0; i < count; i++) o[i] = table[stream_code(stream, at + i, bits)] * up;
            }
        }
    }
}

/* ---------------------------------------------------------------------------- NVFP4 */
static const Element NV_E2M1 = {1, 0, 2, 6.0f, 0, 4, -0.0f};
static const Element NV_E4M3 = {3, -6, 8, 448.0f, 0, 8, -0.0f};

/* s: max(fl(A / 2688), 2^-121), A the largest finite |x| of the tensor [count]. */
float dsq_nvfp4_tensor_scale(const float *x, int64_t count) {
    uint32_t amax = 0;
#pragma omp parallel for simd reduction(max : amax) schedule(static) num_threads(mx_team) \
    if (count >= MX_PARALLEL_MIN)
    for (int64_t i = 0; i < count; i++) {
        uint32_t a = mx_bits(x[i]) & 0x7FFFFFFFu;
        a = a < MX_NONFINITE ? a : 0;
        amax = a > amax ? a : amax;
    }
    const float s = mx_float(amax) / 2688.0f, floor = mx_pow2(-121);
    return s < floor ? floor : s;
}

/* One NVFP4 block of `count` floats under the tensor scale s: values (out) or the E2M1 codes and
 * the E4M3 scale code. */
static inline void nvfp4_block(const float *restrict x, float *restrict out,
                               uint8_t *restrict codes, uint8_t *scale, int64_t count, float s,
                               float inverse) {
    uint32_t amax = 0, nonfinite = 0;
    for (int64_t i = 0; i < count; i++) {
        const uint32_t a = mx_bits(x[i]) & 0x7FFFFFFFu;
        nonfinite |= a >= MX_NONFINITE;
        amax = a > amax ? a : amax;
    }
    if (nonfinite) {
        if (out)
            for (int64_t i = 0; i < count; i++) out[i] = __builtin_nanf("");
        if (codes) memset(codes, 0, (size_t)count);
        if (scale) *scale = 0x7F;
        return;
    }
    float t = mx_float(amax) / 6.0f / s;
    t = t < 0.015625f ? 0.015625f : (t > 448.0f ? 448.0f : t);
    const float c = element_round(t, &NV_E4M3);
    const float r = inverse / c, d = s * c;
    if (out)
        for (int64_t i = 0; i < count; i++) out[i] = element_round(x[i] * r, &NV_E2M1) * d;
    if (codes)
        for (int64_t i = 0; i < count; i++)
            codes[i] = element_code(element_round(x[i] * r, &NV_E2M1), &NV_E2M1, 2.0f);
    if (scale) *scale = element_code(c, &NV_E4M3, 512.0f);
}

#define NV_TASK 512 /* blocks per task of `nvfp4_whole_blocks` */

/* `nvfp4_block` over `count` <= NV_TASK whole blocks of 16 at x: each step a loop over the
 * blocks (maxima, then the scales, then the values), which vectorizes across blocks where the
 * block-at-a-time code would divide one block at a time. */
static void nvfp4_task(const float *restrict x, float *restrict out, uint8_t *restrict codes,
                       uint8_t *restrict scales, int64_t count, float s, float inverse) {
    uint32_t amax[NV_TASK], bad[NV_TASK];
    float r[NV_TASK], d[NV_TASK];
    for (int64_t b = 0; b < count; b++) {
        const uint32_t m = mx_abs_max(x + b * 16, 16);
        amax[b] = m < MX_NONFINITE ? m : 0;
        bad[b] = m >= MX_NONFINITE;
    }
    for (int64_t b = 0; b < count; b++) {
        float t = mx_float(amax[b]) / 6.0f / s;
        t = t < 0.015625f ? 0.015625f : (t > 448.0f ? 448.0f : t);
        const float c = element_round(t, &NV_E4M3);
        r[b] = inverse / c;
        d[b] = bad[b] ? __builtin_nanf("") : s * c;
        if (scales) scales[b] = bad[b] ? 0x7F : element_code(c, &NV_E4M3, 512.0f);
    }
    for (int64_t b = 0; b < count; b++) {
        const float *xb = x + b * 16;
        if (out) {
            float *o = out + b * 16;
            for (int i = 0; i < 16; i++) o[i] = element_round(xb[i] * r[b], &NV_E2M1) * d[b];
        } else {
            uint8_t *c = codes + b * 16;
            const uint8_t keep = bad[b] ? 0 : 0xFF;
            for (int i = 0; i < 16; i++)
                c[i] = element_code(element_round(xb[i] * r[b], &NV_E2M1), &NV_E2M1, 2.0f) & keep;
        }
    }
}

static void nvfp4_rows(const float *x, float *out, uint8_t *codes, uint8_t *scales, int64_t rows,
                       int64_t n, float s) {
    const float inverse = 1.0f / s;
    if (n % 16 == 0) { /* whole blocks: the rows are one run of blocks */
        const int64_t total = rows * n / 16;
#pragma omp parallel for schedule(static) num_threads(mx_team) if (rows * n >= MX_PARALLEL_MIN)
        for (int64_t start = 0; start < total; start += NV_TASK) {
            const int64_t count = total - start < NV_TASK ? total - start : NV_TASK;
            nvfp4_task(x + start * 16, out ? out + start * 16 : 0, codes ? codes + start * 16 : 0,
                       scales ? scales + start : 0, count, s, inverse);
        }
        return;
    }
    const int64_t per_row = (n + 15) / 16, total = rows * per_row, per_task = MX_CHUNK / 16;
#pragma omp parallel for schedule(static) num_threads(mx_team) if (rows * n >= MX_PARALLEL_MIN)
    for (int64_t start = 0; start < total; start += per_task) {
        const int64_t end = total - start < per_task ? total : start + per_task;
        for (int64_t b = start; b < end; b++) {
            const int64_t r = b / per_row, j = (b % per_row) * 16;
            const int64_t at = r * n + j, count = n - j < 16 ? n - j : 16;
            nvfp4_block(x + at, out ? out + at : 0, codes ? codes + at : 0,
                        scales ? scales + b : 0, count, s, inverse);
        }
    }
}

void dsq_nvfp4_quantize(const float *x, float *out, int64_t rows, int64_t n, float s) {
    nvfp4_rows(x, out, 0, 0, rows, n, s);
}

void dsq_nvfp4_codes(const float *x, uint8_t *codes, uint8_t *scales, int64_t rows, int64_t n,
                     float s) {
    nvfp4_rows(x, 0, codes, scales, rows, n, s);
}

/* Values [rows, n] of an NVFP4 stream, its E4M3 scale codes and the tensor scale s: e * fl(s *
 * c), c from `e4m3` [256], e from `e2m1` [16]. */
void dsq_nvfp4_decode(const uint8_t *stream, const uint8_t *scales, const float *e2m1,
                      const float *e4m3, float s, float *out, int64_t rows, int64_t n) {
    const int64_t per_row = (n + 15) / 16, total = rows * per_row, per_task = MX_CHUNK / 16;
#pragma omp parallel for schedule(static) num_threads(mx_team) if (rows * n >= MX_PARALLEL_MIN)
    for (int64_t start = 0; start < total; start += per_task) {
        const int64_t end = total - start < per_task ? total : start + per_task;
        for (int64_t b = start; b < end; b++) {
            const int64_t r = b / per_row, j = (b % per_row) * 16;
            const int64_t at = r * n + j, count = n - j < 16 ? n - j : 16;
            float *o = out + at;
            if (scales[b] == 0x7F) {
                for (int64_t i = 0; i < count; i++) o[i] = __builtin_nanf("");
                continue;
            }
            const float d = s * e4m3[scales[b]];
            for (int64_t i = 0; i < count; i++) o[i] = e2m1[stream_code(stream, at + i, 4)] * d;
        }
    }
}

/* ---------------------------------------------------------------------------- the q0 + stash pair */
/* One side of the pair: an MX format (its element and block) or NVFP4 (block 16, tensor scale s). */
typedef struct {
    int nvfp4;
    Element e;
    int64_t block;
    float s, inverse;
} Side;

static inline void side_block(const Side *side, const float *x, float *out, uint8_t *codes,
                              uint8_t *scale, int64_t count) {
    if (side->nvfp4)
        nvfp4_block(x, out, codes, scale, count, side->s, side->inverse);
    else
        mx_block(x, out, codes, scale, count, &side->e);
}

/* The stash codes of one block of `rows` rows (row i at tile + i * stride_n) of K columns, an MX
 * side p, each column a block: every step a loop along the columns (their maxima, scales and
 * codes, contiguous in the rows), the codes written row by row into `by_row` [rows, K] and then
 * transposed into codes (column k's run at codes + k * N). */
static void mx_stash_columns(const float *tile, int64_t rows, int64_t K, int64_t stride_n,
                             const Element *e, uint8_t *codes, int64_t N, uint8_t *scales,
                             int64_t per_matrix, uint32_t *amax, float *down, uint8_t *keep,
                             uint8_t *by_row) {
    const Element local = *e;
    const float below = mx_pow2(local.man_bits - local.emin);
    for (int64_t k = 0; k < K; k++) amax[k] = 0;
    for (int64_t i = 0; i < rows; i++) {
        const float *row = tile + i * stride_n;
        for (int64_t k = 0; k < K; k++) {
            const uint32_t a = mx_bits(row[k]) & 0x7FFFFFFFu;
            amax[k] = a > amax[k] ? a : amax[k];
        }
    }
    for (int64_t k = 0; k < K; k++) {
        const int bad = amax[k] >= MX_NONFINITE, s = mx_scale(amax[k], local.emax);
        down[k] = bad ? 0.0f : mx_pow2(-s);
        keep[k] = bad ? 0 : 0xFF;
        scales[k * per_matrix] = (uint8_t)(bad ? 255 : s + 127);
    }
    for (int64_t i = 0; i < rows; i++) {
        const float *row = tile + i * stride_n;
        uint8_t *out = by_row + i * K;
        if (local.integer)
            for (int64_t k = 0; k < K; k++)
                out[k] = (uint8_t)(int32_t)(element_round(row[k] * down[k], &local) * 64.0f) & keep[k];
        else
            for (int64_t k = 0; k < K; k++)
                out[k] = element_code(element_round(row[k] * down[k], &local), &local, below) & keep[k];
    }
    for (int64_t k = 0; k < K; k++)
        for (int64_t i = 0; i < rows; i++) codes[k * N + i] = by_row[i * K + k];
}

/* For x [L, N, K] (K contiguous, rows N apart by stride_n, matrices by stride_l): the values of
 * side q along K into values [L, N, K], and the stash codes of side p along N into codes
 * [L, K, N] with one scale code per block into scales [L, K, ceil(N / p.block)]. One task is one
 * block of p.block rows of one matrix: its rows are quantized along K (which brings them into
 * cache), then its columns' blocks are encoded from the cached rows (an MX side along the
 * columns at once, `mx_stash_columns`; NVFP4 one column at a time), so x is read from memory
 * once and never transposed. */
static void pair_tiles(const float *x, float *values, uint8_t *codes, uint8_t *scales, int64_t L,
                       int64_t N, int64_t K, int64_t stride_l, int64_t stride_n, const Side *q,
                       const Side *p) {
    const int64_t per_matrix = (N + p->block - 1) / p->block, tasks = L * per_matrix;
#pragma omp parallel num_threads(mx_team) if (L * N * K >= MX_PARALLEL_MIN)
    {
        float *column = (float *)malloc(sizeof(float) * (size_t)p->block);
        uint32_t *amax = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)K);
        float *down = (float *)malloc(sizeof(float) * (size_t)K);
        uint8_t *keep = (uint8_t *)malloc((size_t)K);
        uint8_t *by_row = (uint8_t *)malloc((size_t)(K * p->block));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t l = t / per_matrix, blk = t % per_matrix, n0 = blk * p->block;
            const int64_t rows = N - n0 < p->block ? N - n0 : p->block;
            const float *tile = x + l * stride_l + n0 * stride_n;
            for (int64_t i = 0; i < rows; i++) {
                const float *row = tile + i * stride_n;
                float *out = values + (l * N + n0 + i) * K;
                for (int64_t j = 0; j < K; j += q->block)
                    side_block(q, row + j, out + j, 0, 0, K - j < q->block ? K - j : q->block);
            }
            if (!p->nvfp4) {
                mx_stash_columns(tile, rows, K, stride_n, &p->e, codes + l * K * N + n0, N,
                                 scales + l * K * per_matrix + blk, per_matrix, amax, down, keep,
                                 by_row);
                continue;
            }
            for (int64_t k = 0; k < K; k++) {
                for (int64_t i = 0; i < rows; i++) column[i] = tile[i * stride_n + k];
                const int64_t at = (l * K + k) * N + n0;
                side_block(p, column, 0, codes + at, scales + (l * K + k) * per_matrix + blk, rows);
            }
        }
        free(column);
        free(amax);
        free(down);
        free(keep);
        free(by_row);
    }
}

void dsq_mx_quantize_and_pack(const float *x, float *values, uint8_t *codes, uint8_t *scales,
                              int64_t L, int64_t N, int64_t K, int64_t stride_l, int64_t stride_n,
                              const int64_t *q_desc, float q_max, float q_s, const int64_t *p_desc,
                              float p_max, float p_s) {
    /* desc: nvfp4, block, bits, man_bits, emin, emax, integer */
    Side q = {(int)q_desc[0], element_of((int)q_desc[2], (int)q_desc[3], (int)q_desc[4],
                                         (int)q_desc[5], q_max, (int)q_desc[6]),
              q_desc[1], q_s, 1.0f / q_s};
    Side p = {(int)p_desc[0], element_of((int)p_desc[2], (int)p_desc[3], (int)p_desc[4],
                                         (int)p_desc[5], p_max, (int)p_desc[6]),
              p_desc[1], p_s, 1.0f / p_s};
    pair_tiles(x, values, codes, scales, L, N, K, stride_l, stride_n, &q, &p);
}
