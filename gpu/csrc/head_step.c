/* An EAGLE-3 draft head's layer for a few rows, every op in C (gpu/eagle/head_native.py).
 *
 * At one stream a drafting step runs the head three times (two draft levels and the extend
 * over the accepted path); op by op in torch each forward cost ~1 ms on a 2-core CPU, ~40 ops
 * of a few microseconds each around seven 8-bit projections. Here the layer is one call:
 *     x = [RMSNorm(emb), RMSNorm(hidden)]     (embeddings first, as the head was trained)
 *     h = residual + o_proj(attention(RoPE(qkv_proj(x))))
 *     out = h + down_proj(SiLU(gate) up),  gate/up = gate_up_proj(RMSNorm(h))
 * with residual = hidden, or its norm where the head normalizes before the residual, and
 * returns out (fed back as the next level's hidden) and RMSNorm(out) (what the lm_head reads).
 * Projections on the head's Q8_0 codes (q8_matmul.c), the rest as the target's decode step
 * computes it (step_ops.h). */
#include "step_ops.h"

typedef struct {
    const int8_t *codes; /* the kernel's form (q8_matmul.c) */
    const float *scale; /* fp32: a head's codes are quantized from its float weights */
    int out, in;
} q8_weight;

typedef struct {
    int hidden, heads, kv_heads, head_dim, intermediate, kv_half, norm_before_residual;
    float eps, attn_scale;
    const float *input_norm, *hidden_norm, *post_norm, *final_norm;
    q8_weight qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* the draft pool's one layer */
} head_layer;

static int matmul8(const q8_weight *w, const float *x, int rows, float *y, int threads) {
    return q8_matmul(x, rows, w->in, w->codes, w->scale, 0, 1, 0, w->out, y, threads);
}

/* emb [rows, hidden] the tokens' embeddings; h [rows, hidden] the hidden states in, the
 * layer's output out (in place); normed [rows, hidden] its final norm. cos, sin, key_locs,
 * seq_lens and out_loc as decode_step's. Returns 0, or -1 if out of memory. */
int head_step(const head_layer *m, int rows, const float *emb, float *h, const float *cos,
              const float *sin, const int32_t *key_locs, int max_len, const int64_t *seq_lens,
              const int64_t *out_loc, float *normed, int threads) {
    int n = m->hidden, width = m->qkv.out, inter = m->intermediate;
    if (rows <= 0)
        return 0;
    size_t per_row = (size_t)2 * n + width + (size_t)m->heads * m->head_dim + n +
                     3 * (size_t)inter + (size_t)m->heads * max_len + n;
    float *buf = malloc(sizeof(float) * per_row * rows);
    if (!buf)
        return -1;
    float *x = buf, *qkv = x + (size_t)rows * 2 * n, *attn = qkv + (size_t)rows * width;
    float *proj = attn + (size_t)rows * m->heads * m->head_dim, *gate_up = proj + (size_t)rows * n;
    float *act = gate_up + (size_t)rows * 2 * inter, *scores = act + (size_t)rows * inter;
    float *post = scores + (size_t)rows * m->heads * max_len;
    attention_shape shape = {m->heads, m->kv_heads, m->head_dim, m->kv_half, m->attn_scale, 0};
    int status = -1;
    for (int r = 0; r < rows; r++) {
        float *xr = x + (size_t)r * 2 * n, *hr = h + (size_t)r * n;
        rms_norm(emb + (size_t)r * n, m->input_norm, m->eps, 1, n, xr);
        rms_norm(hr, m->hidden_norm, m->eps, 1, n, xr + n);
        if (m->norm_before_residual)
            memcpy(hr, xr + n, sizeof(float) * n);
    }
    if (matmul8(&m->qkv, x, rows, qkv, threads))
        goto done;
    rope(qkv, rows, width, m->heads + m->kv_heads, m->head_dim, cos, sin);
    write_kv(&shape, m->k_cache, m->v_cache, qkv, width, rows, out_loc);
    attend(&shape, m->k_cache, m->v_cache, qkv, width, rows, key_locs, max_len, seq_lens, attn,
           scores, threads);
    if (matmul8(&m->o, attn, rows, proj, threads))
        goto done;
    for (size_t i = 0; i < (size_t)rows * n; i++)
        h[i] += proj[i];
    rms_norm(h, m->post_norm, m->eps, rows, n, post);
    if (matmul8(&m->gate_up, post, rows, gate_up, threads))
        goto done;
    gated(gate_up, act, rows, inter, 0, threads);
    if (matmul8(&m->down, act, rows, proj, threads))
        goto done;
    for (size_t i = 0; i < (size_t)rows * n; i++)
        h[i] += proj[i];
    rms_norm(h, m->final_norm, m->eps, rows, n, normed);
    status = 0;
done:
    free(buf);
    return status;
}
