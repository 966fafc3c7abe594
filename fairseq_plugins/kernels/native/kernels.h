/* The native kernels' interface: the structs the Python side mirrors with ctypes (``kernels/native``; the
 * layout test compares every size and offset with fp_struct_layout's) and the functions one role file calls in
 * another. The library is built from every .c file beside this header, at first use (see __init__.py):
 *
 *   products.c        int8 x int8 -> float32 and float32 matrix products of a few rows
 *   layer_step.c      a fairseq transformer decoder layer's incremental step, an encoder layer over a sentence
 *   lattice_search.c  beam search over one scored lattice under a no-repeat-n-gram rule
 *   bytenet_step.c    one decoding step of a ByteNet stack of ReLU residual blocks
 *   search.c          a sentence's greedy search, a batch's beam search (fairseq's rules) over a decoder of such layers
 *   layout.c          the structs' sizes and field offsets, for the layout test
 *
 * One thread, for decoder steps at batch 1 and beams (few rows). Compiled with -ffp-contract=off, so that the
 * float arithmetic is exactly the order the source writes (the tests' references reproduce it). */
#ifndef FAIRSEQ_PLUGINS_KERNELS_H
#define FAIRSEQ_PLUGINS_KERNELS_H

#include <stdint.h>

/* The int8 product's VNNI variant exists where the compiler targets AVX-VNNI or AVX512-VNNI (with -mavx512vl). */
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define FP_VNNI 1
#endif

/* A matrix of a layer: float32 weights, or int8 values with one scale per output row. */
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

/* A transformer layer (an encoder layer leaves the cross-attention members NULL). */
typedef struct {
    fp_matrix qkv, self_out, cross_q, cross_out, fc1, fc2;
    const float *self_norm_weight, *self_norm_bias, *cross_norm_weight, *cross_norm_bias;
    const float *final_norm_weight, *final_norm_bias;
    float self_norm_eps, cross_norm_eps, final_norm_eps, scaling;
    int64_t heads, head_dim, normalize_before, gelu;
} fp_layer;

/* One ByteNet ReLU residual block (Kalchbrenner et al. 2016, Fig. 3 left), float32. */
typedef struct {
    const float *norm_in_weight, *norm_in_bias, *norm_mid_weight, *norm_mid_bias, *norm_out_weight, *norm_out_bias;
    float norm_in_eps, norm_mid_eps, norm_out_eps;
    const float *reduce_weight, *reduce_bias; /* (hidden, channels) */
    const float *conv_weight, *conv_bias;     /* (hidden, hidden * kernel): a conv1d kernel (out, in, k) as it lies */
    const float *expand_weight, *expand_bias; /* (channels, hidden) */
    int64_t channels, hidden, kernel, dilation;
} fp_relu_block;

/* A transformer decoder for a whole search (search.c): its layers, embeddings, final norm and output matrix. */
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

/* The proposal heads 2..k (blockwise/model.py's ProposalHeads, learned heads only): state_j = x + fc2_j(relu(fc1
 * x)) for j < n_heads, fc1 one product to the hidden layer of all of them, fc2_j reading hidden[fc2_offsets[j] ..]
 * (the joint layout: one fc2 of n_heads * D rows reading the whole hidden layer, n_fc2 1; the separate layout: one
 * fc2 a head, each reading its own block); then each state's logits through `projection` (the first proposal
 * words, or the output layer). */
typedef struct {
    fp_matrix fc1;
    const fp_matrix *fc2;
    const int64_t *fc2_offsets;
    int64_t n_fc2, n_heads;
    fp_matrix projection;
} fp_proposal_heads;

/* products.c */
void fp_quantize_rows(const float *x, int64_t M, int64_t K, int64_t Kp, int8_t *q, float *scales);
void fp_int8_gemm(const int8_t *q, const float *xs, int64_t M, const int8_t *w, const float *ws, int64_t N,
                  int64_t Kp, const float *bias, float *y);
#if defined(FP_VNNI)
void fp_int8_gemm_packed(const int8_t *q, const float *xs, int64_t M, const int8_t *wp, const float *ws,
                         const int32_t *corrections, int64_t N, int64_t Kp, const float *bias, float *y);
#endif
void fp_float_gemm(const float *x, int64_t M, const float *w, int64_t N, int64_t K, const float *bias, float *y);

/* layer_step.c: fairseq's LayerNorm over each of M rows of D floats, in place (ByteNet's blocks use it too); a
 * layer's step; x (M, in) -> y (M, out) through a matrix of either kind (q, scales: room for M rows of its width
 * bytes, M floats). */
void fp_layer_norm(float *x, int64_t M, int64_t D, const float *w, const float *b, float eps);
void fp_decoder_layer_step(const fp_layer *L, float *x, int64_t M, float *keys, float *values, int64_t capacity,
                           int64_t t, const float *cross_keys, const float *cross_values, int64_t S,
                           const uint8_t *source_attend, const uint8_t *self_attend, float *scratch, int8_t *qbuf,
                           float *sbuf, int64_t group, int64_t causal, const int64_t *cache_rows,
                           const int64_t *source_rows, const int64_t *slots);
void fp_matrix_product(const fp_matrix *A, const float *x, int64_t M, float *y, int8_t *q, float *scales);

#endif
