/* The ops of a decoder layer's few rows in C, shared by the target's decode step
 * (decode_step.c) and the EAGLE head's (head_step.c): RMSNorm, rotate-half RoPE, SwiGLU or
 * GELU-gated, and (attention_ops.h) the KV write and attention over each row's keys. Static:
 * each file that includes this gets its own copy, inlined where the compiler sees fit. */
#ifndef FMSERVE_STEP_OPS_H
#define FMSERVE_STEP_OPS_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_ops.h"
#include "q4_matmul.h"
#include "vector_math.h"
#ifdef __F16C__
#include <immintrin.h>
#endif

static void rms_norm(const float *x, const float *w, float eps, int rows, int n, float *y) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * n;
        double part[8] = {0}; /* eight chains: one serial sum of doubles was ~1 us a row */
        int i = 0;
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++)
                part[j] += (double)xr[i + j] * xr[i + j];
        for (; i < n; i++)
            part[0] += (double)xr[i] * xr[i];
        double squares = 0.0;
        for (int j = 0; j < 8; j++)
            squares += part[j];
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

/* act[i] = GELU(gate[i]) up[i] for n values, GELU's tanh form as torch's
 * gelu(approximate="tanh"): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), with
 * tanh(u) = 1 - 2 / (1 + e^(2u)). */
static void gelu_mul(const float *gate, const float *up, float *act, int n) {
    const float k = 0.7978845608028654f;
    int i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i), one = _mm256_set1_ps(1.f);
        __m256 u = _mm256_mul_ps(_mm256_set1_ps(k), _mm256_fmadd_ps(
            _mm256_mul_ps(_mm256_set1_ps(0.044715f), _mm256_mul_ps(g, g)), g, g));
        __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(
            one, exp8(_mm256_add_ps(u, u)))));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_mul_ps(
            _mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, t)), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) {
        float g = gate[i];
        act[i] = 0.5f * g * (1.f + tanhf(k * (g + 0.044715f * g * g * g))) * up[i];
    }
}

/* act [rows, inter] = SiLU(gate) up, or GELU(gate) up (`gelu`), from gate_up [rows, 2 inter]
 * (gate first), shared among the threads in chunks: it is bound by exp. Under 16,384 values
 * (SmolLM2's up to 10 rows) one thread does it: waking the other cost more (one stream's 30
 * layers 0.096 -> 0.066 ms a step, 2-core AVX2-only EPYC). */
static void gated(const float *gate_up, float *act, int rows, int inter, int gelu, int threads) {
    int chunk = 256, chunks = (inter + chunk - 1) / chunk;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) \
    if ((size_t)rows * inter >= 16384)
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < chunks; c++) {
            const float *gate = gate_up + (size_t)r * 2 * inter + (size_t)c * chunk;
            int n = inter - c * chunk < chunk ? inter - c * chunk : chunk;
            float *out = act + (size_t)r * inter + (size_t)c * chunk;
            if (gelu)
                gelu_mul(gate, gate + inter, out, n);
            else
                silu_mul(gate, gate + inter, out, n);
        }
    }
}

#endif
