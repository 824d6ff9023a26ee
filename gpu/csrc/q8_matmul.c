/* y = x W^T for a Q8_0 weight (llama.cpp's usual lm_head; an EAGLE head's projections), for
 * the few rows of a CPU decode step, against the input quantized to int8 as q4_matmul.c does
 * it; and the weight dequantized a piece at a time for the wide forwards.
 *
 * W: int8 codes q with one scale s per block of 32 inputs (w = q s), interleaved 16 output
 * rows together as the 4-bit codes are (gpu/cpu_q4_kernel.py Q8Rows): per group of 16 rows
 * and block, 8 steps of 64 bytes, step j holding inputs 4j..4j+3 of each row (4 bytes a row).
 * The integer multiply-adds want one operand unsigned. AVX-512 VNNI takes q + 128 and
 * subtracts 128 sum(x8) from each block's sum (below: on an AVX512-BF16 EPYC the 49152 x 576
 * lm_head ran 1.4x as fast at 4-8 rows, 1.2x at 32, as applying q's sign to every row's
 * input at every step, with the same sums); AVX2, |q| times x8 carrying q's sign (as llama.cpp
 * does), where |q| <= 128 and |x8| <= 127 keep maddubs' pair sums within int16.
 *
 * With `halves` = 2 a block has two scales, one per 16 inputs (steps 0-3 and 4-7): GGUF's
 * Q6_K, whose codes q - 32 (-32..31) are int8 codes exactly and whose scales d sc_j change
 * every 16 inputs. Each half's integer sum gets its own scale; the input stays quantized per
 * block of 32.
 *
 * `narrow`: every code is within +-16 (Q5_0's): AVX2 may then add a block's int16 pairs
 * before widening them (q8_tiles_fallback.h); the other builds ignore it. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gumbel.h"
#include "q4_matmul.h"

#define GROUP 32
#define STEP_BYTES 64                 /* 16 rows x 4 inputs */
#define BLOCK_BYTES (8 * STEP_BYTES) /* 16 rows x 32 inputs */
/* With more rows than a tile, the first tile's steps fetch the codes of the group AHEAD
 * groups on, a line a step (Gemma 3's 262,144 x 640 lm_head at 32 rows 1.03-1.05x; a whole
 * group fetched at once was 0.94x, and with one tile the fetches slow the stream, 0.8-0.9x). */
#ifndef AHEAD
#define AHEAD 4
#endif

typedef struct {
    const int8_t *qs;
    const float *s;
    const int8_t *x8;
    const float *d;
    int nb, k;
    const int32_t *sums; /* each block's (half's) sum of x8 ([rows][nb][H]; VNNI, see below) */
    const int8_t *ahead; /* a later group's codes, fetched a line a step meanwhile (or NULL) */
} tile_args;

static inline int32_t four_bytes(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(FMSERVE_VNNI)
#define TILE 8
/* A greedy lm_head's tiles take up to 12 rows (24 of the 32 vector registers): its codes come
 * from memory, and at 32 rows 3 passes over a group instead of 4 made Gemma 3's 262,144 x 640
 * lm_head 1.05x; the projections, in cache, were 0.95-0.97x at 32-128 rows with 12, so 8. */
#define ARGMAX_TILE 12
/* vpdpbusd multiplies unsigned bytes by signed ones: the codes go in as q + 128 (a flip of
 * the top bit, once per step for every row), and each block's sum then exceeds q . x8 by
 * exactly 128 sum(x8), taken off in the integers: the same sums as q . x8, with one
 * subtraction per row and block instead of a sign applied to every row's input at every step.
 * H scales a block: 1, or Q6_K's 2, one per 8 / H steps (a constant at each call). */
static inline __attribute__((always_inline)) void group_tile(int R, int H, int N,
                                                             const tile_args *a, float out[][16]) {
    (void)N; /* vpdpbusd sums into int32 whatever the codes */
    const __m512i top = _mm512_set1_epi8((char)0x80);
    __m512 acc[ARGMAX_TILE];
    for (int i = 0; i < R; i++)
        acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < a->nb; b++) {
        const int8_t *qb = a->qs + (size_t)b * BLOCK_BYTES;
        const int8_t *xb = a->x8 + (size_t)b * 8 * R * 4;
        for (int h = 0; h < H; h++) {
            __m512i sums[ARGMAX_TILE];
            for (int i = 0; i < R; i++)
                sums[i] = _mm512_set1_epi32(-128 * a->sums[((size_t)b * H + h) * R + i]);
            for (int j = h * 8 / H; j < (h + 1) * 8 / H; j++) {
                if (H == 1 && a->ahead) /* Q6_K's (H 2) tiles were not measured with it */
                    _mm_prefetch((const char *)a->ahead + (size_t)b * BLOCK_BYTES
                                 + j * STEP_BYTES, _MM_HINT_T0);
                __m512i q = _mm512_xor_si512(
                    _mm512_loadu_si512((const void *)(qb + j * STEP_BYTES)), top);
                for (int i = 0; i < R; i++)
                    sums[i] = dpbusd_x4(sums[i], q, xb + (j * R + i) * 4);
            }
            __m512 s = _mm512_loadu_ps(a->s + (b * H + h) * 16);
            for (int i = 0; i < R; i++)
                acc[i] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(sums[i]),
                    _mm512_mul_ps(s, _mm512_set1_ps(a->d[(size_t)b * R + i])), acc[i]);
        }
    }
    for (int i = 0; i < R; i++)
        _mm512_storeu_ps(out[i], acc[i]);
}

#else /* AVX2, else plain C */
#include "q8_tiles_fallback.h"
#endif

/* H and N constants at each call: Q8_0's one scale a block, Q6_K's two and narrow codes
 * compile apart */
#define RUN_TILE(R, H, N) group_tile(R, H, N, &a, out)
#define TILE_CASES(H, N)                                                                  \
    switch (take) { /* each a constant: the accumulators stay in registers */                \
    case 1: RUN_TILE(1, H, N); break;                                                        \
    TILE_2(case 2: RUN_TILE(2, H, N); break;)                                                \
    TILE_4(case 3: RUN_TILE(3, H, N); break; case 4: RUN_TILE(4, H, N); break;)              \
    TILE_8(case 5: RUN_TILE(5, H, N); break; case 6: RUN_TILE(6, H, N); break;               \
           case 7: RUN_TILE(7, H, N); break; case 8: RUN_TILE(8, H, N); break;)              \
    TILE_12(case 9: RUN_TILE(9, H, N); break; case 10: RUN_TILE(10, H, N); break;            \
            case 11: RUN_TILE(11, H, N); break; case 12: RUN_TILE(12, H, N); break;)         \
    }
#ifndef NARROW_SUMS
#define NARROW_SUMS 0 /* a build whose tiles do nothing else for narrow codes */
#endif
#ifndef ARGMAX_TILE
#define ARGMAX_TILE TILE
#endif
#if ARGMAX_TILE >= 2 /* the cases either kind of tile may take */
#define TILE_2(x) x
#else
#define TILE_2(x)
#endif
#if ARGMAX_TILE >= 4 /* an lm_head at 3 streams: the codes read once */
#define TILE_4(x) x
#else
#define TILE_4(x)
#endif
#if ARGMAX_TILE >= 8
#define TILE_8(x) x
#else
#define TILE_8(x)
#endif
#if ARGMAX_TILE >= 12
#define TILE_12(x) x
#else
#define TILE_12(x)
#endif

/* Each tile's outputs go to y, or (y NULL) into each row's best column so far: the first
 * of the largest among the `valid` columns, as torch's argmax over y would pick it; with
 * `keys`, of the largest y / temps[r] + noise (gumbel.h) in the rows not `greedy`. */
typedef struct {
    float *y;
    int64_t *best;     /* [threads][rows]: each thread's best column of a row, -1 for none */
    float *best_value; /* [threads][rows]: its value (score) */
    int valid;
    const float *temps;   /* [rows], or NULL: every row greedy */
    const int64_t *keys;  /* [rows]: each draw's key (gpu/seeded_random.py row_keys) */
    const uint8_t *greedy; /* [rows] */
} tile_sink;

/* Larger, or as large and an earlier column (whatever order the threads took them in). */
static inline int better(float value, int64_t col, float best_value, int64_t best) {
    return best < 0 ? value > -INFINITY : value > best_value || (value == best_value && col < best);
}

/* The largest of a tile row's 16 outputs, NaNs skipped: vmaxps alone may pass a NaN on, or
 * drop a value beside one, so NaNs become -inf first. One vector reduction, not 16 scalar
 * compares: the lm_heads' argmax (SmolLM2's, Gemma 3's) 1.03-1.06x at 8-32 rows; on AVX2 two
 * halves measured 0.95-1.04x, so that build keeps the loop. */
static inline float top_of_16(const float v[16]) {
#if defined(FMSERVE_VNNI)
    __m512 x = _mm512_loadu_ps(v);
    x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), _mm512_set1_ps(-INFINITY), x);
    return _mm512_reduce_max_ps(x);
#else
    float top = -INFINITY;
    for (int c = 0; c < 16; c++)
        top = v[c] > top ? v[c] : top;
    return top;
#endif
}

static void sink_tile(const tile_sink *o, int rows, int n, int g, int r, int take,
                      float out[][16]) {
    if (o->y) {
        for (int i = 0; i < take; i++)
            memcpy(o->y + (size_t)(r + i) * n + (size_t)g * 16, out[i], sizeof out[i]);
        return;
    }
    size_t slot = (size_t)omp_get_thread_num() * rows + r;
    for (int i = 0; i < take; i++) {
        float top = top_of_16(out[i]), *score = out[i]; /* a max first: most tiles beat nothing */
        float drawn[16];
        if (o->temps && !o->greedy[r + i]) { /* a draw: the tile can win only within the noise */
            float t = o->temps[r + i], at_best = o->best_value[slot + i];
            if (o->best[slot + i] >= 0 && !(GUMBEL_MAX + top / t >= at_best))
                continue;
            uint32_t key = (uint32_t)o->keys[r + i];
            /* the uniforms first: most tiles end here, without a log */
            if (o->best[slot + i] >= 0 && !tile_noise_may_reach(key, g * 16, at_best - top / t))
                continue;
            for (int c = 0; c < 16; c++)
                drawn[c] = gumbel_of(key, g * 16 + c) + out[i][c] / t;
            score = drawn;
            top = top_of_16(drawn);
        }
        if (!(top >= o->best_value[slot + i]) && o->best[slot + i] >= 0)
            continue;
        for (int c = 0; c < 16 && g * 16 + c < o->valid; c++)
            if (better(score[c], g * 16 + c, o->best_value[slot + i], o->best[slot + i])) {
                o->best_value[slot + i] = score[c];
                o->best[slot + i] = g * 16 + c;
            }
    }
}

static int q8_tiles(const float *x, int rows, int k, const int8_t *qs, const void *s, int fp16,
                    int halves, int narrow, int n, const tile_sink *sink, int threads) {
    int nb = k / GROUP;
    int8_t *x8;
    int32_t *x8_sums, *half_sums = NULL;
    float *d = quantize_input(x, rows, k, &x8, &x8_sums, threads);
    if (!d)
        return -1;
    if (halves == 2) { /* each 16 inputs' sum of x8, for VNNI's offset (above) */
        half_sums = malloc(sizeof(int32_t) * (size_t)rows * nb * 2);
        if (!half_sums) {
            free(d);
            return -1;
        }
        for (size_t h = 0; h < (size_t)rows * nb * 2; h++) {
            int32_t total = 0;
            for (int j = 0; j < 16; j++)
                total += x8[h * 16 + j];
            half_sums[h] = total;
        }
        x8_sums = half_sums;
    }
    int tile = sink->y ? TILE : ARGMAX_TILE;
#if defined(FMSERVE_VNNI) /* the tiles' layout (q4_matmul.h); one row's is its own */
    if (rows > 1 && (interleave_x8(x8, rows, k, tile) || interleave_words(d, rows, nb, tile)
                     || interleave_words(x8_sums, rows, nb * halves, tile))) {
        free(half_sums);
        free(d);
        return -1;
    }
#endif
    /* guided, not static: a thread that finishes early takes groups from the slower one (on
     * this 2-core VM's steps 17% faster at 1 and 32 rows; the barrier wait 10 -> 6% of them) */
#pragma omp parallel for schedule(guided) num_threads(threads)
    for (int g = 0; g < n / 16; g++) {
        float out[ARGMAX_TILE][16];
        /* fp16 scales (a Q8_0 file's own) as fp32 for this group: the tiles read fp32 */
        size_t at = (size_t)g * nb * halves * 16, count = (size_t)nb * halves * 16;
        float group_scales[fp16 ? count : 1];
        const float *gs = (const float *)s + at;
        if (fp16) {
            halves_to_floats((const uint16_t *)s + at, group_scales, count);
            gs = group_scales;
        }
        tile_args a = {qs + (size_t)g * nb * BLOCK_BYTES, gs, x8, d, nb, k, x8_sums, NULL};
        const int8_t *ahead = rows > tile && g + AHEAD < n / 16
                                  ? qs + (size_t)(g + AHEAD) * nb * BLOCK_BYTES : NULL;
        for (int r = 0; r < rows;) {
            int take = rows - r < tile ? rows - r : tile;
            a.x8 = x8 + (size_t)r * k;
            a.d = d + (size_t)r * nb;
            a.sums = x8_sums + (size_t)r * nb * halves;
            a.ahead = r == 0 ? ahead : NULL; /* the first tile's steps fetch it */
            if (halves == 2)
                TILE_CASES(2, 0)
            else if (NARROW_SUMS && narrow)
                TILE_CASES(1, 1)
            else
                TILE_CASES(1, 0)
            sink_tile(sink, rows, n, g, r, take, out);
            r += take;
        }
    }
    free(half_sums);
    free(d);
    return 0;
}

/* y [rows, n] = x [rows, k] W^T for an 8-bit weight (codes qs, scales s, interleaved as
 * above, `halves` 1 (Q8_0) or 2 (Q6_K) scales a block, `narrow` as above; k a multiple of
 * 32, n of 16). Returns 0, or -1 if out of memory. */
int q8_matmul(const float *x, int rows, int k, const int8_t *qs, const void *s, int fp16,
              int halves, int narrow, int n, float *y, int threads) {
    tile_sink sink = {y, NULL, NULL, n, NULL, NULL, NULL};
    return q8_tiles(x, rows, k, qs, s, fp16, halves, narrow, n, &sink, threads);
}

/* tokens [rows] = argmax over the first `valid` columns of x W^T (the first column of the
 * largest value), without writing the [rows, n] product: a greedy step's lm_head, whose
 * 262,144-column product (Gemma 3) is 1 MB a row to write and read back. With temps (else
 * NULL), row r not greedy[r] draws argmax(x W^T / temps[r] + noise(keys[r])) instead: the
 * token cut_draw (sample_cut.c) draws from the written product without cuts. Returns 0 or -1. */
int q8_matmul_draw(const float *x, int rows, int k, const int8_t *qs, const void *s, int fp16,
                   int halves, int narrow, int n, int valid, const float *temps,
                   const int64_t *keys, const uint8_t *greedy, int64_t *tokens, int threads) {
    size_t slots = (size_t)threads * rows;
    int64_t *best = malloc(sizeof(int64_t) * slots);
    float *best_value = malloc(sizeof(float) * slots);
    int status = -1;
    if (best && best_value) {
        for (size_t i = 0; i < slots; i++) {
            best[i] = -1;
            best_value[i] = -INFINITY;
        }
        tile_sink sink = {NULL, best, best_value, valid, temps, keys, greedy};
        status = q8_tiles(x, rows, k, qs, s, fp16, halves, narrow, n, &sink, threads);
        for (int r = 0; status == 0 && r < rows; r++) {
            int64_t token = -1;
            float top = -INFINITY;
            for (int t = 0; t < threads; t++) {
                size_t i = (size_t)t * rows + r;
                if (best[i] >= 0 && better(best_value[i], best[i], top, token)) {
                    top = best_value[i];
                    token = best[i];
                }
            }
            tokens[r] = token < 0 ? 0 : token; /* no column above -inf (NaNs are skipped) */
        }
    }
    free(best);
    free(best_value);
    return status;
}

int q8_matmul_argmax(const float *x, int rows, int k, const int8_t *qs, const void *s,
                     int fp16, int halves, int narrow, int n, int valid, int64_t *tokens,
                     int threads) {
    return q8_matmul_draw(x, rows, k, qs, s, fp16, halves, narrow, n, valid, NULL, NULL, NULL,
                          tokens, threads);
}

/* Row `row` of an 8-bit weight's codes as fp32 [k] into w (w = q s). */
static void dequantize_row(const int8_t *qs, const void *s, int fp16, int halves, int k,
                           int64_t row, float *w) {
    int nb = k / GROUP, l = (int)(row % 16);
    int64_t g = row / 16;
    const int8_t *qg = qs + (size_t)g * nb * BLOCK_BYTES + 4 * l;
    size_t at = (size_t)g * nb * halves * 16 + l; /* the row's scales: every 16th */
    for (int b = 0; b < nb; b++) {
        const int8_t *qb = qg + (size_t)b * BLOCK_BYTES;
        for (int j = 0; j < GROUP; j++)
            w[b * GROUP + j] = (float)qb[(j / 4) * STEP_BYTES + j % 4]
                               * param_at(s, fp16, at + (b * halves + j * halves / GROUP) * 16);
    }
}

/* Output rows [o0, o0 + count) of an 8-bit weight as fp32, dst [count, k]. */
void q8_dequantize(const int8_t *qs, const void *s, int fp16, int halves, int k, int o0,
                   int count, float *dst, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int o = 0; o < count; o++)
        dequantize_row(qs, s, fp16, halves, k, o0 + o, dst + (size_t)o * k);
}

/* Rows `ids` [count] as fp32 [count][k]: an embedding table of `rows` rows kept as its codes.
 * A step looks up a few rows, so one thread (torch's gather of the interleaved codes cost
 * ~0.1 ms a call). Returns 0, or -1 (nothing written) if an id is not a row. */
int q8_lookup(const int8_t *qs, const void *s, int fp16, int halves, int k, int64_t rows,
              const int64_t *ids, int count, float *dst) {
    for (int o = 0; o < count; o++)
        if (ids[o] < 0 || ids[o] >= rows)
            return -1;
    for (int o = 0; o < count; o++)
        dequantize_row(qs, s, fp16, halves, k, ids[o], dst + (size_t)o * k);
    return 0;
}
