/* The sampler's Gumbel noise (gpu/seeded_random.py) in one pass, for a CPU: the per-token hash,
 * the uniform and -log(-log u) that torch ran as ~20 passes over [rows, vocab] (32 x 49,152:
 * ~4 ms a step), and the draw argmax(logit / T + noise) without writing the noise at all.
 *
 * Every value is the same on every build (AVX-512, AVX2, plain C) and whether a loop is
 * vectorised or not: the hash is integer arithmetic, and the log is written with explicit fmaf
 * and no other multiply feeding an add, so no compiler can contract it differently. The torch
 * path of gpu/sampler.py takes its noise from here on a CPU too, so a seeded request draws the
 * same tokens whichever path its batch takes. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 8192 /* tokens a task: a row is split so one row still uses every thread */

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

/* The noise of token `id` for a draw whose key has these low 32 bits: murmur3's fmix32 of the
 * token's term, the top 23 bits as a uniform in [2^-24, 1 - 2^-24], then -log(-log u). */
static inline float gumbel_of(uint32_t key, int64_t id) {
    uint32_t h = ((uint32_t)(id + 1) * 0x9E3779B9u) ^ key;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    float u = ((float)((int32_t)h >> 9) + 4194304.5f) * 0x1p-23f;
    return -log_positive(-log_positive(u));
}

/* out [rows, n]: the noise of row r's draw (keys[r], its low 32 bits) for token ids[r, j], or
 * for token j where ids is NULL. */
void gumbel_noise(const int64_t *keys, int rows, const int64_t *ids, int n, float *out,
                  int threads) {
    int chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int task = 0; task < rows * chunks; task++) {
        int r = task / chunks, j0 = (task % chunks) * CHUNK;
        int j1 = j0 + CHUNK < n ? j0 + CHUNK : n;
        uint32_t key = (uint32_t)keys[r];
        float *o = out + (size_t)r * n;
        if (ids) {
            const int64_t *row_ids = ids + (size_t)r * n;
            for (int j = j0; j < j1; j++)
                o[j] = gumbel_of(key, row_ids[j]);
        } else {
            for (int j = j0; j < j1; j++)
                o[j] = gumbel_of(key, j);
        }
    }
}

/* tokens[r]: argmax_j logits[r, j] / temps[r] + noise(keys[r], j), or argmax_j logits[r, j]
 * where greedy[r]; the first of equal largest, NaNs passed over (as q8_matmul_argmax).
 * Returns 0, or -1 if out of memory. */
int gumbel_argmax(const float *logits, int rows, int n, const float *temps,
                   const int64_t *keys, const uint8_t *greedy, int64_t *tokens, int threads) {
    int chunks = (n + CHUNK - 1) / CHUNK;
    float *best = malloc(sizeof(float) * (size_t)rows * chunks);
    int *where = malloc(sizeof(int) * (size_t)rows * chunks);
    if (!best || !where) {
        free(best);
        free(where);
        return -1;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int task = 0; task < rows * chunks; task++) {
        int r = task / chunks, j0 = (task % chunks) * CHUNK;
        int j1 = j0 + CHUNK < n ? j0 + CHUNK : n;
        const float *row = logits + (size_t)r * n;
        float scores[CHUNK];
        if (greedy[r]) {
            memcpy(scores, row + j0, sizeof(float) * (size_t)(j1 - j0));
        } else {
            uint32_t key = (uint32_t)keys[r];
            float t = temps[r];
            for (int j = j0; j < j1; j++)
                scores[j - j0] = gumbel_of(key, j) + row[j] / t;
        }
        float top = -INFINITY;
        int at = j0;
        for (int j = 0; j < j1 - j0; j++)
            if (scores[j] > top) {
                top = scores[j];
                at = j0 + j;
            }
        best[task] = top;
        where[task] = at;
    }
    for (int r = 0; r < rows; r++) {
        int at = r * chunks;
        for (int c = 1; c < chunks; c++) /* strictly larger: the earlier chunk wins a tie */
            if (best[r * chunks + c] > best[at])
                at = r * chunks + c;
        tokens[r] = where[at];
    }
    free(best);
    free(where);
    return 0;
}
