/* Attention of a decoder's few rows over their requests' keys in the KV cache (fp32 or fp16),
 * and the write of their own keys and values into it: the decode step's and the EAGLE head's
 * (step_ops.h includes it). Static, as step_ops.h. */
#ifndef FMSERVE_ATTENTION_OPS_H
#define FMSERVE_ATTENTION_OPS_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"
#ifdef __F16C__
#include <immintrin.h>
#endif

/* What attention reads of a decoder: its heads and the cache's form. */
typedef struct {
    int heads, kv_heads, head_dim, kv_half;
    float attn_scale;
    int window; /* each row sees the keys of its last `window` positions (0: every key) */
} attention_shape;

/* n (a multiple of 8) fp32 values to fp16 (round to nearest even, as torch). */
static void to_half(const float *src, uint16_t *dst, int n) {
#ifdef __F16C__
    for (int i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#else
    (void)src, (void)dst, (void)n;
#endif
}

/* Up to this many query heads of one kv head are done together, each key and value loaded
 * and converted once for all of them; their accumulators stay in registers. */
#define HEADS_AT_ONCE 4

#if defined(__AVX2__) && defined(__F16C__)
/* Eight values of row `loc`'s kv head g from dimension i, as fp32. */
static inline __m256 kv8(const attention_shape *m, const void *cache, int32_t loc, int g, int i) {
    size_t at = ((size_t)loc * m->kv_heads + g) * m->head_dim + i;
    return m->kv_half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache
                                                                            + at)))
                      : _mm256_loadu_ps((const float *)cache + at);
}

/* A token's rows are asked for this many keys ahead, into L2: a request's rows are gathered
 * page by page, and without the hint each waited on memory. The keys' pass over the first kv
 * head fetches each token's whole key row (every kv head), the values' first pass over it its
 * whole value row; the passes over the others find them in cache. Fetching both rows in the
 * keys' pass had put all of a row's memory traffic in one sixth of its arithmetic (SmolLM2's
 * shape, 32 rows, 30 layers, out of cache: both split this way and rows dealt whole, below,
 * 7.7 -> 5.9 ms; Gemma 3's 1.01x; 2-core AVX512-BF16 EPYC; docs/benchmarks.md). */
#define KV_AHEAD 8
/* The whole row of token `loc` (row_bytes: every kv head) of the keys or of the values. */
static inline __attribute__((always_inline)) void prefetch_row(const void *cache, int32_t loc,
                                                               size_t row_bytes) {
    const char *row = (const char *)cache + (size_t)loc * row_bytes;
    for (size_t o = 0; o < row_bytes; o += 64)
        _mm_prefetch(row + o, _MM_HINT_T1);
}

/* Value dimensions held in registers at a time, for HEADS_AT_ONCE heads: AVX-512 has 32
 * vector registers, AVX2 16. */
#ifdef __AVX512F__
#define VALUE_DIMS 32
#else
#define VALUE_DIMS 16
#endif

/* p[t][j] = scale q_t . key j for H heads q_t (q + t d) and the len keys at locs (kv head g)
 * of the cache; p_t at p + t p_stride. Four keys at a time, each head and key its own
 * accumulator. */
static inline __attribute__((always_inline)) void key_scores(
        const attention_shape *m, const void *cache, const int32_t *locs, int len, int g,
        const float *q, int H, float *p, size_t p_stride) {
    int d = m->head_dim, j = 0;
    size_t row_bytes = (size_t)m->kv_heads * d * (m->kv_half ? 2 : 4);
    for (; j + 4 <= len; j += 4) {
        if (g == 0)
            for (int u = j + KV_AHEAD; u < j + KV_AHEAD + 4 && u < len; u++)
                prefetch_row(cache, locs[u], row_bytes);
        __m256 acc[HEADS_AT_ONCE][4];
        for (int t = 0; t < H; t++)
            for (int u = 0; u < 4; u++)
                acc[t][u] = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) {
            __m256 k[4];
            for (int u = 0; u < 4; u++)
                k[u] = kv8(m, cache, locs[j + u], g, i);
            for (int t = 0; t < H; t++) {
                __m256 qv = _mm256_loadu_ps(q + (size_t)t * d + i);
                for (int u = 0; u < 4; u++)
                    acc[t][u] = _mm256_fmadd_ps(qv, k[u], acc[t][u]);
            }
        }
        for (int t = 0; t < H; t++) { /* hadd pairs the four sums up, the two halves add */
            __m256 s4 = _mm256_hadd_ps(_mm256_hadd_ps(acc[t][0], acc[t][1]),
                                       _mm256_hadd_ps(acc[t][2], acc[t][3]));
            __m128 sums = _mm_add_ps(_mm256_castps256_ps128(s4), _mm256_extractf128_ps(s4, 1));
            _mm_storeu_ps(p + t * p_stride + j, _mm_mul_ps(sums, _mm_set1_ps(m->attn_scale)));
        }
    }
    for (; j < len; j++)
        for (int t = 0; t < H; t++) {
            __m256 acc = _mm256_setzero_ps();
            for (int i = 0; i < d; i += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)t * d + i),
                                      kv8(m, cache, locs[j], g, i), acc);
            p[t * p_stride + j] = hsum(acc) * m->attn_scale;
        }
}

/* o_t = sum_j w_t[j] value j over `lanes` x 8 dimensions from c, for H heads (w_t at
 * w + t w_stride, o_t at o + t d). `lanes` a constant at each call: with a count known only
 * at run time the accumulators had lived on the stack, a store and a load around every
 * multiply-add (Gemma 3's 32-row step: attention ~1.6x slower). */
static inline __attribute__((always_inline)) void values_chunk(
        const attention_shape *m, const void *cache, const int32_t *locs, int len, int g,
        const float *w, size_t w_stride, int H, float *o, int c, int lanes) {
    __m256 acc[HEADS_AT_ONCE][VALUE_DIMS / 8];
    for (int t = 0; t < H; t++)
        for (int u = 0; u < lanes; u++)
            acc[t][u] = _mm256_setzero_ps();
    size_t row_bytes = (size_t)m->kv_heads * m->head_dim * (m->kv_half ? 2 : 4);
    for (int j = 0; j < len; j++) {
        if (g == 0 && c == 0 && j + KV_AHEAD < len) /* the first pass over these values */
            prefetch_row(cache, locs[j + KV_AHEAD], row_bytes);
        __m256 v[VALUE_DIMS / 8];
        for (int u = 0; u < lanes; u++)
            v[u] = kv8(m, cache, locs[j], g, c + 8 * u);
        for (int t = 0; t < H; t++) {
            __m256 wv = _mm256_set1_ps(w[t * w_stride + j]);
            for (int u = 0; u < lanes; u++)
                acc[t][u] = _mm256_fmadd_ps(wv, v[u], acc[t][u]);
        }
    }
    for (int t = 0; t < H; t++)
        for (int u = 0; u < lanes; u++)
            _mm256_storeu_ps(o + (size_t)t * m->head_dim + c + 8 * u, acc[t][u]);
}

/* The same over every dimension: VALUE_DIMS at a time held in registers, then 8 at a time. */
static inline __attribute__((always_inline)) void weighted_values(
        const attention_shape *m, const void *cache, const int32_t *locs, int len, int g,
        const float *w, size_t w_stride, int H, float *o) {
    int d = m->head_dim, c = 0;
    for (; c + VALUE_DIMS <= d; c += VALUE_DIMS)
        values_chunk(m, cache, locs, len, g, w, w_stride, H, o, c, VALUE_DIMS / 8);
    for (; c < d; c += 8)
        values_chunk(m, cache, locs, len, g, w, w_stride, H, o, c, 1);
}

/* H query heads of kv head g over one request's keys: softmax(q K^T) V into o (H heads of d
 * values); p the heads' score rows, p_stride apart. */
static inline __attribute__((always_inline)) void attend_heads(
        const attention_shape *m, const void *k_cache, const void *v_cache, const int32_t *locs,
        int len, int g, const float *q, int H, float *p, size_t p_stride, float *o) {
    key_scores(m, k_cache, locs, len, g, q, H, p, p_stride);
    for (int t = 0; t < H; t++) {
        float *pt = p + t * p_stride, best = max_of(pt, len);
        float total = exp_shifted(pt, len, best);
        for (int j = 0; j < len; j++)
            pt[j] /= total;
    }
    weighted_values(m, v_cache, locs, len, g, p, p_stride, H, o);
}
#else
static float dot(const float *a, const float *b, int n) {
    float acc[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++)
            acc[j] += a[i + j] * b[i + j];
    float total = 0.f;
    for (; i < n; i++)
        total += a[i] * b[i];
    for (int j = 0; j < 8; j++)
        total += acc[j];
    return total;
}

/* n (a multiple of 8) fp16 values to fp32. */
static void from_half(const uint16_t *src, float *dst, int n) {
#ifdef __F16C__
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#else
    (void)src; /* never read: without F16C the worker keeps an fp32 cache */
    memset(dst, 0, sizeof(float) * (size_t)n);
#endif
}

/* Row `loc`'s kv head g as fp32: in the cache itself, or converted into buf. */
static const float *kv_row(const attention_shape *m, const void *cache, int32_t loc, int g, float *buf) {
    size_t at = ((size_t)loc * m->kv_heads + g) * m->head_dim;
    if (!m->kv_half)
        return (const float *)cache + at;
    from_half((const uint16_t *)cache + at, buf, m->head_dim);
    return buf;
}

static void attend_heads(const attention_shape *m, const void *k_cache, const void *v_cache,
                         const int32_t *locs, int len, int g, const float *q, int H, float *p,
                         size_t p_stride, float *o) {
    int d = m->head_dim;
    float buf[d];
    for (int t = 0; t < H; t++) {
        float *pt = p + t * p_stride, *ot = o + (size_t)t * d, best = -INFINITY;
        for (int j = 0; j < len; j++) {
            pt[j] = dot(q + (size_t)t * d, kv_row(m, k_cache, locs[j], g, buf), d) * m->attn_scale;
            best = pt[j] > best ? pt[j] : best;
        }
        float total = exp_shifted(pt, len, best);
        memset(ot, 0, sizeof(float) * d);
        for (int j = 0; j < len; j++) {
            const float *v = kv_row(m, v_cache, locs[j], g, buf);
            pt[j] /= total;
            for (int i = 0; i < d; i++)
                ot[i] += pt[j] * v[i];
        }
    }
}
#endif

/* out [rows, heads * head_dim]: each query head over its request's keys (key_locs [rows,
 * max_len], the first seq_lens[r] of them), its kv head shared by heads / kv_heads heads,
 * which are done together. The queries are the first heads * head_dim values of each row of
 * qkv, `width` values a row; scores [rows, heads, max_len] is scratch. */
static void attend(const attention_shape *m, const void *k_cache, const void *v_cache,
                   const float *qkv, int width, int rows, const int32_t *key_locs, int max_len,
                   const int64_t *seq_lens, float *out, float *scores, int threads) {
    int d = m->head_dim, group = m->heads / m->kv_heads;
    /* A thread takes a row's kv heads together where there are rows enough to share: each
     * thread then streams a row of its own from memory (split by kv head, both threads had
     * waited on the same row's fetches); a few rows are split by kv head to share the work. */
    int split = rows < 2 * threads ? m->kv_heads : 1, items = rows * split;
    /* dynamic: a prefill piece's rows see more keys the later they come */
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (int item = 0; item < items; item++) {
        int r = item / split, g0 = split > 1 ? item % split : 0;
        for (int g = g0; g < (split > 1 ? g0 + 1 : m->kv_heads); g++) {
            int len = (int)seq_lens[r], first = 0;
            if (m->window > 0 && len > m->window) /* a sliding window: its last keys */
                first = len - m->window;
            const int32_t *locs = key_locs + (size_t)r * max_len + first;
            len -= first;
            for (int h = g * group; h < (g + 1) * group; h += HEADS_AT_ONCE) {
                int H = (g + 1) * group - h < HEADS_AT_ONCE ? (g + 1) * group - h : HEADS_AT_ONCE;
                const float *q = qkv + (size_t)r * width + (size_t)h * d;
                float *p = scores + ((size_t)r * m->heads + h) * max_len;
                float *o = out + (size_t)r * m->heads * d + (size_t)h * d;
                switch (H) { /* each a constant: the accumulators stay in registers */
                case 1: attend_heads(m, k_cache, v_cache, locs, len, g, q, 1, p, max_len, o); break;
                case 2: attend_heads(m, k_cache, v_cache, locs, len, g, q, 2, p, max_len, o); break;
                case 3: attend_heads(m, k_cache, v_cache, locs, len, g, q, 3, p, max_len, o); break;
                default: attend_heads(m, k_cache, v_cache, locs, len, g, q, 4, p, max_len, o);
                }
            }
        }
    }
}

/* Each row's new key and value (after its heads' queries in qkv, `width` values a row) to
 * the cache at out_loc[r], before attention reads them. */
static void write_kv(const attention_shape *m, void *k_cache, void *v_cache, const float *qkv,
                     int width, int rows, const int64_t *out_loc) {
    size_t kv_row = (size_t)m->kv_heads * m->head_dim;
    for (int r = 0; r < rows; r++) {
        const float *k = qkv + (size_t)r * width + (size_t)m->heads * m->head_dim;
        size_t at = (size_t)out_loc[r] * kv_row;
        if (m->kv_half) {
            to_half(k, (uint16_t *)k_cache + at, (int)kv_row);
            to_half(k + kv_row, (uint16_t *)v_cache + at, (int)kv_row);
        } else {
            memcpy((float *)k_cache + at, k, sizeof(float) * kv_row);
            memcpy((float *)v_cache + at, k + kv_row, sizeof(float) * kv_row);
        }
    }
}

#endif
