/* A fairseq transformer decoder layer's incremental step (and an encoder layer over one sentence), the whole
 * layer in one call: at batch 1 a step of torch operations spends more time dispatching its ~30
 * small operations a layer than computing them with int8 weights, and a third of it with float32 weights.
 * Post-norm or pre-norm, relu or gelu; the matrices are products.c's, the rest float32. */

#include <math.h>
#include <stddef.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels.h"

/* x (M, in) -> y (M, out); q and scales: room for M rows of width bytes / M floats. */
void fp_matrix_product(const fp_matrix *A, const float *x, int64_t M, float *y, int8_t *q, float *scales) {
    if (A->weights) {
        fp_float_gemm(x, M, A->weights, A->out, A->in, A->bias, y);
        return;
    }
    fp_quantize_rows(x, M, A->in, A->width, q, scales);
#if defined(FP_VNNI)
    if (A->packed) {
        fp_int8_gemm_packed(q, scales, M, A->packed, A->packed_scales, A->corrections, A->out, A->width,
                            A->packed_bias, y);
        return;
    }
#endif
    fp_int8_gemm(q, scales, M, A->values, A->scales, A->out, A->width, A->bias, y);
}

/* The sum of n floats, in eight lanes where AVX2 is (then the lanes added in order). */
static inline float sum_of(const float *x, int64_t n) {
    int64_t d = 0;
    float s = 0.0f;
#if defined(__AVX2__)
    if (n >= 8) {
        __m256 acc = _mm256_loadu_ps(x);
        for (d = 8; d + 8 <= n; d += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + d));
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        for (int i = 0; i < 8; ++i) s += lanes[i];
    }
#endif
    for (; d < n; ++d) s += x[d];
    return s;
}

void fp_layer_norm(float *x, int64_t M, int64_t D, const float *w, const float *b, float eps) {
    for (int64_t m = 0; m < M; ++m) {
        float *row = x + m * D;
        const float mean = sum_of(row, D) / (float)D;
        float var = 0.0f;
        int64_t d = 0;
#if defined(__AVX2__)
        if (D >= 8) {
            const __m256 means = _mm256_set1_ps(mean);
            __m256 acc = _mm256_setzero_ps();
            for (; d + 8 <= D; d += 8) {
                const __m256 centred = _mm256_sub_ps(_mm256_loadu_ps(row + d), means);
                acc = _mm256_add_ps(acc, _mm256_mul_ps(centred, centred));
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, acc);
            for (int i = 0; i < 8; ++i) var += lanes[i];
        }
#endif
        for (; d < D; ++d) var += (row[d] - mean) * (row[d] - mean);
        float inv = 1.0f / sqrtf(var / (float)D + eps);
        for (d = 0; d < D; ++d) row[d] = (row[d] - mean) * inv * w[d] + b[d];
    }
}

/* q . k over n floats: eight lanes at a time where n allows (the order of the sum is this function's: the tests
 * compare with fairseq to float rounding, and every caller of a layer shares it). */
static inline float dot(const float *q, const float *k, int64_t n) {
    int64_t d = 0;
    float s = 0.0f;
#if defined(__AVX2__)
    if (n >= 8) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
        for (d = 8; d + 8 <= n; d += 8)
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d)));
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        s = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
    }
#endif
    for (; d < n; ++d) s += q[d] * k[d];
    return s;
}

#if defined(__AVX2__)
/* q . k0 .. q . k3 over n floats, n a multiple of 8 (each as dot's order: lanes, then their pairwise sums). */
static inline void dot4(const float *q, const float *k0, const float *k1, const float *k2, const float *k3,
                        int64_t n, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < n; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(qv, _mm256_loadu_ps(k0 + d)));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(qv, _mm256_loadu_ps(k1 + d)));
        a2 = _mm256_add_ps(a2, _mm256_mul_ps(qv, _mm256_loadu_ps(k2 + d)));
        a3 = _mm256_add_ps(a3, _mm256_mul_ps(qv, _mm256_loadu_ps(k3 + d)));
    }
    /* (hadd pairs neighbouring lanes: the four sums at once) */
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#endif

/* softmax(q . keys[j] * scaling over j < length, masked) . values -> out (head_dim); keys/values rows of
 * head_dim floats, stride apart, each moved by shift[j] floats where shift is not NULL (a beam hypothesis's
 * positions held in other cache rows); scores: room for length floats. */
static void attend(const float *q, const float *keys, const float *values, int64_t length, int64_t stride,
                   int64_t head_dim, float scaling, const uint8_t *mask, float *scores, float *out,
                   const int64_t *shift) {
#define AT(j) ((j) * stride + (shift ? shift[j] : 0))
    float best = -INFINITY;
    int64_t j = 0;
#if defined(__AVX2__)
    if (head_dim % 8 == 0)
        for (; j + 4 <= length; j += 4)
            if (!mask || mask[j] || mask[j + 1] || mask[j + 2] || mask[j + 3]) /* (a batch's padding: skipped) */
                dot4(q, keys + AT(j), keys + AT(j + 1), keys + AT(j + 2), keys + AT(j + 3), head_dim, scores + j);
#endif
    for (; j < length; ++j)
        if (!mask || mask[j]) scores[j] = dot(q, keys + AT(j), head_dim);
    for (j = 0; j < length; ++j) {
        if (mask && !mask[j]) { scores[j] = -INFINITY; continue; }
        scores[j] = scores[j] * scaling;
        best = scores[j] > best ? scores[j] : best;
    }
    float total = 0.0f;
    for (j = 0; j < length; ++j) {
        scores[j] = scores[j] == -INFINITY ? 0.0f : expf(scores[j] - best);
        total += scores[j];
    }
    int64_t d = 0;
#if defined(__AVX2__)
    /* out[d] = sum over j of p_j v_j[d], in j's order as the scalar loop: 32 of d at a time in registers */
    for (; d + 32 <= head_dim; d += 32) {
        __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
        for (j = 0; j < length; ++j) {
            if (scores[j] == 0.0f) continue; /* (masked, or its weight underflowed: adds nothing) */
            const __m256 p = _mm256_set1_ps(scores[j] / total);
            const float *v = values + AT(j) + d;
            o0 = _mm256_add_ps(o0, _mm256_mul_ps(p, _mm256_loadu_ps(v)));
            o1 = _mm256_add_ps(o1, _mm256_mul_ps(p, _mm256_loadu_ps(v + 8)));
            o2 = _mm256_add_ps(o2, _mm256_mul_ps(p, _mm256_loadu_ps(v + 16)));
            o3 = _mm256_add_ps(o3, _mm256_mul_ps(p, _mm256_loadu_ps(v + 24)));
        }
        _mm256_storeu_ps(out + d, o0);
        _mm256_storeu_ps(out + d + 8, o1);
        _mm256_storeu_ps(out + d + 16, o2);
        _mm256_storeu_ps(out + d + 24, o3);
    }
#endif
    for (int64_t e = d; e < head_dim; ++e) out[e] = 0.0f;
    if (d < head_dim)
        for (j = 0; j < length; ++j) {
            if (scores[j] == 0.0f) continue;
            const float p = scores[j] / total;
            const float *v = values + AT(j);
            for (int64_t e = d; e < head_dim; ++e) out[e] += p * v[e];
        }
#undef AT
}

/* A residual sublayer's entry: x is kept as the residual, then normalised first when the layer is pre-norm. */
static void sublayer_enter(const fp_layer *L, float *x, int64_t M, int64_t D, float *residual, const float *norm_weight,
                           const float *norm_bias, float norm_eps) {
    for (int64_t i = 0; i < M * D; ++i) residual[i] = x[i];
    if (L->normalize_before) fp_layer_norm(x, M, D, norm_weight, norm_bias, norm_eps);
}

/* Its exit: the residual added back to the sublayer's output x, then normalised after when post-norm. */
static void sublayer_leave(const fp_layer *L, float *x, int64_t M, int64_t D, const float *residual,
                           const float *norm_weight, const float *norm_bias, float norm_eps) {
    for (int64_t i = 0; i < M * D; ++i) x[i] = residual[i] + x[i];
    if (!L->normalize_before) fp_layer_norm(x, M, D, norm_weight, norm_bias, norm_eps);
}

/* A layer's feed-forward sublayer on x (M, D) in place, with its residual and layer norm (residual: M * D
 * floats, hidden: M * ffn floats of scratch). */
static void feed_forward(const fp_layer *L, float *x, int64_t M, float *residual, float *hidden, int8_t *qbuf,
                         float *sbuf) {
    const int64_t D = L->heads * L->head_dim, F = L->fc1.out;
    sublayer_enter(L, x, M, D, residual, L->final_norm_weight, L->final_norm_bias, L->final_norm_eps);
    fp_matrix_product(&L->fc1, x, M, hidden, qbuf, sbuf);
    for (int64_t i = 0; i < M * F; ++i) {
        const float h = hidden[i];
        hidden[i] = L->gelu ? 0.5f * h * (1.0f + erff(h * 0.70710678118654752f)) : (h > 0.0f ? h : 0.0f);
    }
    fp_matrix_product(&L->fc2, hidden, M, x, qbuf, sbuf);
    sublayer_leave(L, x, M, D, residual, L->final_norm_weight, L->final_norm_bias, L->final_norm_eps);
}

/* Arithmetic as fairseq's TransformerDecoderLayer in eval mode; the matrices int8 or float32 (each its own).
 * x (M, D) in place. The rows are M / group hypotheses, each feeding `group` new consecutive positions
 * t .. t + group - 1 (row m: hypothesis m / group, position t + m % group). group 1: one position a hypothesis
 * (a beam's step); one hypothesis with group M: a block of one sentence (blockwise decoding's verification);
 * group 2 of several hypotheses: a double-token step's pairs. `causal`: position t + i attends to the prefix and
 * the group's positions up to t + i; else to all of the group's positions (a double-token pair sees itself).
 * keys/values (>= M / group, heads, capacity, head_dim): hypothesis r's positions written in row r;
 * cross_keys/values (M / group, heads, S, head_dim); source_attend (M / group, S): 1 where a source token is,
 * or NULL; self_attend (>= M / group, capacity): 1 where a cache slot belongs to that hypothesis's prefix (a
 * batch whose sentences kept different parts of their blocks), or NULL (every slot before t does).
 * slots (cache rows, capacity), or NULL: slots[c * capacity + p] is the cache row that holds position p of the
 * hypothesis in cache row c (a beam search that follows parents instead of copying their caches), or NULL: row
 * c itself. scratch: room for M * (5 D + ffn) + max(t + group, S) floats; qbuf: M * max(width) bytes; sbuf: M floats. */
void fp_decoder_layer_step(const fp_layer *L, float *x, int64_t M, float *keys, float *values, int64_t capacity,
                           int64_t t, const float *cross_keys, const float *cross_values, int64_t S,
                           const uint8_t *source_attend, const uint8_t *self_attend, float *scratch, int8_t *qbuf,
                           float *sbuf, int64_t group, int64_t causal, const int64_t *cache_rows,
                           const int64_t *source_rows, const int64_t *slots) {
    const int64_t H = L->heads, hd = L->head_dim, D = H * hd, F = L->fc1.out;
#define CACHE_ROW(m) (cache_rows ? cache_rows[(m) / group] : (m) / group)
#define SOURCE_ROW(m) (source_rows ? source_rows[(m) / group] : (m) / group)
    float *residual = scratch, *qkv = residual + M * D, *context = qkv + 3 * M * D, *hidden = context + M * D;
    float *scores = hidden + M * F;
    /* self-attention over the prefix (the group's keys first: position t + i attends to keys up to t + i, or
     * t + group - 1) */
    sublayer_enter(L, x, M, D, residual, L->self_norm_weight, L->self_norm_bias, L->self_norm_eps);
    fp_matrix_product(&L->qkv, x, M, qkv, qbuf, sbuf);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t h = 0; h < H; ++h) {
            const float *row = qkv + m * 3 * D;
            const int64_t cache = CACHE_ROW(m) * H + h, position = t + m % group;
            float *k = keys + (cache * capacity + position) * hd, *v = values + (cache * capacity + position) * hd;
            for (int64_t d = 0; d < hd; ++d) { k[d] = row[D + h * hd + d]; v[d] = row[2 * D + h * hd + d]; }
        }
    int64_t shift[slots ? capacity : 1]; /* (the distance in floats from a hypothesis's row to each position's) */
    for (int64_t m = 0; m < M; ++m) {
        const int64_t own = CACHE_ROW(m), length = causal ? t + m % group + 1 : t + group;
        if (slots)
            for (int64_t p = 0; p < length; ++p) shift[p] = (slots[own * capacity + p] - own) * H * capacity * hd;
        for (int64_t h = 0; h < H; ++h) {
            const int64_t cache = own * H + h;
            attend(qkv + m * 3 * D + h * hd, keys + cache * capacity * hd, values + cache * capacity * hd, length,
                   hd, hd, L->scaling, self_attend ? self_attend + own * capacity : NULL, scores,
                   context + m * D + h * hd, slots ? shift : NULL);
        }
    }
    fp_matrix_product(&L->self_out, context, M, x, qbuf, sbuf);
    sublayer_leave(L, x, M, D, residual, L->self_norm_weight, L->self_norm_bias, L->self_norm_eps);
    /* attention over the source */
    sublayer_enter(L, x, M, D, residual, L->cross_norm_weight, L->cross_norm_bias, L->cross_norm_eps);
    fp_matrix_product(&L->cross_q, x, M, qkv, qbuf, sbuf);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t h = 0; h < H; ++h) {
            const int64_t source = SOURCE_ROW(m);
            attend(qkv + m * D + h * hd, cross_keys + (source * H + h) * S * hd,
                   cross_values + (source * H + h) * S * hd, S, hd, hd, L->scaling,
                   source_attend ? source_attend + source * S : NULL, scores, context + m * D + h * hd, NULL);
        }
    fp_matrix_product(&L->cross_out, context, M, x, qbuf, sbuf);
    sublayer_leave(L, x, M, D, residual, L->cross_norm_weight, L->cross_norm_bias, L->cross_norm_eps);
    feed_forward(L, x, M, residual, hidden, qbuf, sbuf);
#undef CACHE_ROW
#undef SOURCE_ROW
}

/* One fairseq TransformerEncoderLayer in eval mode over one sentence: x (S, D), its S tokens (no padding), in
 * place; every position attends to all S. The cross-attention members of L are not read. scratch: room for
 * S * (5 D + ffn) + S floats; qbuf: S * max(width) bytes; sbuf: S floats. At a sentence's few rows the ~25
 * torch operations of a layer cost as much as its int8 arithmetic (the encoder of the fast step and of the
 * lattice decoder). */
void fp_encoder_layer(const fp_layer *L, float *x, int64_t S, float *scratch, int8_t *qbuf, float *sbuf) {
    const int64_t H = L->heads, hd = L->head_dim, D = H * hd, F = L->fc1.out;
    float *residual = scratch, *qkv = residual + S * D, *context = qkv + 3 * S * D, *hidden = context + S * D;
    float *scores = hidden + S * F;
    sublayer_enter(L, x, S, D, residual, L->self_norm_weight, L->self_norm_bias, L->self_norm_eps);
    fp_matrix_product(&L->qkv, x, S, qkv, qbuf, sbuf);
    for (int64_t m = 0; m < S; ++m)
        for (int64_t h = 0; h < H; ++h)  /* keys and values read in place: rows 3 D apart */
            attend(qkv + m * 3 * D + h * hd, qkv + D + h * hd, qkv + 2 * D + h * hd, S, 3 * D, hd, L->scaling, NULL,
                   scores, context + m * D + h * hd, NULL);
    fp_matrix_product(&L->self_out, context, S, x, qbuf, sbuf);
    sublayer_leave(L, x, S, D, residual, L->self_norm_weight, L->self_norm_bias, L->self_norm_eps);
    feed_forward(L, x, S, residual, hidden, qbuf, sbuf);
}
