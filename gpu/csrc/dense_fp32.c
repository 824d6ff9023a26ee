/* y = x W^T for a dense fp32 weight on the CPU (gpu/layers.py DenseLinear, an engine of dtype
 * fp32: a safetensors model, or a GGUF's weights dequantized for exactness).
 *
 * W [out, in] is packed once into panels of 16 output columns: panel p holds W^T's columns
 * 16p..16p+15 as [in][16] (64 bytes, one cache line, an input), the last one zero-padded. A
 * tile keeps R rows x NP panels of sums in registers (2 NP vectors a row, at most 12) and
 * walks the inputs once; each weight vector read serves all R rows. MKL's sgemm reads its
 * W^T at 28 GB/s for one row but multiplies few rows poorly (default model, one thread,
 * AVX2 EPYC: 4 rows 35.6 ms, 8 rows 46.5 ms for what one row takes 15 ms); numbers in
 * gpu/dense_fp32.py.
 *
 * Every output is one fused multiply-add chain over the inputs in order, whatever the batch:
 * a row's result does not depend on the rows beside it (batch-invariant). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define PANEL 16
#define MAX_ROWS 6 /* rows of a tile: 12 sums at one panel, 2 vector registers a row */

/* panels [ceil(out / 16)][in][16] from w [out, in] (row-major). */
void fp32_pack_panels(const float *w, int64_t out, int64_t in, float *panels, int threads) {
    const int64_t count = (out + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < count; p++) {
        float *dst = panels + p * in * PANEL;
        const int64_t c0 = p * PANEL, width = out - c0 < PANEL ? out - c0 : PANEL;
        if (width < PANEL)
            memset(dst, 0, (size_t)(in * PANEL) * sizeof(float));
        /* 16 rows of W at a time, each read a line at a time, written across the panel */
        for (int64_t k0 = 0; k0 < in; k0 += PANEL) {
            const int64_t k1 = k0 + PANEL < in ? k0 + PANEL : in;
            for (int64_t c = 0; c < width; c++)
                for (int64_t k = k0; k < k1; k++)
                    dst[k * PANEL + c] = w[(c0 + c) * in + k];
        }
    }
}

/* The same in W's own memory, for an `out` that is a multiple of 16: panel p takes the place of
 * rows 16p..16p+15 (the same 16 x in floats), each block copied out to a thread's scratch
 * first. Nothing new is allocated, so no fresh page is faulted in (most of a fresh pack's time;
 * gpu/dense_fp32.py). */
void fp32_pack_panels_in_place(float *w, int64_t out, int64_t in, int threads) {
    const int64_t count = out / PANEL;
#pragma omp parallel num_threads(threads)
    {
        float *block = malloc((size_t)(PANEL * in) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < count; p++) {
            float *dst = w + p * in * PANEL;
            memcpy(block, dst, (size_t)(PANEL * in) * sizeof(float));
            for (int64_t k = 0; k < in; k++)
                for (int c = 0; c < PANEL; c++)
                    dst[k * PANEL + c] = block[c * in + k];
        }
        free(block);
    }
}

/* The panels per tile for R rows: 12 sums (the registers AVX2 has beside the weights'). */
static inline int panels_for(int R) { return R == 1 ? 4 : R == 2 ? 3 : R == 3 ? 2 : 1; }

#if defined(__AVX2__) && defined(__FMA__)
/* R rows of x (stride `in`) against NP panels starting at `p`, into y (stride `out`). */
static inline __attribute__((always_inline)) void tile(const float *x, int R, const float *p,
                                                       int NP, int64_t in, float *y,
                                                       int64_t out, int64_t col) {
    __m256 acc[MAX_ROWS][8];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int j = 0; j < 2 * NP; j++)
            acc[r][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < in; k++) {
        __m256 w[8];
#pragma GCC unroll 8
        for (int j = 0; j < 2 * NP; j++)
            w[j] = _mm256_loadu_ps(p + (j / 2) * in * PANEL + k * PANEL + (j % 2) * 8);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * in + k);
#pragma GCC unroll 8
            for (int j = 0; j < 2 * NP; j++)
                acc[r][j] = _mm256_fmadd_ps(xb, w[j], acc[r][j]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int q = 0; q < NP; q++) {
            const int64_t c = col + q * PANEL, width = out - c;
            if (width >= PANEL) {
                _mm256_storeu_ps(y + r * out + c, acc[r][2 * q]);
                _mm256_storeu_ps(y + r * out + c + 8, acc[r][2 * q + 1]);
            } else if (width > 0) { /* the last, padded panel */
                float part[PANEL];
                _mm256_storeu_ps(part, acc[r][2 * q]);
                _mm256_storeu_ps(part + 8, acc[r][2 * q + 1]);
                memcpy(y + r * out + c, part, (size_t)width * sizeof(float));
            }
        }
}

/* One tile of R rows from panel `p0`, NP = panels_for(R) or fewer at the end: the tile's
 * shape is a compile-time constant in each call below, so its sums stay in registers. */
static void tile_rows(const float *x, int R, const float *panels, int64_t p0, int np,
                      int64_t in, float *y, int64_t out) {
    const float *p = panels + p0 * in * PANEL;
    const int64_t col = p0 * PANEL;
#define TILE_CASE(RR, NN) \
    if (R == RR && np == NN) { tile(x, RR, p, NN, in, y, out, col); return; }
    TILE_CASE(1, 4) TILE_CASE(1, 3) TILE_CASE(1, 2) TILE_CASE(1, 1)
    TILE_CASE(2, 3) TILE_CASE(2, 2) TILE_CASE(2, 1)
    TILE_CASE(3, 2) TILE_CASE(3, 1)
    TILE_CASE(4, 1) TILE_CASE(5, 1) TILE_CASE(6, 1)
#undef TILE_CASE
}
#else
/* Without AVX2 + FMA: the same order of sums, one output at a time. */
static void tile_rows(const float *x, int R, const float *panels, int64_t p0, int np,
                      int64_t in, float *y, int64_t out) {
    for (int q = 0; q < np; q++) {
        const float *p = panels + (p0 + q) * in * PANEL;
        for (int r = 0; r < R; r++)
            for (int c = 0; c < PANEL && (p0 + q) * PANEL + c < out; c++) {
                float s = 0.0f;
                for (int64_t k = 0; k < in; k++)
                    s += x[r * in + k] * p[k * PANEL + c];
                y[r * out + (p0 + q) * PANEL + c] = s;
            }
    }
}
#endif

/* y [rows, out] = x [rows, in] W^T, W packed by fp32_pack_panels. Up to 6 rows, each unit of
 * work is a tile's panels for all rows (the weights read once); more rows go 6 at a time
 * within each panel, which then stays in cache across them. */
void fp32_panel_matmul(const float *x, int rows, int64_t in, const float *panels, int64_t out,
                       float *y, int threads) {
    const int64_t count = (out + PANEL - 1) / PANEL;
    if (rows <= MAX_ROWS) {
        /* 4 rows as two tiles of 2 over the same 3 panels (in cache for the second): 4 rows
         * at one panel are 8 sums, too few to hide the multiply-add's latency */
        const int split = rows == 4 ? 2 : rows, np = panels_for(split);
        const int64_t units = (count + np - 1) / np;
        const int parallel = units > 1 && (int64_t)rows * in * out >= 65536;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
        for (int64_t u = 0; u < units; u++) {
            const int64_t p0 = u * np;
            const int n = count - p0 < np ? (int)(count - p0) : np;
            for (int r0 = 0; r0 < rows; r0 += split)
                tile_rows(x + (int64_t)r0 * in, split, panels, p0, n, in, y + (int64_t)r0 * out,
                          out);
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < count; p++)
        for (int r0 = 0; r0 < rows; r0 += MAX_ROWS) {
            const int R = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
            tile_rows(x + (int64_t)r0 * in, R, panels, p, 1, in, y + (int64_t)r0 * out, out);
        }
}
