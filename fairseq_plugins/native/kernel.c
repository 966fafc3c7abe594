/* Kernels for decoder steps at batch 1 and beams (few rows), one thread: an int8 x int8 -> float32 matrix
 * product, a float32 one, and a whole transformer decoder layer's incremental step over either.
 *
 * int8:
 *
 * y[m, n] = (sum_k q[m, k] w[n, k]) * xs[m] * ws[n] + b[n], where q = round(x / xs) with xs = max|x[m]| / 127
 * (one symmetric scale per input row, round half to even) and w int8 with one scale per output row.
 *
 * Why not torch's own int8 kernel: fbgemm's dynamic linear spends 100-200 us a call on a 1 x 256 input
 * (quantizing, packing, dispatch), more than the float32 product; this kernel reads each weight byte once a
 * call and does nothing else (5 us for a 256 x 256 matrix at one row here, 4-8x fewer bytes and time than
 * float32). Built and loaded by native.py; compiled with -ffp-contract=off so that the float arithmetic is
 * exactly the reference's in the tests (no fused multiply-adds).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Each row of x (M, K) as int8 q (M, Kp), zero padded to Kp, and its scale; a row of zeros gets scale 1. */
void fp_quantize_rows(const float *x, int64_t M, int64_t K, int64_t Kp, int8_t *q, float *scales) {
    for (int64_t m = 0; m < M; ++m) {
        const float *row = x + m * K;
        float amax = 0.0f;
        for (int64_t k = 0; k < K; ++k) {
            float a = fabsf(row[k]);
            amax = a > amax ? a : amax;
        }
        float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
        float inverse = 1.0f / scale;
        int8_t *out = q + m * Kp;
        for (int64_t k = 0; k < K; ++k) {
            float v = nearbyintf(row[k] * inverse);
            out[k] = (int8_t)(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
        }
        for (int64_t k = K; k < Kp; ++k) out[k] = 0;
        scales[m] = scale;
    }
}

#if defined(__AVX2__)
static inline int32_t horizontal_sum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* acc += the dot products of 32 int8 pairs, in 8 int32 lanes: maddubs multiplies unsigned by signed bytes, so
 * a's magnitude times b with a's sign (|a|, |b| <= 127: the int16 pair sums cannot saturate). */
/* 32 products a . b summed into acc's eight int32 lanes, given |a| (maddubs takes one unsigned factor: |a| and
 * b with a's sign, so each pair sum stays within int16: 2 * 127 * 127). */
static inline __m256i dot32(__m256i a_abs, __m256i a, __m256i b, __m256i acc) {
    __m256i products = _mm256_maddubs_epi16(a_abs, _mm256_sign_epi8(b, a));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(products, _mm256_set1_epi16(1)));
}
#endif

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define FP_VNNI 1
/* acc += the dot products of 32 unsigned x signed byte pairs, in eight int32 lanes (exact: no intermediate
 * int16 sums). */
static inline __m256i dot32_unsigned(__m256i u, __m256i s, __m256i acc) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_dpbusd_epi32(acc, u, s);
#endif
}
#endif

#if defined(__AVX2__)
/* Both inner loops multiply unsigned by signed bytes, so each input row is prepared once a call: with VNNI
 * u = q + 128 (the sign bit flipped), each output then corrected by 128 sum w; with AVX2 maddubs |q|, q's sign
 * moved onto w. Either way the int32 sums are exactly sum q w, so the two builds give the same outputs. */
static int8_t *prepared_rows(const int8_t *q, int64_t bytes) {
    int8_t *p = (int8_t *)malloc((size_t)bytes);
    if (!p) abort();
    for (int64_t i = 0; i < bytes; i += 32) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + i));
#if defined(FP_VNNI)
        _mm256_storeu_si256((__m256i *)(p + i), _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)));
#else
        _mm256_storeu_si256((__m256i *)(p + i), _mm256_abs_epi8(v));
#endif
    }
    return p;
}

/* acc += the 32 products of row bytes at offset k (prepared p, original q) with the weight bytes wv. */
static inline __m256i row_dot32(const int8_t *p, const int8_t *q, int64_t k, __m256i wv, __m256i acc) {
    const __m256i prepared = _mm256_loadu_si256((const __m256i *)(p + k));
#if defined(FP_VNNI)
    (void)q;
    return dot32_unsigned(prepared, wv, acc);
#else
    return dot32(prepared, _mm256_loadu_si256((const __m256i *)(q + k)), wv, acc);
#endif
}

/* What each output's sum must lose for the row preparation: 128 sum w with VNNI, nothing with AVX2. */
static inline int32_t row_correction(const int8_t *wn, int64_t Kp) {
#if defined(FP_VNNI)
    __m256i c = _mm256_setzero_si256();
    for (int64_t k = 0; k < Kp; k += 32)
        c = dot32_unsigned(_mm256_set1_epi8((char)128), _mm256_loadu_si256((const __m256i *)(wn + k)), c);
    return horizontal_sum(c);
#else
    (void)wn;
    (void)Kp;
    return 0;
#endif
}
#endif

/* Kp a multiple of 32; rows of q and w zero padded from K to Kp. */
void fp_int8_gemm(const int8_t *q, const float *xs, int64_t M, const int8_t *w, const float *ws, int64_t N,
                  int64_t Kp, const float *bias, float *y) {
#if defined(__AVX2__)
    int8_t *p = prepared_rows(q, M * Kp);
#define ROW(m) p + (m) * Kp, q + (m) * Kp
#endif
    for (int64_t n = 0; n < N; ++n) {
        const int8_t *wn = w + n * Kp;
        const float b = bias ? bias[n] : 0.0f;
        int64_t m = 0;
#if defined(__AVX2__)
        const int32_t correction = row_correction(wn, Kp);
        /* Four input rows at a time share each load of the weight row. */
        for (; m + 4 <= M; m += 4) {
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t k = 0; k < Kp; k += 32) {
                __m256i wv = _mm256_loadu_si256((const __m256i *)(wn + k));
                a0 = row_dot32(ROW(m + 0), k, wv, a0);
                a1 = row_dot32(ROW(m + 1), k, wv, a1);
                a2 = row_dot32(ROW(m + 2), k, wv, a2);
                a3 = row_dot32(ROW(m + 3), k, wv, a3);
            }
            y[(m + 0) * N + n] = (float)(horizontal_sum(a0) - correction) * xs[m + 0] * ws[n] + b;
            y[(m + 1) * N + n] = (float)(horizontal_sum(a1) - correction) * xs[m + 1] * ws[n] + b;
            y[(m + 2) * N + n] = (float)(horizontal_sum(a2) - correction) * xs[m + 2] * ws[n] + b;
            y[(m + 3) * N + n] = (float)(horizontal_sum(a3) - correction) * xs[m + 3] * ws[n] + b;
        }
        for (; m < M; ++m) {
            __m256i a0 = _mm256_setzero_si256();
            for (int64_t k = 0; k < Kp; k += 32)
                a0 = row_dot32(ROW(m), k, _mm256_loadu_si256((const __m256i *)(wn + k)), a0);
            y[m * N + n] = (float)(horizontal_sum(a0) - correction) * xs[m] * ws[n] + b;
        }
#else
        for (; m < M; ++m) {
            const int8_t *qm = q + m * Kp;
            int32_t acc = 0;
            for (int64_t k = 0; k < Kp; ++k) acc += (int32_t)qm[k] * (int32_t)wn[k];
            y[m * N + n] = (float)acc * xs[m] * ws[n] + b;
        }
#endif
    }
#if defined(__AVX2__)
#undef ROW
    free(p);
#endif
}

#if defined(FP_VNNI)
/* The same product with w packed for VNNI (fp_int8_gemm's sums, so the same outputs): output rows in blocks of
 * 8, each block Kp / 4 groups of 32 bytes, w[n0 + j, 4g .. 4g + 3] at byte 4j of group g; Np = N rounded up to
 * 8, ws and bias zero padded to Np, corrections[n] = 128 sum_k w[n, k]. One 32-bit lane accumulates one
 * output over k, so no horizontal sums; each weight group is read once for four input rows. */
static inline void store_outputs(__m256i sums, const int32_t *corrections, float row_scale, const float *ws,
                                 const float *bias, int64_t n0, int64_t N, float *y_row) {
    __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(sums, _mm256_loadu_si256((const __m256i *)(corrections + n0))));
    v = _mm256_mul_ps(_mm256_mul_ps(v, _mm256_set1_ps(row_scale)), _mm256_loadu_ps(ws + n0));
    v = _mm256_add_ps(v, bias ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps());
    if (n0 + 8 <= N) {
        _mm256_storeu_ps(y_row + n0, v);
    } else {
        float rest[8];
        _mm256_storeu_ps(rest, v);
        for (int64_t j = 0; n0 + j < N; ++j) y_row[n0 + j] = rest[j];
    }
}

static inline __m256i broadcast4(const uint8_t *bytes) {
    int32_t v;
    memcpy(&v, bytes, 4);
    return _mm256_set1_epi32(v);
}

void fp_int8_gemm_packed(const int8_t *q, const float *xs, int64_t M, const int8_t *wp, const float *ws,
                         const int32_t *corrections, int64_t N, int64_t Kp, const float *bias, float *y) {
    uint8_t *u = (uint8_t *)prepared_rows(q, M * Kp);  /* q + 128 */
    const int64_t groups = Kp / 4, blocks = (N + 7) / 8;
    for (int64_t nb = 0; nb < blocks; nb += 2) {
        const int two = nb + 1 < blocks;
        const __m256i *w0 = (const __m256i *)(wp + nb * groups * 32);
        const __m256i *w1 = two ? w0 + groups : w0;
        const int64_t n0 = nb * 8, n1 = n0 + 8;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) {
            const uint8_t *r0 = u + m * Kp, *r1 = r0 + Kp, *r2 = r1 + Kp, *r3 = r2 + Kp;
            __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
                    a30 = a00, a31 = a00;
            for (int64_t g = 0; g < groups; ++g) {
                const __m256i b0 = _mm256_loadu_si256(w0 + g), b1 = _mm256_loadu_si256(w1 + g);
                __m256i x = broadcast4(r0 + 4 * g);
                a00 = dot32_unsigned(x, b0, a00);
                a01 = dot32_unsigned(x, b1, a01);
                x = broadcast4(r1 + 4 * g);
                a10 = dot32_unsigned(x, b0, a10);
                a11 = dot32_unsigned(x, b1, a11);
                x = broadcast4(r2 + 4 * g);
                a20 = dot32_unsigned(x, b0, a20);
                a21 = dot32_unsigned(x, b1, a21);
                x = broadcast4(r3 + 4 * g);
                a30 = dot32_unsigned(x, b0, a30);
                a31 = dot32_unsigned(x, b1, a31);
            }
            store_outputs(a00, corrections, xs[m + 0], ws, bias, n0, N, y + (m + 0) * N);
            store_outputs(a10, corrections, xs[m + 1], ws, bias, n0, N, y + (m + 1) * N);
            store_outputs(a20, corrections, xs[m + 2], ws, bias, n0, N, y + (m + 2) * N);
            store_outputs(a30, corrections, xs[m + 3], ws, bias, n0, N, y + (m + 3) * N);
            if (two) {
                store_outputs(a01, corrections, xs[m + 0], ws, bias, n1, N, y + (m + 0) * N);
                store_outputs(a11, corrections, xs[m + 1], ws, bias, n1, N, y + (m + 1) * N);
                store_outputs(a21, corrections, xs[m + 2], ws, bias, n1, N, y + (m + 2) * N);
                store_outputs(a31, corrections, xs[m + 3], ws, bias, n1, N, y + (m + 3) * N);
            }
        }
        for (; m < M; ++m) {
            const uint8_t *r0 = u + m * Kp;
            __m256i a00 = _mm256_setzero_si256(), a01 = a00;
            for (int64_t g = 0; g < groups; ++g) {
                const __m256i x = broadcast4(r0 + 4 * g);
                a00 = dot32_unsigned(x, _mm256_loadu_si256(w0 + g), a00);
                a01 = dot32_unsigned(x, _mm256_loadu_si256(w1 + g), a01);
            }
            store_outputs(a00, corrections, xs[m], ws, bias, n0, N, y + m * N);
            if (two) store_outputs(a01, corrections, xs[m], ws, bias, n1, N, y + m * N);
        }
    }
    free(u);
}
#endif

/* Whether fp_int8_gemm_packed exists in this build (the CPU and compiler had VNNI). */
int fp_has_packed_gemm(void) {
#if defined(FP_VNNI)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX2__)
static inline float horizontal_sum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX2__)
/* y[m + r, n] = x[m + r] . wn + b for r < R: R rows against one weight row, which is read once for all of
 * them. R is a constant, so the accumulators stay in registers: two a row (even and odd blocks of 8), for the
 * additions' latency. */
static inline __attribute__((always_inline)) void float_rows_dot(const float *x, int64_t m, int64_t K, int64_t K8,
                                                                 const float *wn, float b, float *y, int64_t N,
                                                                 int64_t n, const int R) {
    __m256 even[4], odd[4];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K8; k += 16) {
        const __m256 w0 = _mm256_loadu_ps(wn + k), w1 = _mm256_loadu_ps(wn + k + 8);
        for (int r = 0; r < R; ++r) {
            even[r] = _mm256_add_ps(even[r], _mm256_mul_ps(_mm256_loadu_ps(x + (m + r) * K + k), w0));
            odd[r] = _mm256_add_ps(odd[r], _mm256_mul_ps(_mm256_loadu_ps(x + (m + r) * K + k + 8), w1));
        }
    }
    for (; k < K8; k += 8) {
        const __m256 w0 = _mm256_loadu_ps(wn + k);
        for (int r = 0; r < R; ++r)
            even[r] = _mm256_add_ps(even[r], _mm256_mul_ps(_mm256_loadu_ps(x + (m + r) * K + k), w0));
    }
    for (int r = 0; r < R; ++r) {
        float s = horizontal_sum_ps(_mm256_add_ps(even[r], odd[r]));
        for (k = K8; k < K; ++k) s += x[(m + r) * K + k] * wn[k];
        y[(m + r) * N + n] = s + b;
    }
}
#endif

/* y (M, N) = x (M, K) w^T (N, K) + b, float32, each weight row read once for every four input rows, and once
 * for the last two or three (a block of blockwise decoding, a double-token pair), so that a few rows cost
 * about one row's weight reading (MKL's sgemm repacks the weight on every call at a few rows). */
void fp_float_gemm(const float *x, int64_t M, const float *w, int64_t N, int64_t K, const float *bias, float *y) {
    const int64_t K8 = K / 8 * 8;
    for (int64_t n = 0; n < N; ++n) {
        const float *wn = w + n * K;
        const float b = bias ? bias[n] : 0.0f;
        int64_t m = 0;
#if defined(__AVX2__)
        for (; m + 4 <= M; m += 4) float_rows_dot(x, m, K, K8, wn, b, y, N, n, 4);
        if (M - m == 3) float_rows_dot(x, m, K, K8, wn, b, y, N, n, 3), m += 3;
        if (M - m == 2) float_rows_dot(x, m, K, K8, wn, b, y, N, n, 2), m += 2;
        if (M - m == 1) float_rows_dot(x, m, K, K8, wn, b, y, N, n, 1);
#else
        for (; m < M; ++m) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * wn[k];
            y[m * N + n] = s + b;
        }
#endif
    }
}

/* ---- one incremental step of a fairseq transformer decoder layer -----------------------------------------
 *
 * The whole layer in one call: at batch 1 a step of torch operations spends more time dispatching its ~30
 * small operations a layer than computing them with int8 weights, and a third of it with float32 weights.
 * Post-norm or pre-norm, relu or gelu; the matrices are the products above, the rest float32. */

typedef struct {
    const float *weights; /* (out, in) float32: a float32 matrix; NULL: an int8 one */
    const int8_t *values; /* (out, width) int8, rows zero padded to width */
    const float *scales;  /* (out) */
    const float *bias;    /* (out) or NULL */
    int64_t out, in, width;
    /* An int8 matrix's values in fp_int8_gemm_packed's layout, or NULL (then the plain kernel); its
     * corrections and its scales and bias zero padded to a multiple of 8 rows (bias NULL when there is none). */
    const int8_t *packed;
    const int32_t *corrections;
    const float *packed_scales, *packed_bias;
} fp_matrix;

typedef struct {
    fp_matrix qkv, self_out, cross_q, cross_out, fc1, fc2;
    const float *self_norm_weight, *self_norm_bias, *cross_norm_weight, *cross_norm_bias;
    const float *final_norm_weight, *final_norm_bias;
    float self_norm_eps, cross_norm_eps, final_norm_eps, scaling;
    int64_t heads, head_dim, normalize_before, gelu;
} fp_layer;

/* x (M, in) -> y (M, out); q and scales: room for M rows of width bytes / M floats. */
static void matrix_product(const fp_matrix *A, const float *x, int64_t M, float *y, int8_t *q, float *scales) {
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

static void layer_norm(float *x, int64_t M, int64_t D, const float *w, const float *b, float eps) {
    for (int64_t m = 0; m < M; ++m) {
        float *row = x + m * D;
        float mean = 0.0f, var = 0.0f;
        for (int64_t d = 0; d < D; ++d) mean += row[d];
        mean /= (float)D;
        for (int64_t d = 0; d < D; ++d) var += (row[d] - mean) * (row[d] - mean);
        float inv = 1.0f / sqrtf(var / (float)D + eps);
        for (int64_t d = 0; d < D; ++d) row[d] = (row[d] - mean) * inv * w[d] + b[d];
    }
}

/* softmax(q . keys[j] * scaling over j < length, masked) . values -> out (head_dim); keys/values rows of
 * head_dim floats, stride apart; scores: room for length floats. */
static void attend(const float *q, const float *keys, const float *values, int64_t length, int64_t stride,
                   int64_t head_dim, float scaling, const uint8_t *mask, float *scores, float *out) {
    float best = -INFINITY;
    for (int64_t j = 0; j < length; ++j) {
        if (mask && !mask[j]) { scores[j] = -INFINITY; continue; }
        const float *k = keys + j * stride;
        float s = 0.0f;
        for (int64_t d = 0; d < head_dim; ++d) s += q[d] * k[d];
        scores[j] = s * scaling;
        best = scores[j] > best ? scores[j] : best;
    }
    float total = 0.0f;
    for (int64_t j = 0; j < length; ++j) {
        scores[j] = scores[j] == -INFINITY ? 0.0f : expf(scores[j] - best);
        total += scores[j];
    }
    for (int64_t d = 0; d < head_dim; ++d) out[d] = 0.0f;
    for (int64_t j = 0; j < length; ++j) {
        const float p = scores[j] / total;
        const float *v = values + j * stride;
        for (int64_t d = 0; d < head_dim; ++d) out[d] += p * v[d];
    }
}

/* A residual sublayer's entry: x is kept as the residual, then normalised first when the layer is pre-norm. */
static void sublayer_enter(const fp_layer *L, float *x, int64_t M, int64_t D, float *residual, const float *norm_weight,
                           const float *norm_bias, float norm_eps) {
    for (int64_t i = 0; i < M * D; ++i) residual[i] = x[i];
    if (L->normalize_before) layer_norm(x, M, D, norm_weight, norm_bias, norm_eps);
}

/* Its exit: the residual added back to the sublayer's output x, then normalised after when post-norm. */
static void sublayer_leave(const fp_layer *L, float *x, int64_t M, int64_t D, const float *residual,
                           const float *norm_weight, const float *norm_bias, float norm_eps) {
    for (int64_t i = 0; i < M * D; ++i) x[i] = residual[i] + x[i];
    if (!L->normalize_before) layer_norm(x, M, D, norm_weight, norm_bias, norm_eps);
}

/* A layer's feed-forward sublayer on x (M, D) in place, with its residual and layer norm (residual: M * D
 * floats, hidden: M * ffn floats of scratch). */
static void feed_forward(const fp_layer *L, float *x, int64_t M, float *residual, float *hidden, int8_t *qbuf,
                         float *sbuf) {
    const int64_t D = L->heads * L->head_dim, F = L->fc1.out;
    sublayer_enter(L, x, M, D, residual, L->final_norm_weight, L->final_norm_bias, L->final_norm_eps);
    matrix_product(&L->fc1, x, M, hidden, qbuf, sbuf);
    for (int64_t i = 0; i < M * F; ++i) {
        const float h = hidden[i];
        hidden[i] = L->gelu ? 0.5f * h * (1.0f + erff(h * 0.70710678118654752f)) : (h > 0.0f ? h : 0.0f);
    }
    matrix_product(&L->fc2, hidden, M, x, qbuf, sbuf);
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
 * scratch: room for M * (5 D + ffn) + max(t + group, S) floats; qbuf: M * max(width) bytes; sbuf: M floats. */
void fp_decoder_layer_step(const fp_layer *L, float *x, int64_t M, float *keys, float *values, int64_t capacity,
                           int64_t t, const float *cross_keys, const float *cross_values, int64_t S,
                           const uint8_t *source_attend, const uint8_t *self_attend, float *scratch, int8_t *qbuf,
                           float *sbuf, int64_t group, int64_t causal) {
    const int64_t H = L->heads, hd = L->head_dim, D = H * hd, F = L->fc1.out;
    float *residual = scratch, *qkv = residual + M * D, *context = qkv + 3 * M * D, *hidden = context + M * D;
    float *scores = hidden + M * F;
    /* self-attention over the prefix (the group's keys first: position t + i attends to keys up to t + i, or
     * t + group - 1) */
    sublayer_enter(L, x, M, D, residual, L->self_norm_weight, L->self_norm_bias, L->self_norm_eps);
    matrix_product(&L->qkv, x, M, qkv, qbuf, sbuf);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t h = 0; h < H; ++h) {
            const float *row = qkv + m * 3 * D;
            const int64_t cache = (m / group) * H + h, position = t + m % group;
            float *k = keys + (cache * capacity + position) * hd, *v = values + (cache * capacity + position) * hd;
            for (int64_t d = 0; d < hd; ++d) { k[d] = row[D + h * hd + d]; v[d] = row[2 * D + h * hd + d]; }
        }
    for (int64_t m = 0; m < M; ++m)
        for (int64_t h = 0; h < H; ++h) {
            const int64_t cache = (m / group) * H + h, length = causal ? t + m % group + 1 : t + group;
            attend(qkv + m * 3 * D + h * hd, keys + cache * capacity * hd, values + cache * capacity * hd, length,
                   hd, hd, L->scaling, self_attend ? self_attend + (m / group) * capacity : NULL, scores,
                   context + m * D + h * hd);
        }
    matrix_product(&L->self_out, context, M, x, qbuf, sbuf);
    sublayer_leave(L, x, M, D, residual, L->self_norm_weight, L->self_norm_bias, L->self_norm_eps);
    /* attention over the source */
    sublayer_enter(L, x, M, D, residual, L->cross_norm_weight, L->cross_norm_bias, L->cross_norm_eps);
    matrix_product(&L->cross_q, x, M, qkv, qbuf, sbuf);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t h = 0; h < H; ++h) {
            const int64_t source = m / group;
            attend(qkv + m * D + h * hd, cross_keys + (source * H + h) * S * hd,
                   cross_values + (source * H + h) * S * hd, S, hd, hd, L->scaling,
                   source_attend ? source_attend + source * S : NULL, scores, context + m * D + h * hd);
        }
    matrix_product(&L->cross_out, context, M, x, qbuf, sbuf);
    sublayer_leave(L, x, M, D, residual, L->cross_norm_weight, L->cross_norm_bias, L->cross_norm_eps);
    feed_forward(L, x, M, residual, hidden, qbuf, sbuf);
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
    matrix_product(&L->qkv, x, S, qkv, qbuf, sbuf);
    for (int64_t m = 0; m < S; ++m)
        for (int64_t h = 0; h < H; ++h)  /* keys and values read in place: rows 3 D apart */
            attend(qkv + m * 3 * D + h * hd, qkv + D + h * hd, qkv + 2 * D + h * hd, S, 3 * D, hd, L->scaling, NULL,
                   scores, context + m * D + h * hd);
    matrix_product(&L->self_out, context, S, x, qbuf, sbuf);
    sublayer_leave(L, x, S, D, residual, L->self_norm_weight, L->self_norm_bias, L->self_norm_eps);
    feed_forward(L, x, S, residual, hidden, qbuf, sbuf);
}

/* Beam search over one scored lattice under a no-repeat-n-gram rule: lattice/viterbi.py's
 * beam_search_without_repeats (the reference; its docstring has the rule) for one sentence, float32.
 *
 * transitions (P, S, K): score of candidate c at position t + 1 after state s; ends (P + 1, S): of ending
 * after length l in state s; allowed (P + 1): lengths that may end; tokens (P, K): each candidate's token.
 * The state after candidate c in state s is (s % suffixes) * K + c. -INFINITY marks the impossible.
 * Out: best_end (P + 1) (-INFINITY where no path of that length ends), best_paths (P + 1, P): the candidate
 * indices of the best path of each length, best_steps (P + 1, P + 1): its transition scores, then its end's.
 * The beam keeps the `beam` best extensions, ties to the lowest (path, candidate) number, as torch.topk does
 * for distinct values (the reference); extensions of score -INFINITY are dropped rather than kept (they can
 * never end a path, so no output changes). Returns 0, or -1 when out of memory. */
int fp_lattice_beam_search(const float *transitions, const float *ends, const uint8_t *allowed,
                           const int64_t *tokens, int64_t P, int64_t S, int64_t K, int64_t suffixes, int64_t n,
                           int64_t beam, float *best_end, int64_t *best_paths, float *best_steps) {
    float *score = malloc(sizeof(float) * 2 * beam), *next_score = score + beam;
    int64_t *state = malloc(sizeof(int64_t) * 2 * beam), *next_state = state + beam;
    int64_t *path = malloc(sizeof(int64_t) * 2 * beam * (P + 1)), *next_path = path + beam * (P + 1);
    int64_t *word = malloc(sizeof(int64_t) * 2 * beam * (P + 1)), *next_word = word + beam * (P + 1);
    float *step = malloc(sizeof(float) * 2 * beam * (P + 1)), *next_step = step + beam * (P + 1);
    float *top_value = malloc(sizeof(float) * (beam + 1));
    int64_t *top_index = malloc(sizeof(int64_t) * (beam + 1)), *banned = malloc(sizeof(int64_t) * (P + 1));
    if (!score || !state || !path || !word || !step || !top_value || !top_index || !banned) {
        free(score); free(state); free(path); free(word); free(step); free(top_value); free(top_index); free(banned);
        return -1;
    }
    int64_t m = 1;  /* paths in the beam: the empty one, in the start state */
    score[0] = 0.0f;
    state[0] = 0;
    for (int64_t length = 0; length <= P; length++) {
        /* The best ending of this length: the first maximum over the beam, as torch.max. */
        float best = -INFINITY;
        int64_t at = -1;
        if (allowed[length]) {
            for (int64_t i = 0; i < m; i++) {
                float e = score[i] + ends[length * S + state[i]];
                if (e > best) { best = e; at = i; }
            }
        }
        best_end[length] = best;
        if (at >= 0) {
            for (int64_t j = 0; j < length; j++) {
                best_paths[length * P + j] = path[at * (P + 1) + j];
                best_steps[length * (P + 1) + j] = step[at * (P + 1) + j];
            }
            best_steps[length * (P + 1) + length] = ends[length * S + state[at]];
        }
        if (length == P) break;
        /* Extend: every (path i, candidate c) not banned, the best `beam` kept in order (value desc, i * K + c asc). */
        int64_t kept = 0;
        const float *row_base = transitions + length * S * K;
        const int64_t *next_tokens = tokens + length * K;
        for (int64_t i = 0; i < m; i++) {
            const int64_t *h = word + i * (P + 1);
            int64_t n_banned = 0;
            /* Tokens that would complete an n-gram path i holds: after each earlier window equal to its last n - 1. */
            if (length >= n - 1 && length >= 1) {
                for (int64_t j = 0; j + n - 1 < length; j++) {
                    int64_t same = 1;
                    for (int64_t q = 0; q < n - 1; q++) {
                        if (h[j + q] != h[length - n + 1 + q]) { same = 0; break; }
                    }
                    if (same) banned[n_banned++] = h[j + n - 1];
                }
            }
            const float *row = row_base + state[i] * K;
            for (int64_t c = 0; c < K; c++) {
                float v = score[i] + row[c];
                if (v == -INFINITY) continue;
                int64_t is_banned = 0;
                for (int64_t b = 0; b < n_banned; b++) {
                    if (banned[b] == next_tokens[c]) { is_banned = 1; break; }
                }
                if (is_banned) continue;
                if (kept == beam && !(v > top_value[kept - 1])) continue;
                /* Insert after every kept value >= v (earlier indices win ties), dropping the last when full. */
                int64_t pos = kept < beam ? kept : beam - 1;
                while (pos > 0 && top_value[pos - 1] < v) {
                    top_value[pos] = top_value[pos - 1];
                    top_index[pos] = top_index[pos - 1];
                    pos--;
                }
                top_value[pos] = v;
                top_index[pos] = i * K + c;
                if (kept < beam) kept++;
            }
        }
        for (int64_t r = 0; r < kept; r++) {
            int64_t i = top_index[r] / K, c = top_index[r] % K;
            next_score[r] = top_value[r];
            next_state[r] = (state[i] % suffixes) * K + c;
            for (int64_t j = 0; j < length; j++) {
                next_path[r * (P + 1) + j] = path[i * (P + 1) + j];
                next_word[r * (P + 1) + j] = word[i * (P + 1) + j];
                next_step[r * (P + 1) + j] = step[i * (P + 1) + j];
            }
            next_path[r * (P + 1) + length] = c;
            next_word[r * (P + 1) + length] = next_tokens[c];
            next_step[r * (P + 1) + length] = row_base[state[i] * K + c];
        }
        float *fs; int64_t *is;
        fs = score; score = next_score; next_score = fs;
        is = state; state = next_state; next_state = is;
        is = path; path = next_path; next_path = is;
        is = word; word = next_word; next_word = is;
        fs = step; step = next_step; next_step = fs;
        m = kept;
        if (m == 0) {  /* every extension impossible: no longer path ends */
            for (int64_t l = length + 1; l <= P; l++) best_end[l] = -INFINITY;
            break;
        }
    }
    /* The buffers were swapped in pairs: free each pair's lower half. */
    free(score < next_score ? score : next_score);
    free(state < next_state ? state : next_state);
    free(path < next_path ? path : next_path);
    free(word < next_word ? word : next_word);
    free(step < next_step ? step : next_step);
    free(top_value); free(top_index); free(banned);
    return 0;
}

/* ---- one decoding step of a ByteNet stack of ReLU residual blocks --------------------------------------------
 *
 * Each block (Kalchbrenner et al. 2016, Fig. 3 left) on one new frame a row: LN, ReLU, 1x1 (C -> h), LN, ReLU,
 * masked dilated 1xk (h -> h) over the new frame and the kept ones, LN, ReLU, 1x1 (h -> C), residual. A step in
 * torch operations is about 13 calls a block, whose dispatch costs about a third of the step at batch 1; here
 * the whole stack is one call. */

typedef struct {
    const float *norm_in_weight, *norm_in_bias, *norm_mid_weight, *norm_mid_bias, *norm_out_weight, *norm_out_bias;
    float norm_in_eps, norm_mid_eps, norm_out_eps;
    const float *reduce_weight, *reduce_bias; /* (hidden, channels) */
    const float *conv_weight, *conv_bias;     /* (hidden, hidden * kernel): a conv1d kernel (out, in, k) as it lies */
    const float *expand_weight, *expand_bias; /* (channels, hidden) */
    int64_t channels, hidden, kernel, dilation;
} fp_relu_block;

static void relu_in_place(float *x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

/* x (M, channels) in place through `count` blocks. pasts[b] (M, (kernel - 1) * dilation, hidden): block b's
 * convolution input frames kept from the steps before, oldest first; the new frame is appended and the oldest
 * dropped, in place. scratch: room for M * (2 channels + (kernel + 2) hidden) floats of the widest block. */
void fp_relu_blocks_frame_step(const fp_relu_block *blocks, int64_t count, float *x, int64_t M, float *const *pasts,
                               float *scratch) {
    for (int64_t b = 0; b < count; ++b) {
        const fp_relu_block *B = blocks + b;
        const int64_t C = B->channels, H = B->hidden, k = B->kernel, r = B->dilation, history = (k - 1) * r;
        float *normed = scratch, *reduced = normed + M * C, *taps = reduced + M * H, *convolved = taps + M * H * k,
              *expanded = convolved + M * H;
        memcpy(normed, x, (size_t)(M * C) * sizeof(float));
        layer_norm(normed, M, C, B->norm_in_weight, B->norm_in_bias, B->norm_in_eps);
        relu_in_place(normed, M * C);
        fp_float_gemm(normed, M, B->reduce_weight, H, C, B->reduce_bias, reduced);
        layer_norm(reduced, M, H, B->norm_mid_weight, B->norm_mid_bias, B->norm_mid_eps);
        relu_in_place(reduced, M * H);
        /* Tap j reads the frame (k - 1 - j) * r steps back: kept frame j * r, the new one for j = k - 1; gathered
         * channel-major, tap-minor, as the kernel lies in memory. Then the kept frames move on by one. */
        for (int64_t m = 0; m < M; ++m) {
            float *past = pasts[b] + m * history * H, *row = taps + m * H * k;
            const float *frame = reduced + m * H;
            for (int64_t c = 0; c < H; ++c) {
                for (int64_t j = 0; j + 1 < k; ++j) row[c * k + j] = past[j * r * H + c];
                row[c * k + k - 1] = frame[c];
            }
            if (history > 0) {
                memmove(past, past + H, (size_t)((history - 1) * H) * sizeof(float));
                memcpy(past + (history - 1) * H, frame, (size_t)H * sizeof(float));
            }
        }
        fp_float_gemm(taps, M, B->conv_weight, H, H * k, B->conv_bias, convolved);
        layer_norm(convolved, M, H, B->norm_out_weight, B->norm_out_bias, B->norm_out_eps);
        relu_in_place(convolved, M * H);
        fp_float_gemm(convolved, M, B->expand_weight, C, H, B->expand_bias, expanded);
        for (int64_t i = 0; i < M * C; ++i) x[i] += expanded[i];
    }
}
/* ---- greedy search of one sentence, every step in C ------------------------------------------------------
 *
 * At batch 1 the weights of a small transformer are read in a fraction of a step's time: the rest was the
 * Python around them (embedding, final norm, output layer, log-softmax, fairseq's step rules, the argmax, the
 * bookkeeping), one torch operation at a time. Here the whole search of a sentence is one call, with fairseq's
 * SequenceGenerator rules at beam 1 (the fast step's Python greedy loop, which it replaces where it applies):
 * pad never, unk penalised, no end token before min_len tokens, only the end token at max_len; the cumulative
 * float32 score of the best token a step; the first of equal scores wins (torch.topk's order). */

typedef struct {
    const fp_layer *const *layers; /* n_layers */
    int64_t n_layers;
    const float *embed_tokens; /* (embedding rows, D) */
    float embed_scale;
    const float *positions; /* (n_positions, D): step t's position embedding is row t; NULL: none */
    int64_t n_positions;
    const float *final_norm_weight, *final_norm_bias; /* NULL: no final layer norm */
    float final_norm_eps;
    fp_matrix output; /* (V, D), its bias included */
    int64_t dim, vocab;
} fp_decoder;

/* Greedy search of one sentence. keys/values[l]: (1, heads, capacity, head_dim) each, capacity >= max_len + 1;
 * cross_keys/values[l]: (1, heads, S, head_dim). tokens: room for max_len + 1 ids (written: the output, end token
 * included), cumulative: room for max_len + 1 floats (written: the cumulative score after each token).
 * scratch: D + V + (5 D + ffn) + max(capacity, S) floats; qbuf: max(width) bytes; sbuf: 1 float.
 * Returns the number of tokens written. */
int64_t fp_greedy_search(const fp_decoder *Dec, float *const *keys, float *const *values, int64_t capacity,
                         const float *const *cross_keys, const float *const *cross_values, int64_t S,
                         int64_t bos, int64_t eos, int64_t pad, int64_t unk, float unk_penalty, int64_t min_len,
                         int64_t max_len, int64_t *tokens, float *cumulative, float *scratch, int8_t *qbuf,
                         float *sbuf) {
    const int64_t D = Dec->dim, V = Dec->vocab;
    float *x = scratch, *logits = x + D, *layer_scratch = logits + V;
    int64_t previous = bos;
    float total = 0.0f;
    for (int64_t step = 0; step <= max_len; ++step) {
        const float *embedding = Dec->embed_tokens + previous * D;
        for (int64_t d = 0; d < D; ++d) x[d] = Dec->embed_scale * embedding[d];
        if (Dec->positions) {
            const float *position = Dec->positions + (step < Dec->n_positions ? step : Dec->n_positions - 1) * D;
            for (int64_t d = 0; d < D; ++d) x[d] = x[d] + position[d];
        }
        for (int64_t l = 0; l < Dec->n_layers; ++l)
            fp_decoder_layer_step(Dec->layers[l], x, 1, keys[l], values[l], capacity, step, cross_keys[l],
                                  cross_values[l], S, NULL, NULL, layer_scratch, qbuf, sbuf, 1, 1);
        if (Dec->final_norm_weight)
            layer_norm(x, 1, D, Dec->final_norm_weight, Dec->final_norm_bias, Dec->final_norm_eps);
        matrix_product(&Dec->output, x, 1, logits, qbuf, sbuf);
        /* log-softmax: x - max - log(sum exp(x - max)), as torch's */
        float best = -INFINITY;
        for (int64_t v = 0; v < V; ++v) best = logits[v] > best ? logits[v] : best;
        float sum = 0.0f;
        for (int64_t v = 0; v < V; ++v) sum += expf(logits[v] - best);
        const float shift = best + logf(sum);
        /* the rules, then the best token: the first of the highest (lprob + total) */
        int64_t choice = -1;
        float choice_score = -INFINITY;
        for (int64_t v = 0; v < V; ++v) {
            float lp = logits[v] - shift;
            if (lp != lp) lp = -INFINITY; /* NaN, as nan_to_minus_inf_ */
            if (v == pad) lp = -INFINITY;
            if (v == unk) lp -= unk_penalty;
            if (step >= max_len && v != eos) lp = -INFINITY;
            if (step < min_len && v == eos) lp = -INFINITY;
            const float score = lp + total;
            if (choice < 0 || score > choice_score) { choice = v; choice_score = score; }
        }
        total = choice_score;
        tokens[step] = choice;
        cumulative[step] = total;
        if (choice == eos) return step + 1;
        previous = choice;
    }
    return max_len + 1;
}

/* ---- beam search of one sentence, every step in C ---------------------------------------------------------
 *
 * fairseq's SequenceGenerator with its BeamSearch at batch 1, step for step: the same step rules as the greedy
 * search above; at step 0 only the first hypothesis (all are alike); the 2 * beam best (hypothesis, token)
 * candidates by cumulative score (the first of equal scores wins); of the first `beam` of them, those ending
 * in the end token (a finite score) are finished hypotheses, kept while fewer than `beam` are; the first `beam`
 * candidates that are not are the next step's hypotheses; the search stops when `beam` hypotheses are finished
 * or at max_len. */

/* Keep the best `k` of (score, index) pairs in best/best_index, sorted by score descending, index ascending. */
static void keep_best(float score, int64_t index, float *best, int64_t *best_index, int64_t k, int64_t *count) {
    int64_t n = *count;
    if (n == k && !(score > best[n - 1])) return; /* (indices arrive ascending: equal scores keep the first) */
    int64_t at = n < k ? n : k - 1;
    while (at > 0 && score > best[at - 1]) {
        best[at] = best[at - 1];
        best_index[at] = best_index[at - 1];
        --at;
    }
    best[at] = score;
    best_index[at] = index;
    if (n < k) *count = n + 1;
}

/* keys/values[l]: (beam, heads, capacity, head_dim), capacity > max_len; cross_keys/values[l]: (beam, heads, S,
 * head_dim), every row the sentence's; beam <= 32. hist_tokens, hist_scores: room for 2 * beam * (max_len + 2)
 * each (the hypotheses' tokens and cumulative scores, this step's and the next's). out_tokens, out_cumulative:
 * room for beam * (max_len + 1) each (finished hypothesis h's tokens, end token included, and its cumulative
 * score after each, from h * (max_len + 1)); out_lengths: beam. scratch: beam * (6 D + V + ffn) + 2 * beam +
 * max(capacity, S) floats; cache_copy: beam * heads * capacity * head_dim floats; qbuf: beam * max(width)
 * bytes; sbuf: beam floats. Returns the number of finished hypotheses, in the order fairseq finalises them. */
int64_t fp_beam_search(const fp_decoder *Dec, float *const *keys, float *const *values, int64_t capacity,
                       const float *const *cross_keys, const float *const *cross_values, int64_t S, int64_t beam,
                       int64_t bos, int64_t eos, int64_t pad, int64_t unk, float unk_penalty, int64_t min_len,
                       int64_t max_len, int64_t *hist_tokens, float *hist_scores, int64_t *out_tokens,
                       float *out_cumulative, int64_t *out_lengths, float *scratch, float *cache_copy,
                       int8_t *qbuf, float *sbuf) {
    const int64_t D = Dec->dim, V = Dec->vocab, width = max_len + 2, K = 2 * beam;
    int64_t *tokens = hist_tokens, *next_tokens = hist_tokens + beam * width;
    float *scores = hist_scores, *next_scores = hist_scores + beam * width;
    float *x = scratch, *logits = x + beam * D, *best = logits + beam * V, *layer_scratch = best + K;
    int64_t best_index[64]; /* K <= 64: beam <= 32 (checked by the caller) */
    int64_t finished = 0, rows = 1;
    int64_t parents[32];
    tokens[0] = bos;
    for (int64_t step = 0; step <= max_len; ++step) {
        /* the decoder on each hypothesis's last token */
        for (int64_t r = 0; r < rows; ++r) {
            const float *embedding = Dec->embed_tokens + tokens[r * width + step] * D;
            float *row = x + r * D;
            for (int64_t d = 0; d < D; ++d) row[d] = Dec->embed_scale * embedding[d];
            if (Dec->positions) {
                const float *position = Dec->positions
                                        + (step < Dec->n_positions ? step : Dec->n_positions - 1) * D;
                for (int64_t d = 0; d < D; ++d) row[d] = row[d] + position[d];
            }
        }
        for (int64_t l = 0; l < Dec->n_layers; ++l)
            fp_decoder_layer_step(Dec->layers[l], x, rows, keys[l], values[l], capacity, step, cross_keys[l],
                                  cross_values[l], S, NULL, NULL, layer_scratch, qbuf, sbuf, 1, 1);
        if (Dec->final_norm_weight)
            layer_norm(x, rows, D, Dec->final_norm_weight, Dec->final_norm_bias, Dec->final_norm_eps);
        matrix_product(&Dec->output, x, rows, logits, qbuf, sbuf);
        /* log-softmax, the rules, the cumulative score; the 2 * beam best candidates */
        const int64_t k = K < rows * V - 1 ? K : rows * V - 1;
        int64_t count = 0;
        for (int64_t r = 0; r < rows; ++r) {
            float *row = logits + r * V;
            float top = -INFINITY;
            for (int64_t v = 0; v < V; ++v) top = row[v] > top ? row[v] : top;
            float sum = 0.0f;
            for (int64_t v = 0; v < V; ++v) sum += expf(row[v] - top);
            const float shift = top + logf(sum);
            const float history = step > 0 ? scores[r * width + step - 1] : 0.0f;
            for (int64_t v = 0; v < V; ++v) {
                float lp = row[v] - shift;
                if (lp != lp) lp = -INFINITY;
                if (v == pad) lp = -INFINITY;
                if (v == unk) lp -= unk_penalty;
                if (step >= max_len && v != eos) lp = -INFINITY;
                if (step < min_len && v == eos) lp = -INFINITY;
                keep_best(step > 0 ? lp + history : lp, r * V + v, best, best_index, k, &count);
            }
        }
        /* finished hypotheses among the first `beam` candidates */
        for (int64_t c = 0; c < beam && c < count; ++c) {
            const int64_t r = best_index[c] / V, v = best_index[c] % V;
            if (v != eos || best[c] == -INFINITY || finished >= beam) continue;
            int64_t *hypothesis = out_tokens + finished * (max_len + 1);
            float *cumulative = out_cumulative + finished * (max_len + 1);
            for (int64_t t = 0; t < step; ++t) {
                hypothesis[t] = tokens[r * width + t + 1];
                cumulative[t] = scores[r * width + t];
            }
            hypothesis[step] = eos;
            cumulative[step] = best[c];
            out_lengths[finished++] = step + 1;
        }
        if (finished == beam || step == max_len) break;
        /* the next hypotheses: the first `beam` candidates that do not end */
        int64_t next = 0;
        for (int64_t c = 0; c < count && next < beam; ++c) {
            const int64_t r = best_index[c] / V, v = best_index[c] % V;
            if (v == eos && best[c] != -INFINITY) continue;
            for (int64_t t = 0; t <= step; ++t) next_tokens[next * width + t] = tokens[r * width + t];
            for (int64_t t = 0; t < step; ++t) next_scores[next * width + t] = scores[r * width + t];
            next_tokens[next * width + step + 1] = v;
            next_scores[next * width + step] = best[c];
            parents[next++] = r;
        }
        int64_t *swap_tokens = tokens; tokens = next_tokens; next_tokens = swap_tokens;
        float *swap_scores = scores; scores = next_scores; next_scores = swap_scores;
        /* the caches follow each new hypothesis's parent (positions 0 .. step) */
        for (int64_t l = 0; l < Dec->n_layers; ++l) {
            const fp_layer *L = Dec->layers[l];
            const int64_t slab = L->heads * capacity * L->head_dim, filled = (step + 1) * L->head_dim;
            float *caches[2] = {keys[l], values[l]};
            for (int64_t which = 0; which < 2; ++which) {
                float *cache = caches[which];
                for (int64_t r = 0; r < rows; ++r)
                    for (int64_t h = 0; h < L->heads; ++h)
                        memcpy(cache_copy + (r * L->heads + h) * filled, cache + r * slab + h * capacity * L->head_dim,
                               filled * sizeof(float));
                for (int64_t r = 0; r < next; ++r)
                    for (int64_t h = 0; h < L->heads; ++h)
                        memcpy(cache + r * slab + h * capacity * L->head_dim,
                               cache_copy + (parents[r] * L->heads + h) * filled, filled * sizeof(float));
            }
        }
        rows = next;
    }
    return finished;
}
