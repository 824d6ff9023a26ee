/* The sampler's Gumbel noise (gpu/seeded_random.py) in one pass, for a CPU: the per-token hash,
 * the uniform and -log(-log u) that torch ran as ~20 passes over [rows, vocab] (32 x 49,152:
 * ~4 ms a step), and the draw argmax(logit / T + noise) without writing the noise at all.
 *
 * Every value is the same on every build (AVX-512, AVX2, plain C) and whether a loop is
 * vectorised or not (gumbel.h). The torch path of gpu/sampler.py takes its noise from here on
 * a CPU too, so a seeded request draws the same tokens whichever path its batch takes. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gumbel.h"

#define CHUNK 8192 /* tokens a task: a row is split so one row still uses every thread */

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
