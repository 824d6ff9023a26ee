/* The 4-bit matmul of q4_matmul.c, shared with the decode step of decode_step.c. */
#ifndef FMSERVE_Q4_MATMUL_H
#define FMSERVE_Q4_MATMUL_H
#include <stdint.h>

int q4_matmul(const float *x, int rows, int k, const uint8_t *qs, const float *s,
              const float *m, int n, float *y, int threads);
int q8_matmul(const float *x, int rows, int k, const int8_t *qs, const float *s, int n,
              float *y, int threads);
void q4_dequantize(const uint8_t *qs, const float *s, const float *m, int k, int o0, int count,
                   float *dst, int threads);
void q8_dequantize(const int8_t *qs, const float *s, int k, int o0, int count, float *dst,
                   int threads);

#endif
