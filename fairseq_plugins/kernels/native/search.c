/* A whole search in one call: a sentence's greedy search (fp_greedy_search) and fairseq's beam search over a batch
 * of sentences (fp_beam_search), the decoder's every step (embedding, layers, final norm, output layer,
 * log-softmax) and the search's bookkeeping in C. */

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
    int64_t v = 0;
#if defined(__AVX2__)
    /* (max_ps returns its second operand when either is NaN: NaNs are skipped, as the scalar loop skips them) */
    __m256 tops = _mm256_set1_ps(-INFINITY);
    for (; v + 8 <= n; v += 8) tops = _mm256_max_ps(_mm256_loadu_ps(x + v), tops);
    float lane_tops[8];
    _mm256_storeu_ps(lane_tops, tops);
    for (int i = 0; i < 8; ++i) top = lane_tops[i] > top ? lane_tops[i] : top;
#endif
    for (; v < n; ++v) top = x[v] > top ? x[v] : top;
    float sum = 0.0f;
    v = 0;
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

/* The decoder's input at position p for `token`: its scaled embedding plus position p's (the last one past the
 * table's end), into row (D floats). */
static inline void embed(const fp_decoder *Dec, int64_t token, int64_t p, float *row) {
    const int64_t D = Dec->dim;
    const float *embedding = Dec->embed_tokens + token * D;
    for (int64_t d = 0; d < D; ++d) row[d] = Dec->embed_scale * embedding[d];
    if (Dec->positions) {
        const float *position = Dec->positions + (p < Dec->n_positions ? p : Dec->n_positions - 1) * D;
        for (int64_t d = 0; d < D; ++d) row[d] = row[d] + position[d];
    }
}

/* The decoder at step `step` on `rows` hypotheses, whose last tokens are previous[r]: x (rows, D) the embeddings,
 * then every layer (keys/values/cross as for fp_decoder_layer_step, hypothesis r in cache row cache_rows[r] and
 * source row source_rows[r], or row r where NULL, its prefix's positions where slots say), the final norm;
 * logits (rows, V) the output layer's. */
static void decode_rows(const fp_decoder *Dec, const int64_t *previous, int64_t rows, int64_t step,
                        float *const *keys, float *const *values, int64_t capacity, const float *const *cross_keys,
                        const float *const *cross_values, int64_t S, const uint8_t *source_attend,
                        const int64_t *cache_rows, const int64_t *source_rows, const int64_t *slots, float *x,
                        float *logits, float *layer_scratch, int8_t *qbuf, float *sbuf) {
    const int64_t D = Dec->dim;
    for (int64_t r = 0; r < rows; ++r) embed(Dec, previous[r], step, x + r * D);
    for (int64_t l = 0; l < Dec->n_layers; ++l)
        fp_decoder_layer_step(Dec->layers[l], x, rows, keys[l], values[l], capacity, step, cross_keys[l],
                              cross_values[l], S, source_attend, NULL, layer_scratch, qbuf, sbuf, 1, 1, cache_rows,
                              source_rows, slots);
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
        decode_rows(Dec, &previous, 1, step, keys, values, capacity, cross_keys, cross_values, S, NULL, NULL, NULL,
                    NULL, x, logits, layer_scratch, qbuf, sbuf);
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

/* ---- beam search of a batch of sentences, every step in C ------------------------------------------------
 *
 * fairseq's SequenceGenerator with its BeamSearch, step for step, each sentence as it searches alone: the same
 * step rules as the greedy search above; at step 0 only the first hypothesis (all are alike); the 2 * beam best
 * (hypothesis, token) candidates by cumulative score (the first of equal scores wins); of the first `beam` of
 * them, those ending in the end token (a finite score) are finished hypotheses, kept while fewer than `beam`
 * are; the first `beam` candidates that are not are the next step's hypotheses; a sentence stops when `beam`
 * hypotheses are finished or at max_len (the batch's: fairseq's limit is the batch's). The sentences still
 * searching step together: their hypotheses are the rows of one decoder pass, each reading its own cache rows
 * and its sentence's source, so a sentence that stops moves nothing (fairseq's batch shrinks instead). Nor does a
 * hypothesis that continues another: each writes its positions into its own cache row, and a table of slots says
 * which row holds each earlier position of its prefix, so following a parent copies step + 1 indices, not the
 * parent's keys and values (fairseq reorders its caches every step). */

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

/* One hypothesis's candidates (logits row, log-softmax shift, cumulative score `history` or none at step 0)
 * offered to keep_best in index order, as indices base + v. Once k are kept, a block of 8 words that holds no
 * special word (eos, pad, unk: their rules are not monotone in the logit) is skipped when no logit in it can
 * beat the k-th score: the bound is loosened by far more than the rounding of (logit - shift) + history, so
 * only candidates keep_best would refuse are skipped, and the kept ones are exactly the full scan's. */
static void offer_row(const float *row, int64_t V, float shift, float history, int has_history, int64_t base,
                      int64_t step, int64_t eos, int64_t pad, int64_t unk, float unk_penalty, int64_t min_len,
                      int64_t max_len, float *best, int64_t *best_index, int64_t k, int64_t *count) {
    int64_t v = 0;
#define OFFER(word)                                                                                             \
    do {                                                                                                        \
        const float lp = ruled(row[word] - shift, word, step, eos, pad, unk, unk_penalty, min_len, max_len);    \
        keep_best(has_history ? lp + history : lp, base + (word), best, best_index, k, count);                  \
    } while (0)
#if defined(__AVX2__)
    for (; v < V && *count < k; ++v) OFFER(v);
    for (; v + 8 <= V; v += 8) {
        const int special = (eos >= v && eos < v + 8) || (pad >= v && pad < v + 8) || (unk >= v && unk < v + 8);
        if (!special) {
            const float floor = best[k - 1], slack = 1e-4f * (fabsf(floor) + fabsf(history) + fabsf(shift) + 1.0f);
            const float bound = floor - (has_history ? history : 0.0f) + shift - slack;
            const int above = _mm256_movemask_ps(
                _mm256_cmp_ps(_mm256_loadu_ps(row + v), _mm256_set1_ps(bound), _CMP_GT_OQ));
            if (!above) continue;
        }
        for (int64_t w = v; w < v + 8; ++w) OFFER(w);
    }
#endif
    for (; v < V; ++v) OFFER(v);
#undef OFFER
}

/* `sentences` sentences of up to `beam` hypotheses each; hypothesis j of sentence s lives in cache row
 * s * beam + j. keys/values[l]: (sentences * beam, heads, capacity, head_dim), capacity > max_len;
 * cross_keys/values[l]: (sentences, heads, S, head_dim); source_attend: (sentences, S), 1 where a source token is
 * (fairseq masks the padding of a batch's shorter sources), or NULL; beam <= 32. hist_tokens, hist_scores: room
 * for sentences * 2 * beam * (max_len + 2) each (each sentence's hypotheses' tokens and cumulative scores, this
 * step's and the next's). out_tokens, out_cumulative: room for sentences * beam * (max_len + 1) each (sentence
 * s's finished hypothesis h: its tokens, end token included, and its cumulative score after each, from
 * (s * beam + h) * (max_len + 1)); out_lengths: sentences * beam; out_counts: sentences (how many each
 * finished, in the order fairseq finalises them). scratch: R * (6 D + V + ffn) + 2 * beam + max(capacity, S)
 * floats with R = sentences * beam; slots: R * capacity int64 (fp_decoder_layer_step's); slot_copy: beam *
 * capacity int64; qbuf: R * max(width) bytes; sbuf: R floats; rows: 3 * R + sentences int64. */
void fp_beam_search(const fp_decoder *Dec, float *const *keys, float *const *values, int64_t capacity,
                    const float *const *cross_keys, const float *const *cross_values, int64_t S,
                    const uint8_t *source_attend, int64_t sentences, int64_t beam, int64_t bos, int64_t eos,
                    int64_t pad, int64_t unk, float unk_penalty, int64_t min_len, int64_t max_len,
                    int64_t *hist_tokens, float *hist_scores, int64_t *out_tokens, float *out_cumulative,
                    int64_t *out_lengths, int64_t *out_counts, float *scratch, int64_t *slots, int64_t *slot_copy,
                    int8_t *qbuf, float *sbuf, int64_t *rows) {
    const int64_t D = Dec->dim, V = Dec->vocab, width = max_len + 2, K = 2 * beam, R = sentences * beam;
    const int64_t share = 2 * beam * width; /* a sentence's part of hist_tokens / hist_scores */
    float *x = scratch, *logits = x + R * D, *best = logits + R * V, *layer_scratch = best + K;
    int64_t *cache_rows = rows, *source_rows = rows + R, *previous = rows + 2 * R, *live = rows + 3 * R;
    int64_t best_index[64]; /* K <= 64: beam <= 32 (checked by the caller) */
    int64_t parents[32];
    int64_t current = 0; /* which half of each sentence's history is this step's */
    int64_t searching = sentences;
    for (int64_t s = 0; s < sentences; ++s) {
        out_counts[s] = 0;
        live[s] = 1; /* step 0: the first hypothesis only */
        hist_tokens[s * share] = bos;
    }
    for (int64_t step = 0; step <= max_len && searching > 0; ++step) {
        /* the rows of this step: every hypothesis of the sentences still searching */
        int64_t n = 0;
        for (int64_t s = 0; s < sentences; ++s) {
            if (out_counts[s] < 0) continue; /* (stopped: -1 - its count) */
            const int64_t *tokens = hist_tokens + s * share + current * beam * width;
            for (int64_t j = 0; j < live[s]; ++j, ++n) {
                cache_rows[n] = s * beam + j;
                slots[cache_rows[n] * capacity + step] = cache_rows[n]; /* (this step's position: its own row) */
                source_rows[n] = s;
                previous[n] = tokens[j * width + step];
            }
        }
        decode_rows(Dec, previous, n, step, keys, values, capacity, cross_keys, cross_values, S, source_attend,
                    cache_rows, source_rows, slots, x, logits, layer_scratch, qbuf, sbuf);
        int64_t first_row = 0;
        for (int64_t s = 0; s < sentences; ++s) {
            if (out_counts[s] < 0) continue;
            int64_t *tokens = hist_tokens + s * share + current * beam * width;
            int64_t *next_tokens = hist_tokens + s * share + (1 - current) * beam * width;
            float *scores = hist_scores + s * share + current * beam * width;
            float *next_scores = hist_scores + s * share + (1 - current) * beam * width;
            const int64_t hypotheses = live[s];
            const float *sentence_logits = logits + first_row * V;
            first_row += hypotheses;
            /* log-softmax, the rules, the cumulative score; the 2 * beam best candidates */
            const int64_t k = K < hypotheses * V - 1 ? K : hypotheses * V - 1;
            int64_t count = 0;
            for (int64_t r = 0; r < hypotheses; ++r) {
                const float *row = sentence_logits + r * V;
                offer_row(row, V, log_normalizer(row, V), step > 0 ? scores[r * width + step - 1] : 0.0f, step > 0,
                          r * V, step, eos, pad, unk, unk_penalty, min_len, max_len, best, best_index, k, &count);
            }
            /* finished hypotheses among the first `beam` candidates */
            int64_t finished = out_counts[s];
            for (int64_t c = 0; c < beam && c < count; ++c) {
                const int64_t r = best_index[c] / V, v = best_index[c] % V;
                if (v != eos || best[c] == -INFINITY || finished >= beam) continue;
                int64_t *hypothesis = out_tokens + (s * beam + finished) * (max_len + 1);
                float *cumulative = out_cumulative + (s * beam + finished) * (max_len + 1);
                for (int64_t t = 0; t < step; ++t) {
                    hypothesis[t] = tokens[r * width + t + 1];
                    cumulative[t] = scores[r * width + t];
                }
                hypothesis[step] = eos;
                cumulative[step] = best[c];
                out_lengths[s * beam + finished++] = step + 1;
            }
            out_counts[s] = finished;
            if (finished == beam || step == max_len) {
                out_counts[s] = -1 - finished;
                --searching;
                continue;
            }
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
            live[s] = next;
            /* each new hypothesis's prefix is its parent's: the parent's slots (positions 0 .. step) */
            int64_t *sentence_slots = slots + s * beam * capacity;
            for (int64_t j = 0; j < next; ++j)
                memcpy(slot_copy + j * capacity, sentence_slots + parents[j] * capacity, (step + 1) * sizeof(int64_t));
            for (int64_t j = 0; j < next; ++j)
                memcpy(sentence_slots + j * capacity, slot_copy + j * capacity, (step + 1) * sizeof(int64_t));
        }
        current = 1 - current;
    }
    for (int64_t s = 0; s < sentences; ++s)
        if (out_counts[s] < 0) out_counts[s] = -1 - out_counts[s];
}

/* ---- blockwise parallel decoding of one sentence, every iteration in C --------------------------------------
 *
 * Stern et al. (2018) with exact acceptance, as the fast step's BlockwiseGenerator (blockwise/generator.py) runs it
 * at batch 1, in one call: p_1 (the decoder itself) picks the next token under fairseq's rules (its constrained
 * argmax); heads 2..k, at the same position, propose the k - 1 tokens after it; the block (p_1's token and the
 * proposals) goes through the decoder as the rows of one pass, causal among themselves, each weight read once;
 * p_1 at block position i verifies the proposal at i + 1 (exactly its constrained argmax, and not forbidden);
 * the longest verified prefix is kept (cut after an end token), the rejected tail leaves the cache (the cache
 * just ends earlier), and the heads run at the last kept position for the next block. The output is greedy
 * decoding's; each token's score is p_1's constrained logit minus the raw row's log-normalizer. */


/* p_1's constrained argmax of one row of raw logits predicting output token `step`, and the row's log-normalizer. */
static int64_t constrained_argmax(const float *row, int64_t V, int64_t step, int64_t eos, int64_t pad, int64_t unk,
                                  float unk_penalty, int64_t min_len, int64_t max_len, float *best, float *normalizer) {
    int64_t choice = -1;
    float top = -INFINITY;
    for (int64_t v = 0; v < V; ++v) {
        const float c = ruled(row[v], v, step, eos, pad, unk, unk_penalty, min_len, max_len);
        if (choice < 0 || c > top) { choice = v; top = c; }
    }
    *best = top;
    *normalizer = log_normalizer(row, V);
    return choice;
}

/* The heads' proposals after the features x (D) of the last kept position: the argmax of each head's logits over
 * its words, pad never. hidden: fc1's rows; states: n_heads * D; logits: n_heads * projection rows. */
static void propose(const fp_proposal_heads *H, const float *x, int64_t D, int64_t pad, int64_t *proposals,
                    float *hidden, float *states, float *logits, int8_t *qbuf, float *sbuf) {
    fp_matrix_product(&H->fc1, x, 1, hidden, qbuf, sbuf);
    for (int64_t i = 0; i < H->fc1.out; ++i) hidden[i] = hidden[i] > 0.0f ? hidden[i] : 0.0f;
    for (int64_t j = 0, head = 0; j < H->n_fc2; ++j) {
        fp_matrix_product(H->fc2 + j, hidden + H->fc2_offsets[j], 1, states + head * D, qbuf, sbuf);
        head += H->fc2[j].out / D;
    }
    for (int64_t h = 0; h < H->n_heads; ++h)
        for (int64_t d = 0; d < D; ++d) states[h * D + d] += x[d];
    const int64_t W = H->projection.out;
    fp_matrix_product(&H->projection, states, H->n_heads, logits, qbuf, sbuf);
    for (int64_t h = 0; h < H->n_heads; ++h) {
        const float *row = logits + h * W;
        int64_t choice = -1;
        float top = -INFINITY;
        for (int64_t v = 0; v < W; ++v) {
            const float c = (v == pad || row[v] != row[v]) ? -INFINITY : row[v];
            if (choice < 0 || c > top) { choice = v; top = c; }
        }
        proposals[h] = choice;
    }
}

/* The block's m tokens at cache positions t .. t + m - 1 through the decoder, causal among themselves: x (m, D) the
 * features after the final norm (the output layer is the caller's, a row at a time). */
static void decode_block(const fp_decoder *Dec, const int64_t *block, int64_t m, int64_t t, float *const *keys,
                         float *const *values, int64_t capacity, const float *const *cross_keys,
                         const float *const *cross_values, int64_t S, const uint8_t *source_attend, float *x,
                         float *layer_scratch, int8_t *qbuf, float *sbuf) {
    const int64_t D = Dec->dim;
    for (int64_t i = 0; i < m; ++i) embed(Dec, block[i], t + i, x + i * D);
    for (int64_t l = 0; l < Dec->n_layers; ++l)
        fp_decoder_layer_step(Dec->layers[l], x, m, keys[l], values[l], capacity, t, cross_keys[l], cross_values[l],
                              S, source_attend, NULL, layer_scratch, qbuf, sbuf, m, 1, NULL, NULL, NULL);
    if (Dec->final_norm_weight)
        fp_layer_norm(x, m, D, Dec->final_norm_weight, Dec->final_norm_bias, Dec->final_norm_eps);
}

/* One sentence's blockwise decoding with blocks of k = 1 + H->n_heads tokens (k <= 64). keys/values[l]: (1, heads,
 * capacity, head_dim) each, capacity >= max_len + k + 1; cross_keys/values[l]: (1, heads, S, head_dim). tokens,
 * scores: room for max_len + 1 (written: the output, end token included, and each token's score). counts
 * (written): [0] iterations (predict-verify-accept rounds, the last one, which only predicts, included), [1]
 * decoder passes (the first, on the start token, included). scratch: k * (D + V + 5 D + ffn) + heads' hidden +
 * n_heads * (D + projection rows) + max(capacity, S) floats; qbuf: k * widest input bytes; sbuf: k floats.
 * Returns the number of tokens written. */
int64_t fp_blockwise_search(const fp_decoder *Dec, const fp_proposal_heads *H, float *const *keys,
                            float *const *values, int64_t capacity, const float *const *cross_keys,
                            const float *const *cross_values, int64_t S, const uint8_t *source_attend, int64_t bos,
                            int64_t eos, int64_t pad, int64_t unk, float unk_penalty, int64_t min_len, int64_t max_len, int64_t *tokens,
                            float *scores, int64_t *counts, float *scratch, int8_t *qbuf, float *sbuf) {
    const int64_t D = Dec->dim, V = Dec->vocab, k = 1 + H->n_heads;
    float *x = scratch, *logits = x + k * D, *hidden = logits + k * V, *states = hidden + H->fc1.out;
    float *head_logits = states + H->n_heads * D, *layer_scratch = head_logits + H->n_heads * H->projection.out;
    int64_t block[64], choice[64];
    float best[64], normalizer[64];
    counts[0] = counts[1] = 0;
    /* the first pass, on the start token at position 0: p_1's choice of output token 0, the heads' proposals */
    block[0] = bos;
    decode_block(Dec, block, 1, 0, keys, values, capacity, cross_keys, cross_values, S, source_attend, x, layer_scratch,
                 qbuf, sbuf);
    fp_matrix_product(&Dec->output, x, 1, logits, qbuf, sbuf);
    counts[1] = 1;
    float first_best, first_normalizer;
    int64_t first = constrained_argmax(logits, V, 0, eos, pad, unk, unk_penalty, min_len, max_len, &first_best,
                                       &first_normalizer);
    propose(H, x, D, pad, block + 1, hidden, states, head_logits, qbuf, sbuf);
    int64_t n = 0; /* output tokens kept; the cache holds the start token and them: n + 1 positions */
    for (;;) {
        counts[0] += 1;
        if (first == eos) { /* the certain next token ends the output: no pass */
            tokens[n] = eos;
            scores[n++] = first_best - first_normalizer;
            return n;
        }
        /* verify: p_1 at block position i (output token n + 1 + i) checks the proposal at i + 1 */
        block[0] = first;
        decode_block(Dec, block, k, n + 1, keys, values, capacity, cross_keys, cross_values, S, source_attend, x,
                     layer_scratch, qbuf, sbuf);
        counts[1] += 1;
        /* p_1's output a position at a time, only while the proposals are verified: the positions after the first
         * rejected proposal are never read (at batch 1 the int8 output product costs its arithmetic, a row as much
         * as the decoder's layers) */
        int64_t accepted = 1;
        for (int64_t i = 0; i < k; ++i) {
            fp_matrix_product(&Dec->output, x + i * D, 1, logits, qbuf, sbuf);
            choice[i] = constrained_argmax(logits, V, n + 1 + i, eos, pad, unk, unk_penalty, min_len, max_len, best + i,
                                           normalizer + i);
            if (i + 1 == k || block[i + 1] != choice[i] || !(best[i] > -INFINITY)) break;
            if (block[++accepted - 1] == eos) break; /* (an accepted end token: nothing after it is read) */
        }
        int64_t finished = 0;
        for (int64_t j = 0; j < accepted; ++j)
            if (block[j] == eos) { accepted = j + 1; finished = 1; break; }
        tokens[n] = first;
        scores[n] = first_best - first_normalizer;
        for (int64_t j = 1; j < accepted; ++j) {
            tokens[n + j] = block[j];
            scores[n + j] = best[j - 1] - normalizer[j - 1];
        }
        n += accepted;
        if (finished) return n;
        /* predict at the last kept position (the rejected tail's cache positions are overwritten next) */
        const int64_t last = accepted - 1;
        first = choice[last];
        first_best = best[last];
        first_normalizer = normalizer[last];
        propose(H, x + last * D, D, pad, block + 1, hidden, states, head_logits, qbuf, sbuf);
    }
}
