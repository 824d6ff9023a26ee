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
#include "step_ops.h"

/* 1 where this build reads and writes an fp16 KV cache (F16C), else 0. */
int kv_half_supported(void) {
#ifdef __F16C__
    return 1;
#else
    return 0;
#endif
}

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

static int matmul(const q4_weight *w, const float *x, int rows, float *y, int threads) {
    return q4_matmul(x, rows, w->in, w->nibbles, w->scale, w->minimum, w->out, y, threads);
}

static int layer_step(const decoder *m, const decoder_layer *l, float *h, int rows,
                      const float *cos, const float *sin, const int32_t *key_locs, int max_len,
                      const int64_t *seq_lens, const int64_t *out_loc, scratch *s,
                      int threads) {
    int n = m->hidden, width = l->qkv.out;
    attention_shape shape = {m->heads, m->kv_heads, m->head_dim, m->kv_half, m->attn_scale};
    rms_norm(h, l->input_norm, m->eps, rows, n, s->x);
    if (matmul(&l->qkv, s->x, rows, s->qkv, threads))
        return -1;
    rope(s->qkv, rows, width, m->heads + m->kv_heads, m->head_dim, cos, sin);
    write_kv(&shape, l->k_cache, l->v_cache, s->qkv, width, rows, out_loc);
    attend(&shape, l->k_cache, l->v_cache, s->qkv, width, rows, key_locs, max_len, seq_lens,
           s->attn, s->scores, threads);
    if (matmul(&l->o, s->attn, rows, s->proj, threads))
        return -1;
    for (size_t i = 0; i < (size_t)rows * n; i++)
        h[i] += s->proj[i];
    rms_norm(h, l->post_norm, m->eps, rows, n, s->x);
    if (matmul(&l->gate_up, s->x, rows, s->gate_up, threads))
        return -1;
    swiglu(s->gate_up, s->act, rows, m->intermediate, threads);
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

/* The step's attention alone (attend, step_ops.h) over caches in the decoder's layout, for
 * tests against torch's: out [rows, heads * head_dim]. Returns 0, or -1 if out of memory. */
int decode_attention(int heads, int kv_heads, int head_dim, int kv_half, float scale,
                     const void *k_cache, const void *v_cache, const float *qkv, int width,
                     int rows, const int32_t *key_locs, int max_len, const int64_t *seq_lens,
                     float *out, int threads) {
    attention_shape shape = {heads, kv_heads, head_dim, kv_half, scale};
    float *scores = malloc(sizeof(float) * (size_t)rows * heads * (max_len > 0 ? max_len : 1));
    if (!scores)
        return -1;
    attend(&shape, k_cache, v_cache, qkv, width, rows, key_locs, max_len, seq_lens, out, scores,
           threads);
    free(scores);
    return 0;
}
