/* Vector math of the C step ops (step_ops.h, attention_ops.h) and the sampler's cuts
 * (sample_cut.c): e^x of 8 floats and the shifted exponentials of a softmax. */
#ifndef FMSERVE_VECTOR_MATH_H
#define FMSERVE_VECTOR_MATH_H
#include <math.h>
#include <string.h>

#include "q4_matmul.h"

#ifdef __AVX2__
/* e^x of 8 floats: Cephes' expf polynomial (within 2 ulp of expf), x clamped to [-87.3, 88.3]
 * so that 2^n stays a normal float. Softmax and SiLU called expf ~3 million times a step at
 * 32 rows, about 5 ms on 2 cores. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_floor_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln 2 in two parts */
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    __m256i scale = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(scale));
}
#endif

/* The largest of p[0..len), NaNs skipped (-inf if none), as `x > best ? x : best` in turn gives
 * it: vmaxps returns its second operand where the first is NaN. In eight lanes: the one-lane
 * loop was a chain of dependent maxima, ~7% of the attention's time at head_dim 64. */
static inline float max_of(const float *p, int len) {
    float best = -INFINITY;
    int j = 0;
#ifdef __AVX2__
    __m256 acc = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= len; j += 8)
        acc = _mm256_max_ps(_mm256_loadu_ps(p + j), acc);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    best = _mm_cvtss_f32(h);
#endif
    for (; j < len; j++)
        best = p[j] > best ? p[j] : best;
    return best;
}

/* p[j] = e^(p[j] - best) for j < len; returns their sum. */
static float exp_shifted(float *p, int len, float best) {
    float total = 0.f;
    int j = 0;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps(), shift = _mm256_set1_ps(best);
    for (; j + 8 <= len; j += 8) {
        __m256 v = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), shift));
        _mm256_storeu_ps(p + j, v);
        acc = _mm256_add_ps(acc, v);
    }
    total = hsum(acc);
    if (j < len) { /* the tail through the same polynomial */
        float tail[8] = {0};
        memcpy(tail, p + j, sizeof(float) * (len - j));
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), shift)));
        for (int i = 0; i < len - j; i++)
            total += p[j + i] = tail[i];
    }
    return total;
#endif
    for (; j < len; j++)
        total += p[j] = expf(p[j] - best);
    return total;
}

#endif
