/* A Llama decoder's decode step for a few rows, every op in C (gpu/cpu_decode_step.py).
 *
 * At one stream on a 2-core CPU the compiled torch step spends ~7 ms of its ~25 ms in Python:
 * the ~420 calls of inductor's wrapper (120 projections through the dispatcher, the attention's
 * bmm, the fused pointwise loops). Here the whole decoder is one call, as in llama.cpp: per
 * layer RMSNorm, the fused q/k/v projection on the codes (q4_matmul.c, q8_matmul.c), the q
 * and k heads' norms (Gemma 3, Qwen3), rotate-half RoPE (Gemma's local layers with a table of
 * their own), the new key and value written to the KV pool, attention over each request's keys
 * (or the last `window` of them), o_proj, its norm (Gemma), the residual, RMSNorm, the fused
 * gate/up projection, SiLU or GELU (tanh form) of the gate times up, down_proj, its norm
 * (Gemma), the residual; then the final RMSNorm. fp32 throughout, as the torch step of an fp32 model computes it;
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

/* How a projection's codes are kept (gpu/cpu_decode_step.py): 4-bit over the input x, 4-bit
 * over [x, x] (Q5_0 / Q5_1 / Q5_K as two 4-bit digits side by side), 8-bit (Q8_0), or 8-bit
 * with a scale every 16 inputs (Q6_K). */
enum { CODES_Q4 = 0, CODES_Q4_REPEAT = 1, CODES_Q8 = 2, CODES_Q6 = 3 };

typedef struct {
    const void *codes;  /* the kernels' form (q4_matmul.c's nibbles, q8_matmul.c's int8) */
    const void *scale, *minimum; /* fp32, or fp16 where `fp16` */
    int out, in, kind, fp16; /* in: the input's width */
    int narrow; /* 8-bit codes all within +-16 (Q5_0's): q8_matmul's `narrow` */
} q4_weight;

typedef struct {
    const float *input_norm, *post_norm;
    q4_weight qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [locations, kv_heads, head_dim], fp32 or fp16 (kv_half) */
    /* Gemma 3 and Qwen3: each q and k head RMS-normed ([heads + kv_heads, head_dim]; NULL:
     * none); Gemma's norms of the attention's and the MLP's outputs (NULL: none) */
    const float *qk_norm, *attn_out_norm, *mlp_out_norm;
    int window, rope; /* keys within `window` positions (0: all); which cos / sin table */
} decoder_layer;

typedef struct {
    int layers, hidden, heads, kv_heads, head_dim, intermediate, kv_half;
    float eps, attn_scale;
    const float *final_norm;
    const decoder_layer *layer;
    int gelu; /* the gate's activation: 0 SiLU (Llama), 1 GELU, tanh form (Gemma) */
} decoder;

/* Scratch for one step: every buffer a row-major [rows, width] matrix. */
typedef struct {
    float *x, *qkv, *attn, *proj, *gate_up, *act, *scores;
} scratch;

static int matmul(const q4_weight *w, const float *x, int rows, float *y, int threads) {
    if (w->kind == CODES_Q8 || w->kind == CODES_Q6)
        return q8_matmul(x, rows, w->in, w->codes, w->scale, w->fp16,
                         w->kind == CODES_Q6 ? 2 : 1, w->narrow, w->out, y, threads);
    if (w->kind == CODES_Q4)
        return q4_matmul(x, rows, w->in, w->codes, w->scale, w->minimum, w->fp16, w->out, y,
                         threads);
    float *xx = malloc(sizeof(float) * (size_t)rows * 2 * w->in); /* [x, x] */
    if (!xx)
        return -1;
    for (int r = 0; r < rows; r++) {
        memcpy(xx + (size_t)r * 2 * w->in, x + (size_t)r * w->in, sizeof(float) * w->in);
        memcpy(xx + ((size_t)r * 2 + 1) * w->in, x + (size_t)r * w->in, sizeof(float) * w->in);
    }
    int status = q4_matmul(xx, rows, 2 * w->in, w->codes, w->scale, w->minimum, w->fp16, w->out,
                           y, threads);
    free(xx);
    return status;
}

static void add_normed(float *h, float *o, const float *norm, float eps, int rows, int n) {
    if (norm)
        rms_norm(o, norm, eps, rows, n, o);
    for (size_t i = 0; i < (size_t)rows * n; i++)
        h[i] += o[i];
}

static int layer_step(const decoder *m, const decoder_layer *l, float *h, int rows,
                      const float *const *cos, const float *const *sin, const int32_t *key_locs,
                      int max_len, const int64_t *seq_lens, const int64_t *out_loc, scratch *s,
                      int threads) {
    int n = m->hidden, width = l->qkv.out, qk_heads = m->heads + m->kv_heads;
    attention_shape shape = {m->heads, m->kv_heads, m->head_dim, m->kv_half, m->attn_scale,
                             l->window};
    rms_norm(h, l->input_norm, m->eps, rows, n, s->x);
    if (matmul(&l->qkv, s->x, rows, s->qkv, threads))
        return -1;
    if (l->qk_norm)
        for (int r = 0; r < rows; r++)
            for (int hd = 0; hd < qk_heads; hd++) {
                float *x = s->qkv + (size_t)r * width + (size_t)hd * m->head_dim;
                rms_norm(x, l->qk_norm + (size_t)hd * m->head_dim, m->eps, 1, m->head_dim, x);
            }
    rope(s->qkv, rows, width, qk_heads, m->head_dim, cos[l->rope], sin[l->rope]);
    write_kv(&shape, l->k_cache, l->v_cache, s->qkv, width, rows, out_loc);
    attend(&shape, l->k_cache, l->v_cache, s->qkv, width, rows, key_locs, max_len, seq_lens,
           s->attn, s->scores, threads);
    if (matmul(&l->o, s->attn, rows, s->proj, threads))
        return -1;
    add_normed(h, s->proj, l->attn_out_norm, m->eps, rows, n);
    rms_norm(h, l->post_norm, m->eps, rows, n, s->x);
    if (matmul(&l->gate_up, s->x, rows, s->gate_up, threads))
        return -1;
    gated(s->gate_up, s->act, rows, m->intermediate, m->gelu, threads);
    if (matmul(&l->down, s->act, rows, s->proj, threads))
        return -1;
    add_normed(h, s->proj, l->mlp_out_norm, m->eps, rows, n);
    return 0;
}

/* h [rows, hidden]: the tokens' embeddings in, the residual stream out; out [rows, hidden]:
 * the final normed hidden states. cos[t], sin[t] [rows, head_dim / 2]: RoPE table t (a
 * layer's `rope`) at each row's position;
 * key_locs [rows, max_len] each request's KV locations (its new token's included: seq_lens
 * counts it), out_loc [rows] where its new key and value go. Returns 0, or -1 if out of
 * memory. */
int decode_step(const decoder *m, int rows, float *h, const float *const *cos,
                const float *const *sin,
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
    attention_shape shape = {heads, kv_heads, head_dim, kv_half, scale, 0};
    float *scores = malloc(sizeof(float) * (size_t)rows * heads * (max_len > 0 ? max_len : 1));
    if (!scores)
        return -1;
    attend(&shape, k_cache, v_cache, qkv, width, rows, key_locs, max_len, seq_lens, out, scores,
           threads);
    free(scores);
    return 0;
}
