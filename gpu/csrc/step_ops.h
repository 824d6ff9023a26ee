/* The ops of a decoder layer's few rows in C, shared by the target's decode step
 * (decode_step.c) and the EAGLE head's (head_step.c): RMSNorm, rotate-half RoPE, the KV write,
 * attention over each row's keys (fp32 or fp16 cache), SwiGLU. Static: each file that
 * includes this gets its own copy, inlined where the compiler sees fit. */
#ifndef FMSERVE_STEP_OPS_H
#define FMSERVE_STEP_OPS_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "q4_matmul.h"
#ifdef __F16C__
#include <immintrin.h>
#endif

/* What attention reads of a decoder: its heads and the cache's form. */
typedef struct {
    int heads, kv_heads, head_dim, kv_half;
    float attn_scale;
} attention_shape;

static void rms_norm(const float *x, const float *w, float eps, int rows, int n, float *y) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * n;
        double squares = 0.0;
        for (int i = 0; i < n; i++)
            squares += (double)xr[i] * xr[i];
        float inv = 1.0f / sqrtf((float)(squares / n) + eps);
        for (int i = 0; i < n; i++)
            y[(size_t)r * n + i] = xr[i] * inv * w[i];
    }
}

/* Rotate-half RoPE of the q and k heads of each row in place; cos, sin [rows, head_dim / 2]. */
static void rope(float *qkv, int rows, int width, int heads, int head_dim, const float *cos,
                 const float *sin) {
    int half = head_dim / 2;
    for (int r = 0; r < rows; r++) {
        const float *c = cos + (size_t)r * half, *s = sin + (size_t)r * half;
        for (int h = 0; h < heads; h++) {
            float *x = qkv + (size_t)r * width + (size_t)h * head_dim;
            for (int i = 0; i < half; i++) {
                float a = x[i], b = x[i + half];
                x[i] = a * c[i] - b * s[i];
                x[i + half] = b * c[i] + a * s[i];
            }
        }
    }
}

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

#ifdef __AVX2__
/* e^x of 8 floats: Cephes' expf polynomial (within 2 ulp of expf), x clamped to [-87.3, 88.3]
 * so that 2^n stays a normal float. Softmax and SiLU called expf ~3 million times a step at
 * 32 rows, about 5 ms on 2 cores. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_floor_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln 2 in two parts */
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    __m256i scale = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(scale));
}
#endif

/* p[j] = e^(p[j] - best) for j < len; returns their sum. */
static float exp_shifted(float *p, int len, float best) {
    float total = 0.f;
    int j = 0;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps(), shift = _mm256_set1_ps(best);
    for (; j + 8 <= len; j += 8) {
        __m256 v = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), shift));
        _mm256_storeu_ps(p + j, v);
        acc = _mm256_add_ps(acc, v);
    }
    total = hsum(acc);
    if (j < len) { /* the tail through the same polynomial */
        float tail[8] = {0};
        memcpy(tail, p + j, sizeof(float) * (len - j));
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), shift)));
        for (int i = 0; i < len - j; i++)
            total += p[j + i] = tail[i];
    }
    return total;
#endif
    for (; j < len; j++)
        total += p[j] = expf(p[j] - best);
    return total;
}

/* act[i] = SiLU(gate[i]) up[i] for n values. */
static void silu_mul(const float *gate, const float *up, float *act, int n) {
    int i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 sig = _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(g, sig), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++)
        act[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* n (a multiple of 8) fp16 values to fp32, and back (round to nearest even, as torch). */
static void from_half(const uint16_t *src, float *dst, int n) {
#ifdef __F16C__
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#else
    (void)src, (void)dst, (void)n;
#endif
}

static void to_half(const float *src, uint16_t *dst, int n) {
#ifdef __F16C__
    for (int i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#else
    (void)src, (void)dst, (void)n;
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

#if defined(__AVX2__) && defined(__F16C__)
/* Eight values of row `loc`'s kv head g from dimension i, as fp32. */
static inline __m256 kv8(const attention_shape *m, const void *cache, int32_t loc, int g, int i) {
    size_t at = ((size_t)loc * m->kv_heads + g) * m->head_dim + i;
    return m->kv_half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache
                                                                            + at)))
                      : _mm256_loadu_ps((const float *)cache + at);
}
#endif

/* p[j] = scale q . key j for the len keys at locs (kv head g). Four keys at a time, each its
 * own accumulator: one key's chain of FMAs alone waits on their latency. */
static void key_scores(const attention_shape *m, const void *cache, const int32_t *locs, int len,
                       int g, const float *q, float *p, float *buf) {
    int d = m->head_dim, j = 0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; j + 4 <= len; j += 4) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                         _mm256_setzero_ps()};
        for (int i = 0; i < d; i += 8) {
            __m256 qv = _mm256_loadu_ps(q + i);
            for (int u = 0; u < 4; u++)
                acc[u] = _mm256_fmadd_ps(qv, kv8(m, cache, locs[j + u], g, i), acc[u]);
        }
        /* the four sums at once: hadd pairs them up, the two halves add */
        __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
        __m128 sums = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        _mm_storeu_ps(p + j, _mm_mul_ps(sums, _mm_set1_ps(m->attn_scale)));
    }
#endif
    for (; j < len; j++)
        p[j] = dot(q, kv_row(m, cache, locs[j], g, buf), d) * m->attn_scale;
}

/* o = sum_j w[j] value j, o held in registers 64 dimensions at a time. */
static void weighted_values(const attention_shape *m, const void *cache, const int32_t *locs, int len,
                            int g, const float *w, float *o, float *buf) {
    int d = m->head_dim;
#if defined(__AVX2__) && defined(__F16C__)
    for (int c = 0; c < d; c += 64) {
        int lanes = (d - c < 64 ? d - c : 64) / 8;
        __m256 acc[8];
        for (int u = 0; u < lanes; u++)
            acc[u] = _mm256_setzero_ps();
        for (int j = 0; j < len; j++) {
            __m256 wv = _mm256_set1_ps(w[j]);
            for (int u = 0; u < lanes; u++)
                acc[u] = _mm256_fmadd_ps(wv, kv8(m, cache, locs[j], g, c + 8 * u), acc[u]);
        }
        for (int u = 0; u < lanes; u++)
            _mm256_storeu_ps(o + c + 8 * u, acc[u]);
    }
#else
    memset(o, 0, sizeof(float) * d);
    for (int j = 0; j < len; j++) {
        const float *v = kv_row(m, cache, locs[j], g, buf);
        for (int i = 0; i < d; i++)
            o[i] += w[j] * v[i];
    }
#endif
}

/* out [rows, heads * head_dim]: each query head over its request's keys (key_locs [rows,
 * max_len], the first seq_lens[r] of them), its kv head shared by heads / kv_heads heads. The
 * queries are the first heads * head_dim values of each row of qkv, `width` values a row. */
static void attend(const attention_shape *m, const void *k_cache, const void *v_cache,
                   const float *qkv, int width, int rows, const int32_t *key_locs, int max_len,
                   const int64_t *seq_lens, float *out, float *scores, int threads) {
    int d = m->head_dim, group = m->heads / m->kv_heads;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int r = 0; r < rows; r++) {
        for (int h = 0; h < m->heads; h++) {
            float buf[d];
            const float *q = qkv + (size_t)r * width + (size_t)h * d;
            const int32_t *locs = key_locs + (size_t)r * max_len;
            float *p = scores + ((size_t)r * m->heads + h) * max_len;
            int len = (int)seq_lens[r], g = h / group;
            key_scores(m, k_cache, locs, len, g, q, p, buf);
            float best = -INFINITY;
            for (int j = 0; j < len; j++)
                best = p[j] > best ? p[j] : best;
            float total = exp_shifted(p, len, best);
            for (int j = 0; j < len; j++)
                p[j] /= total;
            weighted_values(m, v_cache, locs, len, g, p,
                            out + (size_t)r * m->heads * d + (size_t)h * d, buf);
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

/* act [rows, inter] = SiLU(gate) up, from gate_up [rows, 2 inter] (gate first), shared among
 * the threads in chunks: it is bound by exp. */
static void swiglu(const float *gate_up, float *act, int rows, int inter, int threads) {
    int chunk = 256, chunks = (inter + chunk - 1) / chunk;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < chunks; c++) {
            const float *gate = gate_up + (size_t)r * 2 * inter + (size_t)c * chunk;
            int n = inter - c * chunk < chunk ? inter - c * chunk : chunk;
            silu_mul(gate, gate + inter, act + (size_t)r * inter + (size_t)c * chunk, n);
        }
    }
}

#endif
