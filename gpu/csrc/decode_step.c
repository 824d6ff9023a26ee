/* A Llama decoder's decode step for a few rows, every op in C (gpu/cpu_decode_step.py).
 *
 * At one stream on a 2-core CPU the compiled torch step spends ~7 ms of its ~25 ms in Python:
 * the ~420 calls of inductor's wrapper (120 projections through the dispatcher, the attention's
 * bmm, the fused pointwise loops). Here the whole decoder is one call, as in llama.cpp: per
 * layer RMSNorm, the fused q/k/v projection on the 4-bit codes (q4_matmul.c), rotate-half RoPE,
 * the new key and value written to the KV pool, attention over each request's keys, o_proj,
 * the residual, RMSNorm, the fused gate/up projection, SiLU(gate) * up, down_proj, the residual;
 * then the final RMSNorm. fp32 throughout, as the torch step of an fp32 model computes it;
 * the KV cache fp32 or, as llama.cpp keeps it, fp16 (half the bytes; F16C converts). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "q4_matmul.h"
#ifdef __F16C__
#include <immintrin.h>
#endif

typedef struct {
    const uint8_t *nibbles;  /* the kernel's form (q4_matmul.c) */
    const float *scale, *minimum;
    int out, in;
} q4_weight;

typedef struct {
    const float *input_norm, *post_norm;
    q4_weight qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [locations, kv_heads, head_dim], fp32 or fp16 (kv_half) */
} decoder_layer;

typedef struct {
    int layers, hidden, heads, kv_heads, head_dim, intermediate, kv_half;
    float eps, attn_scale;
    const float *final_norm;
    const decoder_layer *layer;
} decoder;

/* Scratch for one step: every buffer a row-major [rows, width] matrix. */
typedef struct {
    float *x, *qkv, *attn, *proj, *gate_up, *act, *scores;
} scratch;

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

/* 1 where this build reads and writes an fp16 KV cache (F16C), else 0. */
int kv_half_supported(void) {
#ifdef __F16C__
    return 1;
#else
    return 0;
#endif
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
static const float *kv_row(const decoder *m, const void *cache, int32_t loc, int g, float *buf) {
    size_t at = ((size_t)loc * m->kv_heads + g) * m->head_dim;
    if (!m->kv_half)
        return (const float *)cache + at;
    from_half((const uint16_t *)cache + at, buf, m->head_dim);
    return buf;
}

#if defined(__AVX2__) && defined(__F16C__)
/* Eight values of row `loc`'s kv head g from dimension i, as fp32. */
static inline __m256 kv8(const decoder *m, const void *cache, int32_t loc, int g, int i) {
    size_t at = ((size_t)loc * m->kv_heads + g) * m->head_dim + i;
    return m->kv_half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache
                                                                            + at)))
                      : _mm256_loadu_ps((const float *)cache + at);
}
#endif

/* p[j] = scale q . key j for the len keys at locs (kv head g). Four keys at a time, each its
 * own accumulator: one key's chain of FMAs alone waits on their latency. */
static void key_scores(const decoder *m, const void *cache, const int32_t *locs, int len,
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
static void weighted_values(const decoder *m, const void *cache, const int32_t *locs, int len,
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
 * max_len], the first seq_lens[r] of them), its kv head shared by heads / kv_heads heads. */
static void attend(const decoder *m, const decoder_layer *l, const float *qkv, int rows,
                   const int32_t *key_locs, int max_len, const int64_t *seq_lens, float *out,
                   float *scores, int threads) {
    int d = m->head_dim, width = l->qkv.out, group = m->heads / m->kv_heads;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int r = 0; r < rows; r++) {
        for (int h = 0; h < m->heads; h++) {
            float buf[d];
            const float *q = qkv + (size_t)r * width + (size_t)h * d;
            const int32_t *locs = key_locs + (size_t)r * max_len;
            float *p = scores + ((size_t)r * m->heads + h) * max_len;
            int len = (int)seq_lens[r], g = h / group;
            key_scores(m, l->k_cache, locs, len, g, q, p, buf);
            float best = -INFINITY;
            for (int j = 0; j < len; j++)
                best = p[j] > best ? p[j] : best;
            float total = exp_shifted(p, len, best);
            for (int j = 0; j < len; j++)
                p[j] /= total;
            weighted_values(m, l->v_cache, locs, len, g, p,
                            out + (size_t)r * m->heads * d + (size_t)h * d, buf);
        }
    }
}

static int matmul(const q4_weight *w, const float *x, int rows, float *y, int threads) {
    return q4_matmul(x, rows, w->in, w->nibbles, w->scale, w->minimum, w->out, y, threads);
}

static int layer_step(const decoder *m, const decoder_layer *l, float *h, int rows,
                      const float *cos, const float *sin, const int32_t *key_locs, int max_len,
                      const int64_t *seq_lens, const int64_t *out_loc, scratch *s,
                      int threads) {
    int n = m->hidden, d = m->head_dim, width = l->qkv.out;
    size_t kv_row = (size_t)m->kv_heads * d;
    rms_norm(h, l->input_norm, m->eps, rows, n, s->x);
    if (matmul(&l->qkv, s->x, rows, s->qkv, threads))
        return -1;
    rope(s->qkv, rows, width, m->heads + m->kv_heads, d, cos, sin);
    for (int r = 0; r < rows; r++) { /* the new key and value, before attention reads them */
        const float *k = s->qkv + (size_t)r * width + (size_t)m->heads * d;
        size_t at = (size_t)out_loc[r] * kv_row;
        if (m->kv_half) {
            to_half(k, (uint16_t *)l->k_cache + at, (int)kv_row);
            to_half(k + kv_row, (uint16_t *)l->v_cache + at, (int)kv_row);
        } else {
            memcpy((float *)l->k_cache + at, k, sizeof(float) * kv_row);
            memcpy((float *)l->v_cache + at, k + kv_row, sizeof(float) * kv_row);
        }
    }
    attend(m, l, s->qkv, rows, key_locs, max_len, seq_lens, s->attn, s->scores, threads);
    if (matmul(&l->o, s->attn, rows, s->proj, threads))
        return -1;
    for (size_t i = 0; i < (size_t)rows * n; i++)
        h[i] += s->proj[i];
    rms_norm(h, l->post_norm, m->eps, rows, n, s->x);
    if (matmul(&l->gate_up, s->x, rows, s->gate_up, threads))
        return -1;
    int inter = m->intermediate, chunk = 256, chunks = (inter + chunk - 1) / chunk;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < chunks; c++) { /* shared among the threads: exp bound */
            const float *gate = s->gate_up + (size_t)r * 2 * inter + (size_t)c * chunk;
            int n = inter - c * chunk < chunk ? inter - c * chunk : chunk;
            silu_mul(gate, gate + inter, s->act + (size_t)r * inter + (size_t)c * chunk, n);
        }
    }
    if (matmul(&l->down, s->act, rows, s->proj, threads))
        return -1;
    for (size_t i = 0; i < (size_t)rows * n; i++)
        h[i] += s->proj[i];
    return 0;
}

/* h [rows, hidden]: the tokens' embeddings in, the residual stream out; out [rows, hidden]:
 * the final normed hidden states. cos, sin [rows, head_dim / 2] at each row's position;
 * key_locs [rows, max_len] each request's KV locations (its new token's included: seq_lens
 * counts it), out_loc [rows] where its new key and value go. Returns 0, or -1 if out of
 * memory. */
int decode_step(const decoder *m, int rows, float *h, const float *cos, const float *sin,
                const int32_t *key_locs, int max_len, const int64_t *seq_lens,
                const int64_t *out_loc, float *out, int threads) {
    size_t qkv = 0, inter = (size_t)m->intermediate;
    for (int i = 0; i < m->layers; i++)
        qkv = (size_t)m->layer[i].qkv.out > qkv ? (size_t)m->layer[i].qkv.out : qkv;
    size_t per_row = (size_t)m->hidden * 2 + qkv + (size_t)m->heads * m->head_dim + 3 * inter +
                     (size_t)m->heads * max_len;
    float *buf = malloc(sizeof(float) * per_row * rows);
    if (!buf)
        return -1;
    scratch s;
    s.x = buf;
    s.proj = s.x + (size_t)rows * m->hidden;
    s.qkv = s.proj + (size_t)rows * m->hidden;
    s.attn = s.qkv + (size_t)rows * qkv;
    s.gate_up = s.attn + (size_t)rows * m->heads * m->head_dim;
    s.act = s.gate_up + (size_t)rows * 2 * inter;
    s.scores = s.act + (size_t)rows * inter;
    int status = 0;
    for (int i = 0; i < m->layers && status == 0; i++)
        status = layer_step(m, &m->layer[i], h, rows, cos, sin, key_locs, max_len, seq_lens,
                            out_loc, &s, threads);
    if (status == 0)
        rms_norm(h, m->final_norm, m->eps, rows, m->hidden, out);
    free(buf);
    return status;
}
