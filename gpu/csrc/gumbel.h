/* The sampler's Gumbel noise for one token (gpu/seeded_random.py's formula), shared by the
 * one-pass draw of gumbel.c and the lm_head's draw of q8_matmul.c, so both give the same
 * values: the hash is integer arithmetic, and the log is written with explicit fmaf and no
 * other multiply feeding an add, so no build or vectorisation can round it differently. */
#ifndef FMSERVE_GUMBEL_H
#define FMSERVE_GUMBEL_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Above any noise: u <= 1 - 2^-24, so -log(-log u) <= 16.6356 (to the log's ~1 ulp). A token
 * whose scaled logit is this far below a row's best score so far cannot win the draw. */
#define GUMBEL_MAX 16.7f

/* ln x for a positive normal x: Cephes' logf (~1 ulp), its reduction to [sqrt(1/2), sqrt(2)). */
static inline float log_positive(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    int32_t e = (int32_t)(bits >> 23) - 126;
    bits = (bits & 0x007FFFFFu) | 0x3F000000u; /* the mantissa in [0.5, 1) */
    float m;
    memcpy(&m, &bits, sizeof m);
    int below = m < 0.70710678f;
    e -= below;
    m = below ? (m + m) - 1.0f : m - 1.0f;
    float fe = (float)e, z = m * m;
    float p = 7.0376836292e-2f;
    p = fmaf(p, m, -1.1514610310e-1f);
    p = fmaf(p, m, 1.1676998740e-1f);
    p = fmaf(p, m, -1.2420140846e-1f);
    p = fmaf(p, m, 1.4249322787e-1f);
    p = fmaf(p, m, -1.6668057665e-1f);
    p = fmaf(p, m, 2.0000714765e-1f);
    p = fmaf(p, m, -2.4999993993e-1f);
    p = fmaf(p, m, 3.3333331174e-1f);
    float y = (p * m) * z;
    y = fmaf(fe, -2.12194440e-4f, y);
    y = fmaf(z, -0.5f, y);
    return fmaf(fe, 0.693359375f, m + y);
}

/* The uniform of token `id` for a draw whose key has these low 32 bits: murmur3's fmix32 of
 * the token's term, its top 23 bits as a uniform in [2^-24, 1 - 2^-24]. */
static inline float uniform_of(uint32_t key, int64_t id) {
    uint32_t h = ((uint32_t)(id + 1) * 0x9E3779B9u) ^ key;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return ((float)((int32_t)h >> 9) + 4194304.5f) * 0x1p-23f;
}

/* Its noise, -log(-log u). */
static inline float gumbel_of(uint32_t key, int64_t id) {
    return -log_positive(-log_positive(uniform_of(key, id)));
}

/* Whether no uniform below u_top can give a noise that reaches `gap` (> 0): -log(-log u) <
 * gap - 1e-3 for every u < 1 - 2^-k with k = floor((gap - 1e-3) log2 e), since -log(1 - x) >=
 * x; the 1e-3 covers the logs' few ulps and the sum's rounding. A bound without a log: a
 * tile whose uniforms all stay below it cannot win, and skips its noise. */
static inline int noise_cannot_reach(float u_top, float gap) {
    float bits = (gap - 1e-3f) * 1.44269504f;
    if (!(bits >= 1.0f))
        return 0;
    int k = bits >= 24.0f ? 24 : (int)bits;
    uint32_t power = (uint32_t)(127 - k) << 23; /* 2^-k's bits: ldexpf was a call a token */
    float below_one;
    memcpy(&below_one, &power, sizeof below_one);
    return u_top < 1.0f - below_one;
}

/* uniform_of's hash in vector lanes, h holding each token's id + 1 (P: _mm512 or _mm256, S:
 * si512 or si256), for tile_noise_may_reach below. */
#define FMIX_LANES(P, S, h, key)                                                          \
    do {                                                                                  \
        h = P##_xor_##S(P##_mullo_epi32(h, P##_set1_epi32((int32_t)0x9E3779B9u)),         \
                        P##_set1_epi32((int32_t)(key)));                                  \
        h = P##_xor_##S(h, P##_srli_epi32(h, 16));                                        \
        h = P##_mullo_epi32(h, P##_set1_epi32((int32_t)0x85EBCA6Bu));                     \
        h = P##_xor_##S(h, P##_srli_epi32(h, 13));                                        \
        h = P##_mullo_epi32(h, P##_set1_epi32((int32_t)0xC2B2AE35u));                     \
        h = P##_xor_##S(h, P##_srli_epi32(h, 16));                                        \
    } while (0)

/* Whether a token of first .. first + 15 can gain `gap` from its noise: !noise_cannot_reach
 * (its uniform, gap) for one of them, the same answer, tested on the hashes' integer bits
 * (u >= 1 - 2^-k where the top 23 bits of h >= v_min, i.e. h >= v_min * 512) 8 or 16 lanes
 * at a time. The lm_head's draw asks it of ~45% of a sampled row's tiles (Gemma 3 at T = 0.8):
 * scalar hashes, floats and ldexpf there were a quarter of the lm_head's time at 32 rows. */
static inline int tile_noise_may_reach(uint32_t key, int64_t first, float gap) {
    float bits = (gap - 1e-3f) * 1.44269504f;
    if (!(bits >= 1.0f))
        return 1;
    int k = bits >= 24.0f ? 24 : (int)bits;
    int32_t h_min = (k == 24 ? 4194303 : 4194304 - (1 << (23 - k))) * 512;
    uint32_t term = (uint32_t)(first + 1);
#if defined(__AVX512F__)
    __m512i h = _mm512_add_epi32(_mm512_set1_epi32((int32_t)term),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                   14, 15));
    FMIX_LANES(_mm512, si512, h, key);
    return _mm512_cmpge_epi32_mask(h, _mm512_set1_epi32(h_min)) != 0;
#elif defined(__AVX2__)
    __m256i reach = _mm256_setzero_si256();
    for (int half = 0; half < 2; half++) {
        __m256i h = _mm256_add_epi32(_mm256_set1_epi32((int32_t)(term + 8u * half)),
                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        FMIX_LANES(_mm256, si256, h, key);
        reach = _mm256_or_si256(reach, _mm256_cmpgt_epi32(h, _mm256_set1_epi32(h_min - 1)));
    }
    return !_mm256_testz_si256(reach, reach);
#else
    for (int c = 0; c < 16; c++)
        if (!noise_cannot_reach(uniform_of(key, first + c), gap))
            return 1;
    return 0;
#endif
}

#endif
