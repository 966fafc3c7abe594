/* Matrix products of a few rows (decoder steps at batch 1 and beams), one thread: int8 x int8 -> float32 and
 * float32.
 *
 * int8: y[m, n] = (sum_k q[m, k] w[n, k]) * xs[m] * ws[n] + b[n], where q = round(x / xs) with
 * xs = max|x[m]| / 127 (one symmetric scale per input row, round half to even) and w int8 with one scale per
 * output row.
 *
 * Why not torch's own int8 kernel: fbgemm's dynamic linear quantizes, packs and dispatches at every call, which
 * at one row costs more than the float32 product; this kernel reads each weight byte once a call and does
 * nothing else. Loaded by kernels/native/__init__.py.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels.h"

/* Each row of x (M, K) as int8 q (M, Kp), zero padded to Kp, and its scale; a row of zeros gets scale 1. The
 * AVX2 path does each element's arithmetic as the scalar one (the same max, product, round half to even and
 * clamp to +-127: clamping before or after rounding to the integer bounds is the same), 32 at a time. */
void fp_quantize_rows(const float *x, int64_t M, int64_t K, int64_t Kp, int8_t *q, float *scales) {
    for (int64_t m = 0; m < M; ++m) {
        const float *row = x + m * K;
        float amax = 0.0f;
        int64_t k = 0;
#if defined(__AVX2__)
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 amaxes = _mm256_setzero_ps();
        for (; k + 8 <= K; k += 8) amaxes = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(row + k)), amaxes);
        float lanes[8];
        _mm256_storeu_ps(lanes, amaxes);
        for (int i = 0; i < 8; ++i) amax = lanes[i] > amax ? lanes[i] : amax;
#endif
        for (; k < K; ++k) {
            float a = fabsf(row[k]);
            amax = a > amax ? a : amax;
        }
        float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
        float inverse = 1.0f / scale;
        int8_t *out = q + m * Kp;
        k = 0;
#if defined(__AVX2__)
        const __m256 factor = _mm256_set1_ps(inverse), top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-127.0f);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
#define QUANTIZED(offset)                                                                                       \
    _mm256_cvtps_epi32(_mm256_round_ps(                                                                         \
        _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(row + k + (offset)), factor), bottom), top),  \
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
        for (; k + 32 <= K; k += 32) {
            const __m256i low = _mm256_packs_epi32(QUANTIZED(0), QUANTIZED(8));
            const __m256i high = _mm256_packs_epi32(QUANTIZED(16), QUANTIZED(24));
            _mm256_storeu_si256((__m256i *)(out + k),
                                _mm256_permutevar8x32_epi32(_mm256_packs_epi16(low, high), order));
        }
#undef QUANTIZED
#endif
        for (; k < K; ++k) {
            float v = nearbyintf(row[k] * inverse);
            out[k] = (int8_t)(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
        }
        for (k = K; k < Kp; ++k) out[k] = 0;
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

/* 32 products a . b summed into acc's eight int32 lanes, given |a| (maddubs takes one unsigned factor: |a| and
 * b with a's sign, so each pair sum stays within int16: 2 * 127 * 127). */
static inline __m256i dot32(__m256i a_abs, __m256i a, __m256i b, __m256i acc) {
    __m256i products = _mm256_maddubs_epi16(a_abs, _mm256_sign_epi8(b, a));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(products, _mm256_set1_epi16(1)));
}
#endif

#if defined(FP_VNNI)
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
    __m256 even[6], odd[6];
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

/* y (M, N) = x (M, K) w^T (N, K) + b, float32, each weight row read once for every six input rows, and once
 * for the last one to five (a beam of five, a block of blockwise decoding, a double-token pair), so that a few
 * rows cost about one row's weight reading (MKL's sgemm repacks the weight on every call at a few rows). Each
 * output's arithmetic is the same whatever the grouping. */
void fp_float_gemm(const float *x, int64_t M, const float *w, int64_t N, int64_t K, const float *bias, float *y) {
    const int64_t K8 = K / 8 * 8;
    for (int64_t n = 0; n < N; ++n) {
        const float *wn = w + n * K;
        const float b = bias ? bias[n] : 0.0f;
        int64_t m = 0;
#if defined(__AVX2__)
        for (; m + 6 <= M; m += 6) float_rows_dot(x, m, K, K8, wn, b, y, N, n, 6);
        switch (M - m) {  /* (a constant R each, so that the accumulators stay in registers) */
            case 5: float_rows_dot(x, m, K, K8, wn, b, y, N, n, 5); break;
            case 4: float_rows_dot(x, m, K, K8, wn, b, y, N, n, 4); break;
            case 3: float_rows_dot(x, m, K, K8, wn, b, y, N, n, 3); break;
            case 2: float_rows_dot(x, m, K, K8, wn, b, y, N, n, 2); break;
            case 1: float_rows_dot(x, m, K, K8, wn, b, y, N, n, 1); break;
        }
#else
        for (; m < M; ++m) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * wn[k];
            y[m * N + n] = s + b;
        }
#endif
    }
}
