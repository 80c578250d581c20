/* C kernels for block floating point on the CPU, nearest rounding (docs/formats.md).
 *
 * They compute, bit for bit, what dsq/formats/bfp_reference.py defines, for the formats the
 * training loop quantizes with every step: BFP(m, E, B) with E <= 8 and 2 <= m <= 23, and
 * fixed<w> (one block spanning the tensor) with w <= 23. bfp_ops.cpp compiles this file as C++
 * (the casts of malloc's result are for C++) and registers each entry point as a torch custom
 * op; the host glue (dsq/kernels/cpu.py and dsq/formats/bfp_c.py) lays the tensor out
 * as float32 with the block axis last and contiguous, and sends every other case to the
 * torch.compile kernels. Every pointer is to contiguous memory owned by the caller (the ops
 * allocate it and check its dtype and length). Built with OpenMP, large calls run on as many
 * threads as dsq_set_threads last said (torch's count); every result is the same for any number
 * of threads (blocks are independent, and a max does not depend on its order).
 *
 * Why float32 is exact here (the reference works in float64):
 *   - e = floor(log2 max|x|) comes from the bits: the integer max of (bits & 0x7FFFFFFF) over a
 *     block is the bit pattern of max|x|, and is >= 0x7F800000 iff the block holds a NaN or an
 *     infinity. Its exponent field minus 127 is e for a normal max; a subnormal or zero max reads
 *     -127, which the clamp to [-emax, emax] (emax <= 127 for E <= 8) turns into the reference's
 *     -emax, as it does for every e below -emax.
 *   - p = 2^e and 1/p = 2^-e are float32 values for e in [-127, 127] (2^-127 is subnormal), so
 *     x * (1/p) is the correctly rounded x / p, and multiplying by 2^(m-2) afterwards is exact
 *     (or overflows to infinity only where the clamp takes the value to the limit anyway).
 *   - Rounding half to even: after the clamp to [-(2^(m-1) - 1), 2^(m-1) - 1] (the same as
 *     clamping after rounding, the limit being an integer), |v| < 2^22, and (|v| + 1.5 * 2^23)
 *     - 1.5 * 2^23 rounds it to an integer under the default rounding mode, the sign restored
 *     afterwards (a negative value rounding to zero gives -0.0, as the reference's round does).
 *     This needs IEEE arithmetic: the build uses no -ffast-math and no contraction.
 *   - q * 2^(2-m) is exact (|q| < 2^22), and one product by p rounds once, to the reference's
 *     value (a multiple of 2^-149, representable).
 *
 * Codes (the pack payload): sign-magnitude mantissas, the sign bit m-1 taken from x's sign bit
 * (rounding and clamping keep the sign, -0.0 included); exponent codes e + emax, and 2^E - 1
 * with all-zero mantissas for a block holding NaN or infinity. Streams hold code i at bits
 * [i * w, (i + 1) * w), least significant bit first.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
static int team = 1; /* threads of the parallel loops: the caller's count (dsq_set_threads) */
static int threads(void) { return team; }
static int thread_index(void) { return omp_get_thread_num(); }
#else
static int team = 1;
static int threads(void) { return 1; }
static int thread_index(void) { return 0; }
#endif

/* The number of threads the parallel loops use from now on: the host passes torch's own count,
 * so that the kernels follow torch.set_num_threads whichever OpenMP runtime they bound to. */
void dsq_set_threads(int count) { team = count > 0 ? count : 1; }

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static const uint32_t NONFINITE = 0x7F800000u; /* |x| bits at or above: inf or NaN */
/* Work (values) below which one thread beats waking the others (OpenMP, when built with it:
 * the pragmas use the caller's thread pool, torch's own libgomp, and its thread count). */
#define PARALLEL_MIN 32768
#define CHUNK 4096 /* values per task of an elementwise pass */
static const float ROUNDER = 12582912.0f;      /* 1.5 * 2^23 */

/* 2^k as float32 for integer k in [-127, 127] (2^-127 is the one subnormal). */
static inline float pow2(int k) {
    return k > -127 ? float_of((uint32_t)(k + 127) << 23) : float_of(1u << 22);
}

/* The block exponent e of a finite block whose integer max of |x| bits is amax. */
static inline int block_exponent(uint32_t amax, int emax) {
    int e = (int)(amax >> 23) - 127;
    return e < -emax ? -emax : (e > emax ? emax : e);
}

/* round(clamp(v, -limit, limit)), half to even, sign of v kept. */
static inline float round_clamped(float v, float limit) {
    float c = v < -limit ? -limit : (v > limit ? limit : v);
    float magnitude = (__builtin_fabsf(c) + ROUNDER) - ROUNDER;
    return __builtin_copysignf(magnitude, v);
}

static inline uint32_t abs_max_bits(const float *x, int64_t count) {
    uint32_t amax = 0;
    for (int64_t i = 0; i < count; i++) {
        uint32_t a = bits_of(x[i]) & 0x7FFFFFFFu;
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* abs_max_bits of a whole tensor, on every thread (the max is the same in any order). */
static uint32_t abs_max_bits_parallel(const float *x, int64_t count) {
    uint32_t amax = 0;
#pragma omp parallel for simd reduction(max : amax) schedule(static) num_threads(team) \
    if (count >= PARALLEL_MIN)
    for (int64_t i = 0; i < count; i++) {
        uint32_t a = bits_of(x[i]) & 0x7FFFFFFFu;
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* The scale constants of BFP(m, E) (or fixed<m>) for one block. */
typedef struct {
    int emax;
    float limit; /* 2^(m-1) - 1 */
    float up;    /* 2^(m-2) */
    float down;  /* 2^(2-m) */
} Format;

static inline Format format_of(int man_bits, int exp_bits) {
    Format f;
    f.emax = (1 << (exp_bits - 1)) - 1;
    f.limit = (float)((1 << (man_bits - 1)) - 1);
    f.up = pow2(man_bits - 2);
    f.down = pow2(2 - man_bits);
    return f;
}

/* out = the values of `count` floats of one block whose integer max of |x| bits is amax. */
static inline void quantize_run(const float *restrict x, float *restrict out, int64_t count,
                                uint32_t amax, Format f) {
    if (amax >= NONFINITE) {
        for (int64_t i = 0; i < count; i++) out[i] = __builtin_nanf("");
        return;
    }
    int e = block_exponent(amax, f.emax);
    float p = pow2(e), inverse = pow2(-e);
    for (int64_t i = 0; i < count; i++)
        out[i] = round_clamped(x[i] * inverse * f.up, f.limit) * f.down * p;
}

/* The blocks of `count` floats, one at a time; inlined with count = 16 for the common case. */
static inline void quantize_blocks(const float *x, float *out, int64_t n_blocks, int64_t count,
                                   Format f) {
    for (int64_t b = 0; b < n_blocks; b++) {
        const float *xb = x + b * count;
        quantize_run(xb, out + b * count, count, abs_max_bits(xb, count), f);
    }
}

static void quantize_blocks_serial(const float *x, float *out, int64_t n_blocks, int64_t block,
                                   Format f) {
    if (block == 16)
        quantize_blocks(x, out, n_blocks, 16, f);
    else
        quantize_blocks(x, out, n_blocks, block, f);
}

/* BFP(man_bits, exp_bits, block) quantize of n_blocks contiguous blocks: x, out [n_blocks,
 * block]. */
void dsq_bfp_quantize(const float *x, float *out, int64_t n_blocks, int64_t block, int man_bits,
                      int exp_bits) {
    const Format f = format_of(man_bits, exp_bits);
    const int64_t per_task = CHUNK / block + 1;
#pragma omp parallel for schedule(static) num_threads(team) if (n_blocks * block >= PARALLEL_MIN)
    for (int64_t start = 0; start < n_blocks; start += per_task) {
        int64_t count = n_blocks - start < per_task ? n_blocks - start : per_task;
        quantize_blocks_serial(x + start * block, out + start * block, count, block, f);
    }
}

/* fixed<man_bits> quantize (one block of n values, exponent width exp_bits). */
/* The BFP(man_bits <= 8, exp_bits, block) codes of n_blocks contiguous blocks x [n_blocks, block]:
 * each value's sign-magnitude mantissa code (the sign bit of x, -0.0's included, above the
 * magnitude of the rounded integer quantize_run scales by the block's power), one byte each,
 * [n_blocks, block]; each block's exponent code e + emax, [n_blocks]. A block holding NaN or inf
 * has codes 0 and the exponent code 2^exp_bits - 1 (it decodes to NaN). */
void dsq_bfp_codes(const float *x, uint8_t *codes, uint8_t *exps, int64_t n_blocks, int64_t block,
                   int man_bits, int exp_bits) {
    const Format f = format_of(man_bits, exp_bits);
    const int64_t per_task = CHUNK / block + 1;
#pragma omp parallel for schedule(static) num_threads(team) if (n_blocks * block >= PARALLEL_MIN)
    for (int64_t start = 0; start < n_blocks; start += per_task) {
        const int64_t end = n_blocks - start < per_task ? n_blocks : start + per_task;
        for (int64_t b = start; b < end; b++) {
            const float *xb = x + b * block;
            uint8_t *cb = codes + b * block;
            const uint32_t amax = abs_max_bits(xb, block);
            if (amax >= NONFINITE) {
                memset(cb, 0, (size_t)block);
                exps[b] = (uint8_t)((1u << exp_bits) - 1);
                continue;
            }
            const int e = block_exponent(amax, f.emax);
            const float inverse = pow2(-e);
            exps[b] = (uint8_t)(e + f.emax);
            for (int64_t i = 0; i < block; i++) {
                const float q = round_clamped(xb[i] * inverse * f.up, f.limit);
                cb[i] = (uint8_t)(((bits_of(xb[i]) >> 31) << (man_bits - 1)) |
                                  (uint32_t)(int32_t)__builtin_fabsf(q));
            }
        }
    }
}

void dsq_fixed_quantize(const float *x, float *out, int64_t n, int man_bits, int exp_bits) {
    const uint32_t amax = abs_max_bits_parallel(x, n);
    const Format f = format_of(man_bits, exp_bits);
#pragma omp parallel for schedule(static) num_threads(team) if (n >= PARALLEL_MIN)
    for (int64_t start = 0; start < n; start += CHUNK)
        quantize_run(x + start, out + start, n - start < CHUNK ? n - start : CHUNK, amax, f);
}

/* first = fixed<f_man> quantize of x [n], and second = BFP(s_man, s_exp, s_block) quantize of
 * first in contiguous blocks (n a multiple of s_block): the engine's q3 then q2 of a gradient.
 * After the tensor's max, one pass: each block of `first` is quantized again while in cache. */
void dsq_fixed_then_bfp(const float *x, float *first, float *second, int64_t n, int f_man,
                        int f_exp, int s_man, int s_exp, int64_t s_block) {
    const uint32_t amax = abs_max_bits_parallel(x, n);
    const Format f = format_of(f_man, f_exp), s = format_of(s_man, s_exp);
    const int64_t n_blocks = n / s_block;
#pragma omp parallel for schedule(static) num_threads(team) if (n >= PARALLEL_MIN)
    for (int64_t b = 0; b < n_blocks; b++) {
        const int64_t at = b * s_block;
        if (s_block == 16) {
            quantize_run(x + at, first + at, 16, amax, f);
            quantize_run(first + at, second + at, 16, abs_max_bits(first + at, 16), s);
        } else {
            quantize_run(x + at, first + at, s_block, amax, f);
            quantize_run(first + at, second + at, s_block, abs_max_bits(first + at, s_block), s);
        }
    }
}

/* Scratch of one tile of `rows` x `k` (per thread). */
typedef struct {
    uint32_t *amax;  /* [k] column maxima (bits of |x|) */
    float *inverse;  /* [k] 1/p of each column, 0 for a column holding NaN or inf */
    float *power;    /* [k] p of each column, NaN for a column holding NaN or inf */
    uint8_t *keep;   /* [k] 0xFF, or 0 for a column holding NaN or inf */
    uint8_t *exps;   /* [k] the exponent codes */
    uint64_t *words; /* [k] one group of each column's codes, bit-packed */
    uint8_t *by_row; /* [rows, k] the codes before the transpose (`tile_codes`) */
} TileScratch;

static size_t tile_scratch_bytes(int64_t rows, int64_t k) {
    return ((size_t)k * (8 + 4 + 4 + 4 + 1 + 1 + (size_t)rows) + 63) / 64 * 64;
}

static TileScratch tile_scratch(char *memory, int64_t k) {
    TileScratch s;
    s.words = (uint64_t *)memory; /* the 8-byte array first: aligned */
    s.amax = (uint32_t *)(memory + k * 8);
    s.inverse = (float *)(memory + k * 12);
    s.power = (float *)(memory + k * 16);
    s.keep = (uint8_t *)(memory + k * 20);
    s.exps = (uint8_t *)(memory + k * 21);
    s.by_row = (uint8_t *)(memory + k * 22);
    return s;
}

/* The block of each column of a tile x [rows, k] (`row_stride` floats apart): its max, p, 1/p
 * and finiteness into the scratch, and its exponent code to exps[kk * exp_stride] (unless exps is
 * NULL). */
static void column_scales(const float *x, int64_t rows, int64_t k, int64_t row_stride,
                          TileScratch s, uint8_t *exps, int64_t exp_stride, Format f,
                          int exp_bits) {
    const uint8_t nonfinite_code = (uint8_t)((1u << exp_bits) - 1);
    memset(s.amax, 0, (size_t)k * sizeof *s.amax);
    for (int64_t r = 0; r < rows; r++) /* vectorised along k */
        for (int64_t kk = 0; kk < k; kk++) {
            uint32_t a = bits_of(x[r * row_stride + kk]) & 0x7FFFFFFFu;
            s.amax[kk] = a > s.amax[kk] ? a : s.amax[kk];
        }
    for (int64_t kk = 0; kk < k; kk++) { /* branch-free, so that it is vectorised too */
        int finite = s.amax[kk] < NONFINITE;
        int e = block_exponent(s.amax[kk], f.emax); /* any value for a non-finite column */
        s.inverse[kk] = finite ? pow2(-e) : 0.0f;
        s.power[kk] = finite ? pow2(e) : __builtin_nanf("");
        s.keep[kk] = finite ? 0xFF : 0;
        s.exps[kk] = finite ? (uint8_t)(e + f.emax) : nonfinite_code;
    }
    if (exps)
        for (int64_t kk = 0; kk < k; kk++) exps[kk * exp_stride] = s.exps[kk];
}

/* The values of a tile x [rows, k] quantized along its rows (one block per column), after
 * `column_scales`: vectorised along k. A column holding NaN or inf comes out NaN (its power is
 * NaN; no value reaches a conversion to an integer). */
static void tile_values(const float *restrict x, float *restrict out, int64_t rows, int64_t k,
                        TileScratch s, Format f) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t kk = 0; kk < k; kk++)
            out[r * k + kk] =
                round_clamped(x[r * k + kk] * s.inverse[kk] * f.up, f.limit) * f.down * s.power[kk];
}

/* BFP(man_bits, exp_bits, block) quantize along the middle axis of x [outer, n, inner] (blocks
 * of `block` along n, the last one of each column partial when n is not a multiple), into out
 * in the same layout: a block axis that is not the last one needs no transposed copy. Returns 0,
 * or -1 when scratch memory could not be allocated (nothing is written then). */
int dsq_bfp_quantize_columns(const float *x, float *out, int64_t outer, int64_t n, int64_t inner,
                             int64_t block, int man_bits, int exp_bits) {
    const Format f = format_of(man_bits, exp_bits);
    const int64_t n_blocks = (n + block - 1) / block, tiles = outer * n_blocks;
    const size_t per_thread = tile_scratch_bytes(block, inner);
    char *memory = (char *)malloc(per_thread * (size_t)threads());
    if (!memory) return -1;
#pragma omp parallel for schedule(static) num_threads(team) if (outer * n * inner >= PARALLEL_MIN)
    for (int64_t t = 0; t < tiles; t++) {
        TileScratch s = tile_scratch(memory + per_thread * (size_t)thread_index(), inner);
        const int64_t o = t / n_blocks, nb = t % n_blocks;
        const int64_t rows = n - nb * block < block ? n - nb * block : block;
        const int64_t at = (o * n + nb * block) * inner;
        column_scales(x + at, rows, inner, inner, s, NULL, 0, f, exp_bits);
        tile_values(x + at, out + at, rows, inner, s, f);
    }
    free(memory);
    return 0;
}

/* The sign-magnitude code of v in column kk (0 for a column holding NaN or inf). */
static inline uint32_t column_code(float v, int64_t kk, TileScratch s, Format f, int man_bits) {
    float q = round_clamped(v * s.inverse[kk] * f.up, f.limit);
    q = s.keep[kk] ? q : 0.0f; /* no NaN reaches the conversion to an integer */
    uint32_t code = ((bits_of(v) >> 31) << (man_bits - 1)) | (uint32_t)(int32_t)__builtin_fabsf(q);
    return code & s.keep[kk];
}

/* The stash codes of one tile x [rows, k] (rows = one block of the pack format): one byte per
 * code at codes[kk * code_stride + r] for column kk, row r; computed along k (vectorised), then
 * transposed into the stream's order. */
static void tile_codes(const float *x, int64_t rows, int64_t k, int64_t row_stride,
                       TileScratch s, uint8_t *codes, int64_t code_stride, Format f,
                       int man_bits) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t kk = 0; kk < k; kk++)
            s.by_row[r * k + kk] = (uint8_t)column_code(x[r * row_stride + kk], kk, s, f, man_bits);
    for (int64_t kk = 0; kk < k; kk++)
        for (int64_t r = 0; r < rows; r++) codes[kk * code_stride + r] = s.by_row[r * k + kk];
}

static inline int group_codes(int width);

/* Rows of a tile whose codes one 64-bit word holds in whole bytes: the most (up to 64 / width)
 * that divide `rows` and fill whole bytes. */
static int64_t rows_per_word(int64_t rows, int width) {
    for (int64_t r = rows < 64 / width ? rows : 64 / width; r > 1; r--)
        if (rows % r == 0 && r % group_codes(width) == 0) return r;
    return group_codes(width);
}

/* The low `count` bytes of `word` to out, least significant first. */
static inline void store_bytes(uint8_t *out, uint64_t word, int count) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (count == 8) { /* one store (a variable-length byte loop dominated the tile) */
        memcpy(out, &word, 8);
        return;
    }
    if (count == 4) {
        uint32_t half = (uint32_t)word;
        memcpy(out, &half, 4);
        return;
    }
#endif
    for (int j = 0; j < count; j++) out[j] = (uint8_t)(word >> (8 * j));
}

/* The stash stream of one tile x [rows, k] whose columns each start on a byte of the stream:
 * column kk's rows * width bits go to stream[kk * column_bytes ...]. The codes of a group of
 * rows are packed into one 64-bit word per column along k (vectorised), then stored bytewise:
 * no byte transpose, no separate packing pass. */
static void tile_stream(const float *x, int64_t rows, int64_t k, int64_t row_stride,
                        TileScratch s, uint8_t *stream, int64_t column_bytes, Format f,
                        int man_bits) {
    const int64_t per_word = rows_per_word(rows, man_bits);
    const int word_bytes = (int)(per_word * man_bits / 8);
    for (int64_t g = 0; g < rows / per_word; g++) {
        memset(s.words, 0, (size_t)k * sizeof *s.words);
        for (int64_t c = 0; c < per_word; c++) {
            const float *row = x + (g * per_word + c) * row_stride;
            for (int64_t kk = 0; kk < k; kk++)
                s.words[kk] |= (uint64_t)column_code(row[kk], kk, s, f, man_bits) << (man_bits * c);
        }
        for (int64_t kk = 0; kk < k; kk++)
            store_bytes(stream + kk * column_bytes + g * word_bytes, s.words[kk], word_bytes);
    }
}

/* Bytes of each column's stash stream that one task of dsq_bfp_quantize_and_pack gathers before
 * storing them: a cache line. Stored straight from each tile, a column's codes were a few bytes
 * 2 KiB or so apart from the next column's, into lines that the next tile wrote again; those
 * scattered stores were most of the kernel's time. */
#define STREAM_RUN_BYTES 64

/* The engine's q0 and q1 of one activation, reading it once: x [L, N, K], its rows `stride_n`
 * floats apart and its matrices `stride_l` apart (K contiguous: an attention operand seen
 * through a transpose needs no copy), tiles of p_block rows, the last one of each matrix partial
 * when N is not a multiple of p_block (its rows alone are read, as if padded with zeros):
 *   values = BFP(q_man, q_exp, q_block) quantize along K (K a multiple of q_block), [L, N, K];
 *   the stash: BFP(p_man <= 8, p_exp, p_block) along N, in the stream's order (rows (l, k) of N
 *   codes), written to `out` as
 *     - stream = 0: one byte per mantissa code, [L, K, N] (the caller packs them);
 *     - stream = 1: the mantissa stream itself; needs p_block * p_man and N * p_man multiples
 *       of 8 (each tile's column starts on a byte, and so does each row of the stream). A task
 *       then takes a run of consecutive tiles whose codes fill STREAM_RUN_BYTES of each column,
 *       gathers them in a per-thread buffer [K, run bytes] and stores each column's run at once;
 *   and its exponent codes to exps [L, K, ceil(N / p_block)], one byte each.
 * Returns 0, or -1 when scratch memory could not be allocated (nothing is written then). */
int dsq_bfp_quantize_and_pack(const float *x, int64_t stride_l, int64_t stride_n, float *values,
                              uint8_t *out, uint8_t *exps, int64_t L, int64_t N, int64_t p_block,
                              int64_t K, int q_man, int q_exp, int64_t q_block, int p_man,
                              int p_exp, int stream) {
    const int64_t n_blocks = (N + p_block - 1) / p_block;
    if (L <= 0 || n_blocks <= 0) return 0; /* nothing to write */
    const Format q = format_of(q_man, q_exp), p = format_of(p_man, p_exp);
    /* tiles per task, and the bytes of one whole tile's codes in a column (stream = 1) */
    const int64_t tile_bytes = stream ? p_block * p_man / 8 : 0;
    int64_t run = stream ? (STREAM_RUN_BYTES + tile_bytes - 1) / tile_bytes : 1;
    run = run < n_blocks ? run : n_blocks;
    /* a task for every thread first (the values are most of the work), shorter runs second */
    while (run > 1 && L * ((n_blocks + run - 1) / run) < threads()) run = (run + 1) / 2;
    const int64_t runs = (n_blocks + run - 1) / run, tasks = L * runs;
    const size_t scratch = tile_scratch_bytes(p_block, K);
    const size_t per_thread = scratch + (size_t)(K * run * tile_bytes + 63) / 64 * 64;
    char *memory = (char *)malloc(per_thread * (size_t)threads());
    if (!memory) return -1;
#pragma omp parallel for schedule(static) num_threads(team) if (L * N * K >= PARALLEL_MIN)
    for (int64_t t = 0; t < tasks; t++) {
        char *mine = memory + per_thread * (size_t)thread_index();
        TileScratch s = tile_scratch(mine, K);
        uint8_t *gathered = (uint8_t *)mine + scratch; /* [K, run * tile_bytes] */
        const int64_t l = t / runs, first = t % runs * run;
        const int64_t count = n_blocks - first < run ? n_blocks - first : run;
        for (int64_t nb = first; nb < first + count; nb++) {
            const int64_t rows = N - nb * p_block < p_block ? N - nb * p_block : p_block;
            const int64_t row = l * N + nb * p_block;
            const float *tile = x + l * stride_l + nb * p_block * stride_n;
            /* the values first: the tile is then in cache for the stash */
            for (int64_t r = 0; r < rows; r++)
                quantize_blocks_serial(tile + r * stride_n, values + (row + r) * K, K / q_block,
                                       q_block, q);
            column_scales(tile, rows, K, stride_n, s, exps + (l * K * n_blocks + nb), n_blocks,
                          p, p_exp);
            if (stream)
                tile_stream(tile, rows, K, stride_n, s, gathered + (nb - first) * tile_bytes,
                            run * tile_bytes, p, p_man);
            else
                tile_codes(tile, rows, K, stride_n, s, out + (l * K * N + nb * p_block), N, p,
                           p_man);
        }
        if (stream) { /* this run's rows of each column: the last run's last tile may be partial */
            const int64_t end = (first + count) * p_block < N ? (first + count) * p_block : N;
            const size_t run_bytes = (size_t)((end - first * p_block) * p_man / 8);
            for (int64_t kk = 0; kk < K; kk++)
                memcpy(out + (l * K + kk) * N * p_man / 8 + first * tile_bytes,
                       gathered + kk * run * tile_bytes, run_bytes);
        }
    }
    free(memory);
    return 0;
}

/* ---------------------------------------------------------------------------- bit streams
 * A group is the fewest codes that fill whole bytes: 8 / gcd(width, 8) codes, width / gcd bytes
 * (at most 8 codes in 7 bytes), held as one little-endian 64-bit word. The loops over groups
 * are instantiated per width (WIDTHS), so that shifts are constants the compiler unrolls. */
static inline int group_codes(int width) {
    int low = width & -width; /* gcd(width, 8) for width <= 8 */
    return 8 / low;
}

static inline void pack_groups(const uint8_t *codes, int64_t groups, const int width,
                               uint8_t *stream) {
    const int per = group_codes(width), bytes = per * width / 8;
    const uint64_t mask = (1u << width) - 1;
    for (int64_t g = 0; g < groups; g++) {
        uint64_t word = 0;
        for (int c = 0; c < per; c++) word |= ((uint64_t)codes[g * per + c] & mask) << (width * c);
        for (int j = 0; j < bytes; j++) stream[g * bytes + j] = (uint8_t)(word >> (8 * j));
    }
}

static inline void unpack_groups(const uint8_t *stream, int64_t groups, const int width,
                                 uint8_t *codes) {
    const int per = group_codes(width), bytes = per * width / 8;
    const uint64_t mask = (1u << width) - 1;
    for (int64_t g = 0; g < groups; g++) {
        uint64_t word = 0;
        for (int j = 0; j < bytes; j++) word |= (uint64_t)stream[g * bytes + j] << (8 * j);
        for (int c = 0; c < per; c++) codes[g * per + c] = (uint8_t)((word >> (width * c)) & mask);
    }
}

#define WIDTHS(CALL) \
    switch (width) { \
        case 1: CALL(1); break; \
        case 2: CALL(2); break; \
        case 3: CALL(3); break; \
        case 4: CALL(4); break; \
        case 5: CALL(5); break; \
        case 6: CALL(6); break; \
        case 7: CALL(7); break; \
        default: CALL(8); break; \
    }

/* The stream of `count` codes of `width` bits (1 <= width <= 8), one code per byte in `codes`:
 * ceil(count * width / 8) bytes, the last one zero-padded. */
void dsq_pack_codes(const uint8_t *codes, int64_t count, int width, uint8_t *stream) {
    const int per = group_codes(width);
    const int64_t whole = count / per;
#define PACK(W) pack_groups(codes, whole, W, stream)
    WIDTHS(PACK)
#undef PACK
    int64_t rest = count - whole * per;
    if (rest) { /* a partial group: its bytes up to the last code's, zero-padded */
        uint64_t word = 0;
        for (int64_t c = 0; c < rest; c++)
            word |= ((uint64_t)codes[whole * per + c] & ((1u << width) - 1)) << (width * c);
        uint8_t *tail = stream + whole * per * width / 8;
        for (int64_t j = 0; j < (rest * width + 7) / 8; j++) tail[j] = (uint8_t)(word >> (8 * j));
    }
}

/* Code i of a stream of `width` <= 8 bits, `size` bytes long. */
static inline uint8_t code_at(const uint8_t *stream, int64_t size, int64_t i, int width) {
    int64_t bit = i * width, byte = bit >> 3;
    uint32_t pair = stream[byte];
    if (byte + 1 < size) pair |= (uint32_t)stream[byte + 1] << 8;
    return (uint8_t)((pair >> (bit & 7)) & ((1u << width) - 1));
}

/* Codes [first, first + count) of a `width`-bit stream of `size` bytes, one byte each. */
static void unpack_run(const uint8_t *stream, int64_t size, int64_t first, int64_t count,
                       int width, uint8_t *codes) {
    const int per = group_codes(width);
    int64_t i = 0;
    for (; i < count && (first + i) % per; i++) codes[i] = code_at(stream, size, first + i, width);
    const int64_t groups = (count - i) / per;
    const uint8_t *aligned = stream + (first + i) / per * (per * width / 8);
#define UNPACK(W) unpack_groups(aligned, groups, W, codes + i)
    WIDTHS(UNPACK)
#undef UNPACK
    for (i += groups * per; i < count; i++) codes[i] = code_at(stream, size, first + i, width);
}

/* The values of blocks of codes: out[j] for j < count, codes sign-magnitude of man_bits, the
 * block's exponent code ecode. */
static inline void decode_run(const uint8_t *restrict codes, float *restrict out, int64_t count,
                              uint32_t ecode, int man_bits, int exp_bits) {
    const int emax = (1 << (exp_bits - 1)) - 1;
    if (ecode == (1u << exp_bits) - 1) { /* the block held NaN or an infinity */
        for (int64_t j = 0; j < count; j++) out[j] = __builtin_nanf("");
        return;
    }
    const uint32_t magnitude_mask = (1u << (man_bits - 1)) - 1;
    const float scale = pow2(2 - man_bits), p = pow2((int)ecode - emax);
    for (int64_t j = 0; j < count; j++) {
        float magnitude = (float)(codes[j] & magnitude_mask) * scale * p;
        uint32_t sign = (uint32_t)(codes[j] >> (man_bits - 1)) << 31;
        out[j] = float_of(bits_of(magnitude) | sign);
    }
}

/* BFP(man_bits <= 8, exp_bits, block) unpack into out [rows, n] (the block axis last): codes
 * from the mantissa stream (m_size bytes) and the exponent stream (e_size bytes). Returns 0, or
 * -1 when scratch memory could not be allocated (nothing is written then). */
int dsq_bfp_decode(const uint8_t *mantissas, int64_t m_size, const uint8_t *exponents,
                   int64_t e_size, float *out, int64_t rows, int64_t n, int64_t block,
                   int man_bits, int exp_bits) {
    const int64_t n_blocks = (n + block - 1) / block;
    const size_t per_thread = (size_t)(n + n_blocks + 63) / 64 * 64;
    uint8_t *memory = (uint8_t *)malloc(per_thread * (size_t)threads());
    if (!memory) return -1;
#pragma omp parallel for schedule(static) num_threads(team) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *codes = memory + per_thread * (size_t)thread_index(), *exps = codes + n;
        unpack_run(mantissas, m_size, r * n, n, man_bits, codes);
        unpack_run(exponents, e_size, r * n_blocks, n_blocks, exp_bits, exps);
        float *o = out + r * n;
        int64_t nb = 0;
        if (block == 16)
            for (; (nb + 1) * 16 <= n; nb++)
                decode_run(codes + nb * 16, o + nb * 16, 16, exps[nb], man_bits, exp_bits);
        for (; nb < n_blocks; nb++) {
            int64_t start = nb * block, stop = start + block < n ? start + block : n;
            decode_run(codes + start, o + start, stop - start, exps[nb], man_bits, exp_bits);
        }
    }
    free(memory);
    return 0;
}
