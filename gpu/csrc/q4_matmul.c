/* y = x W^T for an int4 weight (w = q s + m per block of 32 inputs: GGUF's Q4_0 and Q4_1, and
 * the K-quants' groups), for the few rows of a CPU decode step.
 *
 * x [rows, k] fp32 is quantized per block of 32 to int8 with its own scale d (as llama.cpp's
 * Q8_1), so a block's dot product is integer work:
 *     sum_j w_j x_j ~= s d sum_j q_j x8_j + m d sum_j x8_j
 * The codes are interleaved 16 output rows together (gpu/cpu_q4_kernel.py Q4Rows): for each
 * group of 16 rows and block of 32 inputs, 8 steps of 32 bytes, a step holding inputs 4j..4j+3
 * of the 16 rows (rows 0-7 in the low nibbles, 8-15 in the high ones, 4 bytes a row). One
 * multiply-add of a step against an input's 4 bytes broadcast then sums for all 16 rows at
 * once, and the float work (scales, minimums) is done once per block for 16 outputs, not once
 * per block and output: with the codes row by row that float work bound a decode step at 4
 * and more rows. AVX-512 VNNI does a step in one vpdpbusd; AVX2 in maddubs + madd per 8 rows.
 *
 * Each input row gets the same operations whatever rows come with it, so a row's result does
 * not depend on the rows beside it. Groups of outputs are shared among OpenMP threads, as many
 * as torch uses (its own pool: this library needs the libgomp.so.1 that torch has already
 * loaded). Built at first use by gpu/cpu_q4_kernel.py. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "q4_matmul.h"

#define GROUP 32
#define STEP_BYTES 32                 /* 16 rows x 4 inputs, two nibbles a byte */
#define BLOCK_BYTES (8 * STEP_BYTES) /* 16 rows x 32 inputs */

int q4_kernel_isa(void) {
#if defined(FMSERVE_VNNI)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* One block of 32 inputs to int8 with its scale; returns the sum of the codes. lrintf's and
 * cvtps2dq's rounding are the same (to nearest, ties to even), so both loops give the same
 * bytes. */
static inline int quantize_block(const float *xb, int8_t *qb, float *scale_out) {
#ifdef __AVX2__
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float top = _mm_cvtss_f32(h), inv = top > 0.f ? 127.f / top : 0.f;
    __m256 mul = _mm256_set1_ps(inv);
    __m256i q[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], mul));
        sum = _mm256_add_epi32(sum, q[i]);
    }
    /* 32 int32 in [-127, 127] to bytes; the packs interleave 128-bit lanes, the permute
     * puts the input order back */
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)qb, b);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    *scale_out = top / 127.f;
    return _mm_cvtsi128_si32(s4);
#else
    float amax = 0.f;
    for (int j = 0; j < GROUP; j++) {
        float a = fabsf(xb[j]);
        amax = a > amax ? a : amax;
    }
    float inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < GROUP; j++) {
        int q = (int)lrintf(xb[j] * inv);
        qb[j] = (int8_t)q;
        sum += q;
    }
    *scale_out = amax / 127.f;
    return sum;
#endif
}

float *quantize_input(const float *x, int rows, int k, int8_t **x8_out, int32_t **sums_out,
                      int threads) {
    int nb = k / GROUP;
    float *d = malloc((sizeof(float) * 2 + sizeof(int32_t)) * (size_t)rows * nb + (size_t)rows * k);
    if (!d)
        return NULL;
    float *dsum = d + (size_t)rows * nb;
    int32_t *sums = (int32_t *)(dsum + (size_t)rows * nb);
    int8_t *x8 = *x8_out = (int8_t *)(sums + (size_t)rows * nb);
    if (sums_out)
        *sums_out = sums;
    /* shared among the threads only where there is enough of it to pay for waking them */
#pragma omp parallel for schedule(static) num_threads(threads) if ((size_t)rows * k >= 16384)
    for (int r = 0; r < rows; r++) {
        for (int b = 0; b < nb; b++) {
            size_t at = (size_t)r * nb + b;
            float scale;
            int sum = quantize_block(x + (size_t)r * k + b * GROUP, x8 + (size_t)r * k + b * GROUP,
                                     &scale);
            d[at] = scale;
            dsum[at] = scale * (float)sum;
            sums[at] = sum;
        }
    }
    return d;
}

/* For q8_matmul.c's VNNI tiles, whose rows are then read from one base register with constant
 * offsets (R row pointers had spilled to vector registers, each brought back by a vmovq
 * competing with the dot products; the 4-bit tiles, busier unpacking nibbles, gained nothing):
 * each tile of `tile` rows (R in the last) re-laid in its own place, the R k bytes from r0 k.
 * interleave_x8: x8 [rows][k] to [block][step][row][4 bytes] per tile. */
int interleave_x8(int8_t *x8, int rows, int k, int tile) {
    int8_t *t = malloc((size_t)rows * k);
    if (!t)
        return -1;
    for (int r0 = 0; r0 < rows; r0 += tile) {
        int R = rows - r0 < tile ? rows - r0 : tile;
        for (int i = 0; i < R; i++)
            for (int step = 0; step < k / 4; step++) /* step = block * 8 + j */
                memcpy(t + (size_t)r0 * k + ((size_t)step * R + i) * 4,
                       x8 + (size_t)(r0 + i) * k + 4 * step, 4);
    }
    memcpy(x8, t, (size_t)rows * k);
    free(t);
    return 0;
}

/* The same for 4-byte values [rows][n] (a block's scale, sum, ...): [n][row] per tile. */
int interleave_words(void *words, int rows, int n, int tile) {
    uint32_t *w = words, *t = malloc(sizeof(uint32_t) * (size_t)rows * n);
    if (!t)
        return -1;
    for (int r0 = 0; r0 < rows; r0 += tile) {
        int R = rows - r0 < tile ? rows - r0 : tile;
        for (int i = 0; i < R; i++)
            for (int c = 0; c < n; c++)
                t[(size_t)r0 * n + (size_t)c * R + i] = w[(size_t)(r0 + i) * n + c];
    }
    memcpy(w, t, sizeof(uint32_t) * (size_t)rows * n);
    free(t);
    return 0;
}

static inline int32_t four_bytes(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The operands of one group's tile: R input rows from x8 (row i at x8 + i k, its block scales
 * at d + i nb and d sum x8 at dsum + i nb) against the group's codes qs, scales s and
 * minimums m ([nb][16] each, fp16 where `fp16`, else fp32); out[i][16] gets row i's 16 sums. */
typedef struct {
    const uint8_t *qs;
    const void *s, *m;
    const int8_t *x8;
    const float *d, *dsum;
    int nb, k, fp16;
    const uint8_t *ahead; /* codes AHEAD_BYTES on, fetched a line every other step (or NULL) */
} tile_args;

/* The first tile of a group asks for the codes this far ahead, a line every other step, into
 * L1: without it the stream waited on memory between bursts of integer work (both added up),
 * with it they overlap. SmolLM2-135M's 150 4-bit projections from memory, 1-4 rows 1.17-1.27x,
 * 8 rows 1.1-1.15x, 32 rows 1.02-1.04x (2-core AVX512-BF16 EPYC; 2 KB ahead 1.17-1.22x). */
#define AHEAD_BYTES 4096

#if defined(FMSERVE_VNNI)
#define TILE 8
static inline __attribute__((always_inline)) void group_tile(int R, const tile_args *a,
                                                             float out[][16]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m512 acc[TILE];
    for (int i = 0; i < R; i++)
        acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < a->nb; b++) {
        const uint8_t *qb = a->qs + (size_t)b * BLOCK_BYTES;
        __m512i sums[TILE];
        for (int i = 0; i < R; i++)
            sums[i] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            if (a->ahead && (j & 1) == 0)
                _mm_prefetch((const char *)a->ahead + (size_t)b * BLOCK_BYTES + j * STEP_BYTES,
                             _MM_HINT_T0);
            __m256i t = _mm256_loadu_si256((const __m256i *)(qb + j * STEP_BYTES));
            __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(t, low)),
                                           _mm256_and_si256(_mm256_srli_epi16(t, 4), low), 1);
            for (int i = 0; i < R; i++) {
                const int8_t *x = a->x8 + (size_t)i * a->k + b * GROUP + 4 * j;
                sums[i] = dpbusd_x4(sums[i], q, x);
            }
        }
        __m512 s = a->fp16 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                 (const __m256i *)((const uint16_t *)a->s + b * 16)))
                           : _mm512_loadu_ps((const float *)a->s + b * 16);
        __m512 m = a->fp16 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                 (const __m256i *)((const uint16_t *)a->m + b * 16)))
                           : _mm512_loadu_ps((const float *)a->m + b * 16);
        for (int i = 0; i < R; i++) {
            size_t at = (size_t)i * a->nb + b;
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i]),
                                     _mm512_mul_ps(s, _mm512_set1_ps(a->d[at])), acc[i]);
            acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->dsum[at]), acc[i]);
        }
    }
    for (int i = 0; i < R; i++)
        _mm512_storeu_ps(out[i], acc[i]);
}
#elif defined(__AVX2__)
#define TILE 2
/* Eight scales or minimums from i on, fp16 or fp32. */
static inline __m256 load8(const void *p, int fp16, size_t i) {
    if (!fp16)
        return _mm256_loadu_ps((const float *)p + i);
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
#else
    float v[8];
    for (int l = 0; l < 8; l++)
        v[l] = param_at(p, 1, i + l);
    return _mm256_loadu_ps(v);
#endif
}

/* Rows 0-7 of the group in the low nibbles (h = 0), rows 8-15 in the high ones (h = 1). A
 * block's 8 steps add maddubs' int16 pairs as they are and widen them once: a pair is at most
 * 2 x 15 x 127 = 3,810 in size, eight of them 30,480, inside int16, so the sums are exact. */
static inline __attribute__((always_inline)) void group_tile(int R, const tile_args *a,
                                                             float out[][16]) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[TILE][2];
    for (int i = 0; i < R; i++)
        acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int b = 0; b < a->nb; b++) {
        const uint8_t *qb = a->qs + (size_t)b * BLOCK_BYTES;
        __m256i sums[TILE][2];
        for (int i = 0; i < R; i++)
            sums[i][0] = sums[i][1] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            if (a->ahead && (j & 1) == 0)
                _mm_prefetch((const char *)a->ahead + (size_t)b * BLOCK_BYTES + j * STEP_BYTES,
                             _MM_HINT_T0);
            __m256i t = _mm256_loadu_si256((const __m256i *)(qb + j * STEP_BYTES));
            __m256i q[2] = {_mm256_and_si256(t, low),
                            _mm256_and_si256(_mm256_srli_epi16(t, 4), low)};
            for (int i = 0; i < R; i++) {
                const int8_t *x = a->x8 + (size_t)i * a->k + b * GROUP + 4 * j;
                __m256i xv = _mm256_set1_epi32(four_bytes(x));
                for (int h = 0; h < 2; h++)
                    sums[i][h] = _mm256_add_epi16(sums[i][h], _mm256_maddubs_epi16(q[h], xv));
            }
        }
        for (int i = 0; i < R; i++)
            for (int h = 0; h < 2; h++)
                sums[i][h] = _mm256_madd_epi16(sums[i][h], ones);
        for (int h = 0; h < 2; h++) {
            __m256 s = load8(a->s, a->fp16, (size_t)b * 16 + 8 * h);
            __m256 m = load8(a->m, a->fp16, (size_t)b * 16 + 8 * h);
            for (int i = 0; i < R; i++) {
                size_t at = (size_t)i * a->nb + b;
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i][h]),
                                            _mm256_mul_ps(s, _mm256_set1_ps(a->d[at])),
                                            acc[i][h]);
                acc[i][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->dsum[at]), acc[i][h]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(out[i] + 8 * h, acc[i][h]);
}
#else
#define TILE 1
static void group_tile(int R, const tile_args *a, float out[][16]) {
    for (int i = 0; i < R; i++)
        for (int l = 0; l < 16; l++) {
            float total = 0.f;
            for (int b = 0; b < a->nb; b++) {
                const uint8_t *qb = a->qs + (size_t)b * BLOCK_BYTES;
                const int8_t *x = a->x8 + (size_t)i * a->k + b * GROUP;
                int sum = 0;
                for (int j = 0; j < 8; j++)
                    for (int u = 0; u < 4; u++) {
                        uint8_t byte = qb[j * STEP_BYTES + 4 * (l % 8) + u];
                        sum += (l < 8 ? byte & 0x0F : byte >> 4) * x[4 * j + u];
                    }
                size_t at = (size_t)i * a->nb + b;
                total = fmaf((float)sum, param_at(a->s, a->fp16, b * 16 + l) * a->d[at], total);
                total = fmaf(param_at(a->m, a->fp16, b * 16 + l), a->dsum[at], total);
            }
            out[i][l] = total;
        }
}
#endif

/* y [rows, n] = x [rows, k] W^T on `threads` threads; k a multiple of 32, n of 16. Returns 0,
 * or -1 if out of memory. */
int q4_matmul(const float *x, int rows, int k, const uint8_t *qs, const void *s, const void *m,
              int fp16, int n, float *y, int threads) {
    int nb = k / GROUP;
    int8_t *x8;
    float *d = quantize_input(x, rows, k, &x8, NULL, threads);
    if (!d)
        return -1;
    float *dsum = d + (size_t)rows * nb;
#pragma omp parallel for schedule(guided) num_threads(threads) /* as q8_matmul.c */
    for (int g = 0; g < n / 16; g++) {
        float out[TILE][16];
        size_t at = (size_t)g * nb * 16, size = fp16 ? 2 : 4; /* the group's params */
        tile_args a = {qs + (size_t)g * nb * BLOCK_BYTES, (const char *)s + at * size,
                       (const char *)m + at * size, x8, d, dsum, nb, k, fp16, NULL};
        for (int r = 0; r < rows;) {
            int take = rows - r < TILE ? rows - r : TILE;
            a.x8 = x8 + (size_t)r * k;
            a.ahead = r == 0 ? a.qs + AHEAD_BYTES : NULL; /* past the end: a hint, no fault */
            a.d = d + (size_t)r * nb;
            a.dsum = dsum + (size_t)r * nb;
            switch (take) { /* each a constant: the accumulators stay in registers */
            case 1: group_tile(1, &a, out); break;
#if TILE >= 2
            case 2: group_tile(2, &a, out); break;
#endif
#if TILE >= 8 /* any few rows in one tile: the codes unpacked once, not once a tile */
            case 3: group_tile(3, &a, out); break;
            case 4: group_tile(4, &a, out); break;
            case 5: group_tile(5, &a, out); break;
            case 6: group_tile(6, &a, out); break;
            case 7: group_tile(7, &a, out); break;
            case 8: group_tile(8, &a, out); break;
#endif
            }
            for (int i = 0; i < take; i++)
                memcpy(y + (size_t)(r + i) * n + (size_t)g * 16, out[i], sizeof out[i]);
            r += take;
        }
    }
    free(d);
    return 0;
}

/* Output rows [o0, o0 + count) of a 4-bit weight as fp32, dst [count, k]: the wide forwards
 * (prefill) multiply that with a dense GEMM instead of keeping a dense copy resident. */
void q4_dequantize(const uint8_t *qs, const void *s, const void *m, int fp16, int k, int o0,
                   int count, float *dst, int threads) {
    int nb = k / GROUP;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int o = 0; o < count; o++) {
        int row = o0 + o, g = row / 16, l = row % 16, shift = l < 8 ? 0 : 4;
        const uint8_t *qg = qs + (size_t)g * nb * BLOCK_BYTES + 4 * (l % 8);
        size_t at = (size_t)g * nb * 16 + l; /* the row's params: every 16th from here */
        float *w = dst + (size_t)o * k;
        for (int b = 0; b < nb; b++) {
            const uint8_t *qb = qg + (size_t)b * BLOCK_BYTES;
            float sb = param_at(s, fp16, at + b * 16), mb = param_at(m, fp16, at + b * 16);
#ifdef __AVX2__
            /* the row's 4 bytes of each of the 8 steps: its 32 codes in input order */
            __m256i steps = _mm256_i32gather_epi32(
                (const int *)qb, _mm256_setr_epi32(0, 32, 64, 96, 128, 160, 192, 224), 1);
            __m256i q = _mm256_and_si256(_mm256_srl_epi16(steps, _mm_cvtsi32_si128(shift)),
                                         _mm256_set1_epi8(0x0F));
            __m256 sv = _mm256_set1_ps(sb), mv = _mm256_set1_ps(mb);
            __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
            for (int p = 0; p < 4; p++)
                _mm256_storeu_ps(w + b * GROUP + 8 * p, _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                        p % 2 ? _mm_srli_si128(halves[p / 2], 8) : halves[p / 2])), sv, mv));
            continue;
#endif
            for (int j = 0; j < GROUP; j++)
                w[b * GROUP + j] = fmaf((float)((qb[(j / 4) * STEP_BYTES + j % 4] >> shift) & 0x0F),
                                        sb, mb);
        }
    }
}
