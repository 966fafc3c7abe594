/* One decoding step of a ByteNet stack of ReLU residual blocks.
 *
 * Each block (Kalchbrenner et al. 2016, Fig. 3 left) on one new frame a row: LN, ReLU, 1x1 (C -> h), LN, ReLU,
 * masked dilated 1xk (h -> h) over the new frame and the kept ones, LN, ReLU, 1x1 (h -> C), residual. A step in
 * torch operations is about 13 calls a block, whose dispatch costs about a third of the step at batch 1; here
 * the whole stack is one call. */

#include <string.h>

#include "kernels.h"

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
        fp_layer_norm(normed, M, C, B->norm_in_weight, B->norm_in_bias, B->norm_in_eps);
        relu_in_place(normed, M * C);
        fp_float_gemm(normed, M, B->reduce_weight, H, C, B->reduce_bias, reduced);
        fp_layer_norm(reduced, M, H, B->norm_mid_weight, B->norm_mid_bias, B->norm_mid_eps);
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
        fp_layer_norm(convolved, M, H, B->norm_out_weight, B->norm_out_bias, B->norm_out_eps);
        relu_in_place(convolved, M * H);
        fp_float_gemm(convolved, M, B->expand_weight, C, H, B->expand_bias, expanded);
        for (int64_t i = 0; i < M * C; ++i) x[i] += expanded[i];
    }
}

