/* y = x W^T for a Q8_0 weight (llama.cpp's usual lm_head; an EAGLE head's projections), for
 * the few rows of a CPU decode step, against the input quantized to int8 as q4_matmul.c does
 * it; and the weight dequantized a piece at a time for the wide forwards. */
#include <stdint.h>
#include <stdlib.h>

#include "q4_matmul.h"

#define GROUP 32
#define ROW_TILE 4

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

/* Output rows [o0, o0 + count) of a Q8_0 weight as fp32 (w = q s), dst [count, k]. */
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
