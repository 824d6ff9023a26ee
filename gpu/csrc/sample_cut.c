/* The sampler's top-k / top-p / min-p cut and its draw, for a CPU (gpu/sampler.py's rules).
 *
 * torch found a cut with topk and sort over [rows, vocab] and a logsumexp of the whole row: at
 * 32 rows of Gemma 3's 262,144 tokens, top_p cost a decode step ~30% of its time. Here a row's
 * cut and draw need only the tokens near its best: a vectorised pass gathers those within `gap`
 * of the row's largest scaled logit (widened until they decide the cut; for the draw alone,
 * as far as any noise reaches), and only they are scaled, binned and, in the cut's bin, sorted.
 *
 * The rules are the sampler's: a row keeps the tokens whose scaled logit (logit / T) is >= a
 * threshold: top-k's k-th largest value; then top-p over those k (over the whole row without
 * top-k), the value at which the mass before a token first reaches p; then min-p, the row's
 * largest plus log(min_p), whichever is highest. Ties at a cut are kept. The draw is
 * argmax(logit / T + noise) over the kept tokens, with gumbel.h's noise, so a row draws the
 * same token as the torch path's (up to the rounding of a mass that falls within ~1e-7 of p). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gumbel.h"
#include "vector_math.h"

typedef struct {
    float score; /* logit / T */
    int id;
} candidate;

/* A row's candidates by how far below its best they lie, 1/BUCKETS of the gap a bucket: a cut
 * is found by counts or masses per bucket, and only the bucket it falls in is sorted. */
#define BUCKETS 1024

typedef struct {
    int count[BUCKETS];
    double mass[BUCKETS]; /* sum of e^(score - best) */
} histogram;

/* Larger score first; equal scores by token id, so the order does not depend on qsort. */
static int by_score(const void *a, const void *b) {
    const candidate *x = a, *y = b;
    if (x->score != y->score)
        return x->score < y->score ? 1 : -1;
    return (x->id > y->id) - (x->id < y->id);
}

/* The sum of e^((l[j] - top) / t), j < n, in double over blocks of float lanes. */
static double exp_sum(const float *l, int n, float top, float t) {
    double total = 0.0;
    int j = 0;
#ifdef __AVX2__
    __m256 shift = _mm256_set1_ps(top), inverse = _mm256_set1_ps(1.0f / t);
    while (j + 8 <= n) {
        __m256 acc = _mm256_setzero_ps();
        for (int end = j + 1024 < n ? j + 1024 : n; j + 8 <= end; j += 8)
            acc = _mm256_add_ps(acc, exp8(_mm256_mul_ps(
                                         _mm256_sub_ps(_mm256_loadu_ps(l + j), shift), inverse)));
        total += hsum(acc);
    }
#endif
    for (; j < n; j++)
        total += expf((l[j] - top) / t);
    return total;
}

/* The ids of the logits >= floor, in order (out: room for n); their count. */
static int gather_ids(const float *l, int n, float floor, int *out) {
    int count = 0, j = 0;
#ifdef __AVX512F__
    __m512 f = _mm512_set1_ps(floor);
    __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; j + 16 <= n; j += 16, ids = _mm512_add_epi32(ids, _mm512_set1_epi32(16))) {
        __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(l + j), f, _CMP_GE_OQ);
        if (m) {
            _mm512_mask_compressstoreu_epi32(out + count, m, ids);
            count += __builtin_popcount(m);
        }
    }
#elif defined(__AVX2__)
    __m256 f = _mm256_set1_ps(floor);
    for (; j + 8 <= n; j += 8)
        for (int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(l + j), f, _CMP_GE_OQ));
             m; m &= m - 1)
            out[count++] = j + __builtin_ctz(m);
#endif
    for (; j < n; j++)
        if (l[j] >= floor)
            out[count++] = j;
    return count;
}

static inline int bucket_of(float score, float best, float per_unit) {
    float d = (best - score) * per_unit;
    return d < (float)(BUCKETS - 1) ? (int)d : BUCKETS - 1;
}

/* The tokens of logits l whose score l / t is about >= best - gap, widening gap until they
 * decide the cut: at least k of them for top-k (k > 0), else mass >= top_p * z (top-p over the
 * row); their histogram in h (bucket width gap / BUCKETS, *per_unit its inverse). Unsorted,
 * in token order; ids is scratch of n. */
static int collect(const float *l, int n, float t, float best, int k, float top_p, double z,
                   candidate *out, int *ids, histogram *h, float *per_unit) {
    for (float gap = 8.0f;; gap *= 2.0f) {
        float floor = gap > 256.0f ? -INFINITY : (best - gap) * t; /* then: every token */
        *per_unit = (float)BUCKETS / (gap > 256.0f ? 512.0f : gap);
        memset(h, 0, sizeof *h);
        int count = gather_ids(l, n, floor, ids);
        double mass = 0.0;
        for (int i = 0; i < count; i++) {
            float score = l[ids[i]] / t; /* a division, as torch's: the same scores */
            int b = bucket_of(score, best, *per_unit);
            double e = expf(score - best);
            out[i] = (candidate){score, ids[i]};
            h->count[b]++;
            h->mass[b] += e;
            mass += e;
        }
        if (floor == -INFINITY || (k > 0 ? count >= k : mass >= (double)top_p * z))
            return count;
    }
}

/* Reorders c so the candidates of buckets before b come first, then bucket b's, sorted; returns
 * where bucket b starts and sets *end to where it stops. */
static int split_at_bucket(candidate *c, int count, int b, float best, float per_unit,
                           int *end) {
    int lo = 0, mid = 0, hi = count; /* [0, lo) < b, [lo, mid) == b, [hi, count) > b */
    while (mid < hi) {
        int at = bucket_of(c[mid].score, best, per_unit);
        candidate t = c[mid];
        if (at < b) {
            c[mid++] = c[lo];
            c[lo++] = t;
        } else if (at == b) {
            mid++;
        } else {
            c[mid] = c[--hi];
            c[hi] = t;
        }
    }
    qsort(c + lo, mid - lo, sizeof *c, by_score);
    *end = mid;
    return lo;
}

/* The k-th largest score among the candidates; its bucket's members sorted after the larger
 * ones, and *kept set to how many candidates come before or at it (ties after it included). */
static float kth_score(candidate *c, int count, int k, const histogram *h, float best,
                       float per_unit, int *kept) {
    int b = 0, above = 0;
    while (b < BUCKETS - 1 && above + h->count[b] < k)
        above += h->count[b++];
    int end, lo = split_at_bucket(c, count, b, best, per_unit, &end);
    int at = lo + (k - above) - 1; /* inside the bucket: its count reaches k */
    at = at < end ? at : end - 1;
    float kth = c[at].score;
    while (at + 1 < end && c[at + 1].score == kth) /* equal scores share a bucket */
        at++;
    *kept = at + 1;
    return kth;
}

/* Top-p over the row (no top-k): the score of the token at which the mass before it, in sorted
 * order, first reaches top_p * z (the last token kept). */
static float top_p_score(candidate *c, int count, double target, const histogram *h,
                         float best, float per_unit) {
    int b = 0;
    double above = 0.0;
    while (b < BUCKETS - 1 && above + h->mass[b] < target)
        above += h->mass[b++];
    int end, lo = split_at_bucket(c, count, b, best, per_unit, &end);
    if (lo == end) /* rounding left the bucket empty: the last token above it */
        return lo > 0 ? c[lo - 1].score : best;
    int at = lo;
    for (double before = above + expf(c[lo].score - best); at + 1 < end && before < target;)
        before += expf(c[++at].score - best);
    return c[at].score;
}

/* How far below a row's best scaled logit a token can still win the draw: the best token's
 * noise is at least -log(-log 2^-24) = -2.81, any token's at most GUMBEL_MAX. */
#define DRAW_REACH (GUMBEL_MAX + 2.82f + 0.5f)

/* One sampled row's token; pool and ids are scratch of n each. */
static int64_t draw_row(const float *logits, int n, float t, int k, float top_p,
                        float log_min_p, uint32_t key, candidate *pool, int *ids,
                        histogram *h) {
    float top_logit = max_of(logits, n);
    if (!(top_logit > -INFINITY)) /* every logit NaN or -inf: nothing to draw from */
        return 0;
    float best = top_logit / t, threshold = -INFINITY, per_unit;
    int count; /* candidates in pool: the kept tokens, and every one that can win, among them */
    if (k > 0 || top_p < INFINITY) {
        double z = k > 0 ? 0.0 : exp_sum(logits, n, top_logit, t);
        count = collect(logits, n, t, best, k, top_p, z, pool, ids, h, &per_unit);
        if (k > 0) {
            int kept;
            threshold = kth_score(pool, count, k < count ? k : count, h, best, per_unit, &kept);
            count = kept;
            if (top_p < INFINITY) { /* over the top k (HF): sorted, its own normaliser */
                qsort(pool, count, sizeof *pool, by_score);
                for (int i = 0; i < k && i < count; i++)
                    z += expf(pool[i].score - best);
                double before = 0.0;
                int within = 0;
                while (within < k && within < count && before < (double)top_p * z)
                    before += expf(pool[within++].score - best);
                threshold = pool[within - 1].score;
            }
        } else {
            threshold = top_p_score(pool, count, (double)top_p * z, h, best, per_unit);
        }
    } else { /* min-p alone, or no cut: the kept tokens the noise can lift to the top */
        float floor = best - DRAW_REACH;
        if (log_min_p > -DRAW_REACH) /* min-p's own floor (exactly: the threshold, below) */
            floor = best + log_min_p - 0.5f;
        count = gather_ids(logits, n, floor * t, ids);
        for (int i = 0; i < count; i++)
            pool[i] = (candidate){logits[ids[i]] / t, ids[i]};
    }
    if (log_min_p > -INFINITY && best + log_min_p > threshold)
        threshold = best + log_min_p;
    float top = -INFINITY;
    int64_t at = 0;
    for (int i = 0; i < count; i++)
        if (pool[i].score >= threshold && pool[i].score + GUMBEL_MAX > top) {
            if (pool[i].score < top && noise_cannot_reach(uniform_of(key, pool[i].id),
                                                          top - pool[i].score))
                continue; /* its uniform alone says it cannot win: no logs */
            float score = pool[i].score + gumbel_of(key, pool[i].id);
            if (score > top || (score == top && pool[i].id < at)) {
                top = score;
                at = pool[i].id;
            }
        }
    return at;
}

/* tokens[r]: row r's draw under its cut (top_k[r] <= 0: none; top_p[r] = inf: none; log_min_p
 * [r] = -inf: none), or the logits' argmax where greedy[r] (the first of equal largest, NaNs
 * passed over). Returns 0, or -1 if out of memory. */
int cut_draw(const float *logits, int rows, int n, const float *temps, const int32_t *top_k,
             const float *top_p, const float *log_min_p, const int64_t *keys,
             const uint8_t *greedy, int64_t *tokens, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int *ids = malloc(sizeof(int) * (size_t)n);
        candidate *pool = malloc(sizeof(candidate) * (size_t)n);
        histogram *h = malloc(sizeof(histogram));
        if (!ids || !pool || !h)
            failed = 1;
#pragma omp for schedule(dynamic)
        for (int r = 0; r < rows; r++) {
            const float *row = logits + (size_t)r * n;
            if (greedy[r]) {
                float top = -INFINITY;
                int64_t at = 0;
                for (int j = 0; j < n; j++)
                    if (row[j] > top) {
                        top = row[j];
                        at = j;
                    }
                tokens[r] = at;
            } else if (ids && pool && h) {
                tokens[r] = draw_row(row, n, temps[r], top_k[r], top_p[r], log_min_p[r],
                                     (uint32_t)keys[r], pool, ids, h);
            }
        }
        free(ids);
        free(pool);
        free(h);
    }
    return failed ? -1 : 0;
}
