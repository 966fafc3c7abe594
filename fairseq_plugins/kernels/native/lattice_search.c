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

#include <math.h>
#include <stdlib.h>

#include "kernels.h"

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
