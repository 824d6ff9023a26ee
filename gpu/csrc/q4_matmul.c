/* y = x W^T for an int4 weight in the GGUF Q4_1 form (and, at the end, a Q8_0 one), for the
 * few rows of a CPU decode step.
 *
 * W [n, k]: per output row, blocks of 32 inputs, each 16 bytes of nibbles (byte j holds input j
 * in its low half and input j + 16 in its high half), a scale s and a minimum m (fp32):
 * w = q s + m. x [rows, k] fp32 is quantized per block of 32 to int8 with its own scale d
 * (as llama.cpp's Q8_1), so a block's dot product is integer work:
 *     sum_j w_j x_j ~= s d sum_j q_j x8_j + m d sum_j x8_j
 * With AVX2 the integer sums take two instructions per block (maddubs, madd). Output rows
 * are shared among OpenMP threads, as many as torch uses (its own pool: this library needs the
 * libgomp.so.1 that torch has already loaded). Built at first use by gpu/cpu_q4_kernel.py. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "q4_matmul.h"

#define GROUP 32

/* x [rows, k] -> x8 [rows, k] int8, d [rows, k/32] (the scale) and dsum [rows, k/32] (d sum x8). */
static void quantize_rows(const float *x, int rows, int k, int8_t *x8, float *d, float *dsum) {
    int nb = k / GROUP;
    for (int r = 0; r < rows; r++) {
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)r * k + b * GROUP;
            int8_t *qb = x8 + (size_t)r * k + b * GROUP;
            float amax = 0.f;
            for (int j = 0; j < GROUP; j++) {
                float a = fabsf(xb[j]);
                amax = a > amax ? a : amax;
            }
            float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
            int sum = 0;
            for (int j = 0; j < GROUP; j++) {
                int q = (int)lrintf(xb[j] * inv);
                qb[j] = (int8_t)q;
                sum += q;
            }
            d[(size_t)r * nb + b] = scale;
            dsum[(size_t)r * nb + b] = scale * (float)sum;
        }
    }
}

static float row_dot(const uint8_t *qs, const float *s, const float *m, const int8_t *x8,
                     const float *d, const float *dsum, int nb) {
    float mins = 0.f;
#ifdef __AVX2__
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m128i t = _mm_loadu_si128((const __m128i *)(qs + b * 16));
        __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), low);
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x8 + b * GROUP));
        __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(s[b] * d[b]), _mm256_cvtepi32_ps(pairs), acc);
        mins += m[b] * dsum[b];
    }
    return hsum(acc) + mins;
#else
    float total = 0.f;
    for (int b = 0; b < nb; b++) {
        int sum = 0;
        for (int j = 0; j < 16; j++) {
            sum += (qs[b * 16 + j] & 0x0F) * x8[b * GROUP + j];
            sum += (qs[b * 16 + j] >> 4) * x8[b * GROUP + j + 16];
        }
        total += s[b] * d[b] * (float)sum;
        mins += m[b] * dsum[b];
    }
    return total + mins;
#endif
}

#ifdef __AVX2__
#define ROW_TILE 4

/* row_dot for ROW_TILE input rows at once (x8, d, dsum at the tile's first row; y[i * n] gets
 * row i): a block's codes are unpacked once for all of them. Each row's sums run in
 * row_dot's order, so a row's result does not depend on the rows beside it. */
static void tile_dot(const uint8_t *qs, const float *s, const float *m, const int8_t *x8,
                     const float *d, const float *dsum, int nb, int k, float *y, size_t n) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[ROW_TILE];
    float mins[ROW_TILE];
    for (int i = 0; i < ROW_TILE; i++) {
        acc[i] = _mm256_setzero_ps();
        mins[i] = 0.f;
    }
    for (int b = 0; b < nb; b++) {
        __m128i t = _mm_loadu_si128((const __m128i *)(qs + b * 16));
        __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), low);
        for (int i = 0; i < ROW_TILE; i++) {
            const int8_t *xr = x8 + (size_t)i * k + b * GROUP;
            __m256i xv = _mm256_loadu_si256((const __m256i *)xr);
            __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(s[b] * d[(size_t)i * nb + b]),
                                     _mm256_cvtepi32_ps(pairs), acc[i]);
            mins[i] += m[b] * dsum[(size_t)i * nb + b];
        }
    }
    for (int i = 0; i < ROW_TILE; i++)
        y[(size_t)i * n] = hsum(acc[i]) + mins[i];
}
#endif

/* y [rows, n] = x [rows, k] W^T on `threads` threads; k a multiple of 32. Returns 0, or -1
 * if out of memory. */
int q4_matmul(const float *x, int rows, int k, const uint8_t *qs, const float *s,
              const float *m, int n, float *y, int threads) {
    int nb = k / GROUP;
    int8_t *x8 = malloc((size_t)rows * k);
    float *d = malloc(sizeof(float) * (size_t)rows * nb * 2);
    if (!x8 || !d) {
        free(x8);
        free(d);
        return -1;
    }
    float *dsum = d + (size_t)rows * nb;
    quantize_rows(x, rows, k, x8, d, dsum);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int o = 0; o < n; o++) {
        const uint8_t *qo = qs + (size_t)o * nb * 16;
        const float *so = s + (size_t)o * nb, *mo = m + (size_t)o * nb;
        int r = 0;
#ifdef __AVX2__
        for (; r + ROW_TILE <= rows; r += ROW_TILE)
            tile_dot(qo, so, mo, x8 + (size_t)r * k, d + (size_t)r * nb, dsum + (size_t)r * nb,
                     nb, k, y + (size_t)r * n + o, n);
#endif
        for (; r < rows; r++)
            y[(size_t)r * n + o] = row_dot(qo, so, mo, x8 + (size_t)r * k, d + (size_t)r * nb,
                                           dsum + (size_t)r * nb, nb);
    }
    free(x8);
    free(d);
    return 0;
}

/* A Q8_0 weight (llama.cpp's usual lm_head): W [n, k] int8 codes q with one scale s per block
 * of 32 inputs (w = q s), against the same int8 input. maddubs wants one unsigned operand: |q|
 * times x8 carrying q's sign (as llama.cpp does); |q| <= 128 and |x8| <= 127 keep its pair
 * sums within int16. */
static float row_dot8(const int8_t *qs, const float *s, const int8_t *x8, const float *d,
                      int nb) {
#ifdef __AVX2__
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(qs + b * GROUP));
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x8 + b * GROUP));
        __m256i pairs = _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xv, q)), ones);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(s[b] * d[b]), _mm256_cvtepi32_ps(pairs), acc);
    }
    return hsum(acc);
#else
    float total = 0.f;
    for (int b = 0; b < nb; b++) {
        int sum = 0;
        for (int j = 0; j < GROUP; j++)
            sum += qs[b * GROUP + j] * x8[b * GROUP + j];
        total += s[b] * d[b] * (float)sum;
    }
    return total;
#endif
}

#ifdef __AVX2__
/* row_dot8 for ROW_TILE input rows at once: a block's |q| is taken once for all of them; each
 * row's sums in row_dot8's order (a row's result does not depend on the rows beside it). */
static void tile_dot8(const int8_t *qs, const float *s, const int8_t *x8, const float *d,
                      int nb, int k, float *y, size_t n) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[ROW_TILE];
    for (int i = 0; i < ROW_TILE; i++)
        acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(qs + b * GROUP));
        __m256i q_abs = _mm256_sign_epi8(q, q);
        for (int i = 0; i < ROW_TILE; i++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x8 + (size_t)i * k + b * GROUP));
            __m256i pairs = _mm256_madd_epi16(
                _mm256_maddubs_epi16(q_abs, _mm256_sign_epi8(xv, q)), ones);
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(s[b] * d[(size_t)i * nb + b]),
                                     _mm256_cvtepi32_ps(pairs), acc[i]);
        }
    }
    for (int i = 0; i < ROW_TILE; i++)
        y[(size_t)i * n] = hsum(acc[i]);
}
#endif

/* y [rows, n] = x [rows, k] W^T for a Q8_0 weight (codes qs [n, k], scales s [n, k/32]). */
int q8_matmul(const float *x, int rows, int k, const int8_t *qs, const float *s, int n,
              float *y, int threads) {
    int nb = k / GROUP;
    int8_t *x8 = malloc((size_t)rows * k);
    float *d = malloc(sizeof(float) * (size_t)rows * nb * 2);
    if (!x8 || !d) {
        free(x8);
        free(d);
        return -1;
    }
    quantize_rows(x, rows, k, x8, d, d + (size_t)rows * nb);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int o = 0; o < n; o++) {
        int r = 0;
#ifdef __AVX2__
        for (; r + ROW_TILE <= rows; r += ROW_TILE)
            tile_dot8(qs + (size_t)o * k, s + (size_t)o * nb, x8 + (size_t)r * k,
                      d + (size_t)r * nb, nb, k, y + (size_t)r * n + o, n);
#endif
        for (; r < rows; r++)
            y[(size_t)r * n + o] = row_dot8(qs + (size_t)o * k, s + (size_t)o * nb,
                                            x8 + (size_t)r * k, d + (size_t)r * nb, nb);
    }
    free(x8);
    free(d);
    return 0;
}

/* Output rows [o0, o0 + count) of a 4-bit weight as fp32, dst [count, k]: the wide forwards
 * (prefill) multiply that with a dense GEMM instead of keeping a dense copy resident. */
void q4_dequantize(const uint8_t *qs, const float *s, const float *m, int k, int o0, int count,
                   float *dst, int threads) {
    int nb = k / GROUP;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int o = 0; o < count; o++) {
        const uint8_t *qo = qs + (size_t)(o0 + o) * nb * 16;
        const float *so = s + (size_t)(o0 + o) * nb, *mo = m + (size_t)(o0 + o) * nb;
        float *row = dst + (size_t)o * k;
        for (int b = 0; b < nb; b++) {
            const uint8_t *q = qo + b * 16;
            float *w = row + b * GROUP;
#ifdef __AVX2__
            __m128i t = _mm_loadu_si128((const __m128i *)q);
            __m128i lo = _mm_and_si128(t, _mm_set1_epi8(0x0F));
            __m128i hi = _mm_and_si128(_mm_srli_epi16(t, 4), _mm_set1_epi8(0x0F));
            __m256 sv = _mm256_set1_ps(so[b]), mv = _mm256_set1_ps(mo[b]);
            __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int p = 0; p < 4; p++)
                _mm256_storeu_ps(w + 8 * p, _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p])), sv, mv));
            continue;
#endif
            for (int j = 0; j < 16; j++) {
                w[j] = fmaf((float)(q[j] & 0x0F), so[b], mo[b]);
                w[j + 16] = fmaf((float)(q[j] >> 4), so[b], mo[b]);
            }
        }
    }
}

/* The same for a Q8_0 weight (w = q s). */
void q8_dequantize(const int8_t *qs, const float *s, int k, int o0, int count, float *dst,
                   int threads) {
    int nb = k / GROUP;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int o = 0; o < count; o++) {
        const int8_t *qo = qs + (size_t)(o0 + o) * k;
        const float *so = s + (size_t)(o0 + o) * nb;
        float *row = dst + (size_t)o * k;
        for (int b = 0; b < nb; b++)
            for (int j = 0; j < GROUP; j++)
                row[b * GROUP + j] = (float)qo[b * GROUP + j] * so[b];
    }
}
