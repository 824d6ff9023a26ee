/* The 4-bit matmul of q4_matmul.c, shared with the decode step of decode_step.c, the 8-bit one
 * of q8_matmul.c, the input quantization both use, a horizontal sum, and the fp16 scales'
 * conversion both kernels use. */
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

/* An fp16 value as fp32 (exact: every fp16 is an fp32), without F16C. */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    if (exp == 0) { /* zero or subnormal: man 2^-24 */
        float f = (float)man * 0x1p-24f;
        return sign ? -f : f;
    }
    uint32_t bits = sign | (man << 13) | (exp == 31 ? 0x7F800000u : (exp + 112) << 23);
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

/* Scale or minimum i of an array of them, fp16 where `fp16`, else fp32. */
static inline float param_at(const void *p, int fp16, size_t i) {
    return fp16 ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* n fp16 values as fp32 (F16C where the build has it). */
static inline void halves_to_floats(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++)
        dst[i] = half_to_float(src[i]);
}

/* AVX-512 VNNI where the compiler targets it (-march=native on such a CPU). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX2__)
#define FMSERVE_VNNI 1
#endif

#ifdef FMSERVE_VNNI
#include <immintrin.h>
/* acc + the dot products of q's unsigned bytes with the four signed bytes at x, broadcast:
 * vpdpbusd with x as its embedded-broadcast memory operand. Written out because gcc loads
 * _mm512_set1_epi32(x) into a register first, an extra vector instruction for each (2-core
 * AVX512-BF16 EPYC, bit-identical: the 4-bit tiles 1.03-1.12x at 8-32 rows, the 8-bit ones
 * 1.00-1.05x; a 32-stream offline wave, SmolLM2 1.06x, Gemma 3 1.01x: docs/benchmarks.md). */
static inline __attribute__((always_inline)) __m512i dpbusd_x4(__m512i acc, __m512i q,
                                                                const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(q), "m"(*(const int32_t *)x));
    return acc;
}
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
/* A weight's scales s (and a 4-bit one's minimums m) are fp32, or fp16 where `fp16` (a Q4_0,
 * Q4_1 or Q8_0 file's own values, which fp16 holds exactly). */
int q4_matmul(const float *x, int rows, int k, const uint8_t *qs, const void *s, const void *m,
              int fp16, int n, float *y, int threads);
int q8_matmul(const float *x, int rows, int k, const int8_t *qs, const void *s, int fp16,
              int halves, int narrow, int n, float *y, int threads);
void q4_dequantize(const uint8_t *qs, const void *s, const void *m, int fp16, int k, int o0,
                   int count, float *dst, int threads);
void q8_dequantize(const int8_t *qs, const void *s, int fp16, int halves, int k, int o0,
                   int count, float *dst, int threads);

#endif
