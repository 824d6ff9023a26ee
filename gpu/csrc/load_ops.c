/* A load's fp32 conversions (gpu/loader/fp32_convert.py): a GGUF tensor's Q4_0 / Q4_1 / Q8_0
 * blocks to fp32, and an fp32 matrix's transposed copy.
 *
 * An engine of dtype fp32 holds every projection dense, dequantized from the file and kept
 * as W^T (gpu/layers.py DenseLinear): in torch, the default model's load spent ~1.2 s in the
 * dequantize and ~0.35-0.5 s in the transposes on one thread, each of several passes over
 * 0.5 GB; here each is one pass (numbers in gpu/loader/fp32_convert.py).
 *
 * The values are bit-identical to the gguf package's dequantize: an fp16 scale (11 significant
 * bits) times a code of at most 8 bits is exact in fp32, so the one rounding is Q4_1's sum,
 * fused multiply-add or not. */
#include <stdint.h>
#include <string.h>

#define GROUP 32

static float fp16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) { /* inf / nan */
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp) { /* normal */
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (!man) { /* zero */
        bits = sign;
    } else { /* subnormal: normalize (exact in fp32) */
        int shift = 0;
        while (!(man & 0x400)) {
            man <<= 1;
            shift++;
        }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* blocks: `count` blocks of `kind` 0 (Q4_0, 18 bytes), 1 (Q4_1, 20) or 2 (Q8_0, 34), in the
 * file's order; out: count * 32 floats. Q4_0 w = (q - 8) d; Q4_1 w = q d + m, byte j holding
 * element j low and j + 16 high; Q8_0 w = q d. */
void gguf_blocks_to_fp32(const uint8_t *blocks, int64_t count, int kind, float *out,
                         int threads) {
    const int size = kind == 0 ? 18 : kind == 1 ? 20 : 34;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < count; b++) {
        const uint8_t *blk = blocks + b * size;
        float *w = out + b * GROUP, d = fp16_at(blk);
        if (kind == 2) {
            const int8_t *q = (const int8_t *)(blk + 2);
            for (int j = 0; j < GROUP; j++)
                w[j] = (float)q[j] * d;
        } else if (kind == 1) {
            const float m = fp16_at(blk + 2);
            const uint8_t *q = blk + 4;
            for (int j = 0; j < GROUP / 2; j++) {
                float lo = d * (float)(q[j] & 0x0F), hi = d * (float)(q[j] >> 4);
                w[j] = lo + m;
                w[j + GROUP / 2] = hi + m;
            }
        } else {
            const uint8_t *q = blk + 2;
            for (int j = 0; j < GROUP / 2; j++) {
                w[j] = d * (float)((q[j] & 0x0F) - 8);
                w[j + GROUP / 2] = d * (float)((q[j] >> 4) - 8);
            }
        }
    }
}

#define TILE 16

/* dst [cols, rows] = src [rows, cols]^T, a 16 x 16 tile at a time: each tile's 16 rows are
 * read and written a cache line each. */
void transpose_fp32(const float *src, int64_t rows, int64_t cols, float *dst, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
        int64_t r1 = r0 + TILE < rows ? r0 + TILE : rows;
        for (int64_t c0 = 0; c0 < cols; c0 += TILE) {
            int64_t c1 = c0 + TILE < cols ? c0 + TILE : cols;
            for (int64_t c = c0; c < c1; c++)
                for (int64_t r = r0; r < r1; r++)
                    dst[c * rows + r] = src[r * cols + c];
        }
    }
}
