/* The 4-bit matmul of q4_matmul.c, shared with the decode step of decode_step.c, the 8-bit one
 * of q8_matmul.c, the input quantization both use, and a horizontal sum. */
#ifndef FMSERVE_Q4_MATMUL_H
#define FMSERVE_Q4_MATMUL_H
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>

/* The sum of a vector's eight floats. */
static inline float hsum(__m256 acc) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

/* AVX-512 VNNI where the compiler targets it (-march=native on such a CPU). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX2__)
#define FMSERVE_VNNI 1
#endif

/* Which loop this build's 4-bit kernel runs: 2 AVX-512 VNNI, 1 AVX2, 0 plain C. */
int q4_kernel_isa(void);
/* x [rows, k] quantized per block of 32 into one allocation the caller frees (the returned
 * pointer): d [rows, k/32] the scales, then dsum [rows, k/32] (d sum x8), then the sums of x8
 * [rows, k/32] int32 (*sums set, where not NULL), then x8 [rows, k] (*x8 set), on up to
 * `threads` threads. NULL if out of memory. */
float *quantize_input(const float *x, int rows, int k, int8_t **x8, int32_t **sums,
                      int threads);
int interleave_x8(int8_t *x8, int rows, int k, int tile);
int interleave_words(void *words, int rows, int n, int tile);
/* A 4-bit weight's scales s and minimums m are fp32, or fp16 where `half` (a Q4_0 / Q4_1
 * file's own values, which fp16 holds exactly). */
int q4_matmul(const float *x, int rows, int k, const uint8_t *qs, const void *s, const void *m,
              int half, int n, float *y, int threads);
int q8_matmul(const float *x, int rows, int k, const int8_t *qs, const float *s, int halves,
              int n, float *y, int threads);
void q4_dequantize(const uint8_t *qs, const void *s, const void *m, int half, int k, int o0,
                   int count, float *dst, int threads);
void q8_dequantize(const int8_t *qs, const float *s, int halves, int k, int o0, int count,
                   float *dst, int threads);

#endif
