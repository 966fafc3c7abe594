/* A sentence's whole search in one call: greedy (fp_greedy_search) and fairseq's beam search at batch 1
 * (fp_beam_search), the decoder's every step (embedding, layers, final norm, output layer, log-softmax) and the
 * search's bookkeeping in C. */

#include <math.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels.h"

#if defined(__AVX2__)
/* e^x for 8 floats (Cephes' expf: x = n ln 2 + r, e^r by its degree-5 polynomial, 2^n in the exponent bits;
 * about 1 ulp from expf), for the log-softmax's sum: with a beam of 5 over 8,000 words a step's 40,000 expf calls
 * cost as much as its matrix products. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365447505531f)), _mm256_set1_ps(88.3762626647949f));
    __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                             _mm256_set1_ps(0.5f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(y, x), x), x), _mm256_set1_ps(1.0f));
    __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}
#endif

/* max + log(sum exp(x - max)) of a row: what log-softmax subtracts from each logit. */
static float log_normalizer(const float *x, int64_t n) {
    float top = -INFINITY;
    for (int64_t v = 0; v < n; ++v) top = x[v] > top ? x[v] : top;
    float sum = 0.0f;
    int64_t v = 0;
#if defined(__AVX2__)
    __m256 sums = _mm256_setzero_ps(), shift = _mm256_set1_ps(top);
    for (; v + 8 <= n; v += 8) sums = _mm256_add_ps(sums, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + v), shift)));
    float lanes[8];
    _mm256_storeu_ps(lanes, sums);
    for (int i = 0; i < 8; ++i) sum += lanes[i];
#endif
    for (; v < n; ++v) sum += expf(x[v] - top);
    return top + logf(sum);
}

/* ---- greedy search of one sentence, every step in C ------------------------------------------------------
 *
 * At batch 1 the weights of a small transformer are read in a fraction of a step's time: the rest was the
 * Python around them (embedding, final norm, output layer, log-softmax, fairseq's step rules, the argmax, the
 * bookkeeping), one torch operation at a time. Here the whole search of a sentence is one call, with fairseq's
 * SequenceGenerator rules at beam 1 (the fast step's Python greedy loop, which it replaces where it applies):
 * pad never, unk penalised, no end token before min_len tokens, only the end token at max_len; the cumulative
 * float32 score of the best token a step; the first of equal scores wins (torch.topk's order). */

/* The decoder at step `step` on `rows` hypotheses, whose last tokens are previous[r * stride]: x (rows, D) the
 * embeddings, then every layer (keys/values/cross as for fp_decoder_layer_step), the final norm; logits (rows, V)
 * the output layer's. */
static void decode_rows(const fp_decoder *Dec, const int64_t *previous, int64_t stride, int64_t rows, int64_t step,
                        float *const *keys, float *const *values, int64_t capacity, const float *const *cross_keys,
                        const float *const *cross_values, int64_t S, float *x, float *logits, float *layer_scratch,
                        int8_t *qbuf, float *sbuf) {
    const int64_t D = Dec->dim;
    for (int64_t r = 0; r < rows; ++r) {
        const float *embedding = Dec->embed_tokens + previous[r * stride] * D;
        float *row = x + r * D;
        for (int64_t d = 0; d < D; ++d) row[d] = Dec->embed_scale * embedding[d];
        if (Dec->positions) {
            const float *position = Dec->positions + (step < Dec->n_positions ? step : Dec->n_positions - 1) * D;
            for (int64_t d = 0; d < D; ++d) row[d] = row[d] + position[d];
        }
    }
    for (int64_t l = 0; l < Dec->n_layers; ++l)
        fp_decoder_layer_step(Dec->layers[l], x, rows, keys[l], values[l], capacity, step, cross_keys[l],
                              cross_values[l], S, NULL, NULL, layer_scratch, qbuf, sbuf, 1, 1);
    if (Dec->final_norm_weight)
        fp_layer_norm(x, rows, D, Dec->final_norm_weight, Dec->final_norm_bias, Dec->final_norm_eps);
    fp_matrix_product(&Dec->output, x, rows, logits, qbuf, sbuf);
}

/* fairseq's step rules on token v's log-probability lp at `step`: NaN and pad never, unk penalised, no end
 * token before min_len tokens, only the end token at max_len. */
static inline float ruled(float lp, int64_t v, int64_t step, int64_t eos, int64_t pad, int64_t unk,
                          float unk_penalty, int64_t min_len, int64_t max_len) {
    if (lp != lp) lp = -INFINITY; /* as nan_to_minus_inf_ */
    if (v == pad) lp = -INFINITY;
    if (v == unk) lp -= unk_penalty;
    if (step >= max_len && v != eos) lp = -INFINITY;
    if (step < min_len && v == eos) lp = -INFINITY;
    return lp;
}

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
        decode_rows(Dec, &previous, 0, 1, step, keys, values, capacity, cross_keys, cross_values, S, x, logits,
                    layer_scratch, qbuf, sbuf);
        const float shift = log_normalizer(logits, V); /* log-softmax: x - shift */
        /* the rules, then the best token: the first of the highest (lprob + total) */
        int64_t choice = -1;
        float choice_score = -INFINITY;
        for (int64_t v = 0; v < V; ++v) {
            const float score = ruled(logits[v] - shift, v, step, eos, pad, unk, unk_penalty, min_len, max_len)
                                + total;
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
        decode_rows(Dec, tokens + step, width, rows, step, keys, values, capacity, cross_keys, cross_values, S, x,
                    logits, layer_scratch, qbuf, sbuf);
        /* log-softmax, the rules, the cumulative score; the 2 * beam best candidates */
        const int64_t k = K < rows * V - 1 ? K : rows * V - 1;
        int64_t count = 0;
        for (int64_t r = 0; r < rows; ++r) {
            float *row = logits + r * V;
            const float shift = log_normalizer(row, V);
            const float history = step > 0 ? scores[r * width + step - 1] : 0.0f;
            for (int64_t v = 0; v < V; ++v) {
                const float lp = ruled(row[v] - shift, v, step, eos, pad, unk, unk_penalty, min_len, max_len);
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
