/* The 8-bit kernel's row tiles (q8_matmul.c) where AVX-512 VNNI is not built: AVX2's
 * maddubs (|q| times x8 carrying q's sign), else plain C. Included by q8_matmul.c alone, after
 * its layout (GROUP, STEP_BYTES, BLOCK_BYTES), `tile_args` and `four_bytes`. */
#ifndef FMSERVE_Q8_TILES_FALLBACK_H
#define FMSERVE_Q8_TILES_FALLBACK_H
#if defined(__AVX2__)
/* Rows a tile: a group's codes and |q| are read once for them. More rows than the 16 ymm
 * registers hold still paid (spilled sums live in L1), measured under FMSERVE_CPU_ISA=avx2 on
 * the AVX512-BF16 EPYC against 2 rows: Gemma 3's Q5_0 and Q6_K projections 1.06-1.11x at
 * 8-128 rows with 4; a greedy lm_head (Gemma 3's 262,144 x 640, SmolLM2's 49,152 x 576) with
 * 8, 1.29x at 8 rows and 1.10x at 32 (4: 1.20x and 1.12x). */
#define TILE 4
#define ARGMAX_TILE 8
#define NARROW_SUMS 1
/* H scales a block (q8_matmul.c): 1, or Q6_K's 2, one per 8 / H steps. Q6_K's codes are
 * within +-32, so a half's 4 steps of maddubs pairs add up to at most 4 x 2 x 32 x 127 =
 * 32,512, and narrow codes' (N: within +-16, Q5_0's) 8 steps as much: they are added in int16
 * and widened once a half or block (exact); Q8_0's full-range codes widen every step. */
static inline __attribute__((always_inline)) void group_tile(
        int R, int H, int N, const tile_args *a, float out[][16]) {
    const int in16 = H == 2 || N;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[ARGMAX_TILE][2];
    for (int i = 0; i < R; i++)
        acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int b = 0; b < a->nb; b++)
      for (int half = 0; half < H; half++) {
        const int8_t *qb = a->qs + (size_t)b * BLOCK_BYTES;
        __m256i sums[ARGMAX_TILE][2];
        for (int i = 0; i < R; i++)
            sums[i][0] = sums[i][1] = _mm256_setzero_si256();
        for (int j = half * 8 / H; j < (half + 1) * 8 / H; j++) {
            for (int h = 0; h < 2; h++) { /* rows 0-7, then 8-15 */
                __m256i q = _mm256_loadu_si256((const __m256i *)(qb + j * STEP_BYTES + 32 * h));
                __m256i q_abs = _mm256_sign_epi8(q, q);
                for (int i = 0; i < R; i++) {
                    __m256i x = _mm256_set1_epi32(four_bytes(a->x8 + (size_t)i * a->k
                                                             + b * GROUP + 4 * j));
                    __m256i pairs = _mm256_maddubs_epi16(q_abs, _mm256_sign_epi8(x, q));
                    sums[i][h] = in16 ? _mm256_add_epi16(sums[i][h], pairs)
                                        : _mm256_add_epi32(sums[i][h],
                                                           _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        if (in16)
            for (int i = 0; i < R; i++)
                for (int h = 0; h < 2; h++)
                    sums[i][h] = _mm256_madd_epi16(sums[i][h], ones);
        for (int h = 0; h < 2; h++) {
            __m256 s = _mm256_loadu_ps(a->s + (b * H + half) * 16 + 8 * h);
            for (int i = 0; i < R; i++)
                acc[i][h] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(sums[i][h]),
                    _mm256_mul_ps(s, _mm256_set1_ps(a->d[(size_t)i * a->nb + b])), acc[i][h]);
        }
      }
    for (int i = 0; i < R; i++)
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(out[i] + 8 * h, acc[i][h]);
}
#else
#define TILE 1
/* H scales a block (q8_matmul.c): 1, or Q6_K's 2, one per 8 / H steps. */
static void group_tile(int R, int H, int N, const tile_args *a, float out[][16]) {
    (void)N;
    for (int i = 0; i < R; i++)
        for (int l = 0; l < 16; l++) {
            float total = 0.f;
            for (int b = 0; b < a->nb; b++)
                for (int h = 0; h < H; h++) {
                    const int8_t *qb = a->qs + (size_t)b * BLOCK_BYTES + 4 * l;
                    const int8_t *x = a->x8 + (size_t)i * a->k + b * GROUP;
                    int sum = 0;
                    for (int j = h * 8 / H; j < (h + 1) * 8 / H; j++)
                        for (int u = 0; u < 4; u++)
                            sum += qb[j * STEP_BYTES + u] * x[4 * j + u];
                    total += (float)sum * (a->s[(b * H + h) * 16 + l]
                                           * a->d[(size_t)i * a->nb + b]);
                }
            out[i][l] = total;
        }
}
#endif
#endif
