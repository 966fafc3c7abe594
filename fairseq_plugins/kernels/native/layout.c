/* The structs' sizes and field offsets as this compiler lays them out, for the test that holds the ctypes
 * mirrors in __init__.py to them (a field added, moved or retyped on one side only would otherwise read the
 * wrong bytes, silently). */

#include <stddef.h>

#include "kernels.h"

typedef struct {
    const char *type, *field; /* field NULL: the struct's size */
    int64_t value;
} fp_layout_entry;

#define SIZE(type) {#type, NULL, (int64_t)sizeof(type)}
#define FIELD(type, field) {#type, #field, (int64_t)offsetof(type, field)}

static const fp_layout_entry LAYOUT[] = {
    SIZE(fp_matrix),
    FIELD(fp_matrix, weights), FIELD(fp_matrix, values), FIELD(fp_matrix, scales), FIELD(fp_matrix, bias),
    FIELD(fp_matrix, out), FIELD(fp_matrix, in), FIELD(fp_matrix, width), FIELD(fp_matrix, packed),
    FIELD(fp_matrix, corrections), FIELD(fp_matrix, packed_scales), FIELD(fp_matrix, packed_bias),
    SIZE(fp_layer),
    FIELD(fp_layer, qkv), FIELD(fp_layer, self_out), FIELD(fp_layer, cross_q), FIELD(fp_layer, cross_out),
    FIELD(fp_layer, fc1), FIELD(fp_layer, fc2), FIELD(fp_layer, self_norm_weight), FIELD(fp_layer, self_norm_bias),
    FIELD(fp_layer, cross_norm_weight), FIELD(fp_layer, cross_norm_bias), FIELD(fp_layer, final_norm_weight),
    FIELD(fp_layer, final_norm_bias), FIELD(fp_layer, self_norm_eps), FIELD(fp_layer, cross_norm_eps),
    FIELD(fp_layer, final_norm_eps), FIELD(fp_layer, scaling), FIELD(fp_layer, heads), FIELD(fp_layer, head_dim),
    FIELD(fp_layer, normalize_before), FIELD(fp_layer, gelu),
    SIZE(fp_relu_block),
    FIELD(fp_relu_block, norm_in_weight), FIELD(fp_relu_block, norm_in_bias), FIELD(fp_relu_block, norm_mid_weight),
    FIELD(fp_relu_block, norm_mid_bias), FIELD(fp_relu_block, norm_out_weight),
    FIELD(fp_relu_block, norm_out_bias), FIELD(fp_relu_block, norm_in_eps), FIELD(fp_relu_block, norm_mid_eps),
    FIELD(fp_relu_block, norm_out_eps), FIELD(fp_relu_block, reduce_weight), FIELD(fp_relu_block, reduce_bias),
    FIELD(fp_relu_block, conv_weight), FIELD(fp_relu_block, conv_bias), FIELD(fp_relu_block, expand_weight),
    FIELD(fp_relu_block, expand_bias), FIELD(fp_relu_block, channels), FIELD(fp_relu_block, hidden),
    FIELD(fp_relu_block, kernel), FIELD(fp_relu_block, dilation),
    SIZE(fp_decoder),
    FIELD(fp_decoder, layers), FIELD(fp_decoder, n_layers), FIELD(fp_decoder, embed_tokens),
    FIELD(fp_decoder, embed_scale), FIELD(fp_decoder, positions), FIELD(fp_decoder, n_positions),
    FIELD(fp_decoder, final_norm_weight), FIELD(fp_decoder, final_norm_bias), FIELD(fp_decoder, final_norm_eps),
    FIELD(fp_decoder, output), FIELD(fp_decoder, dim), FIELD(fp_decoder, vocab),
    SIZE(fp_proposal_heads),
    FIELD(fp_proposal_heads, fc1), FIELD(fp_proposal_heads, fc2), FIELD(fp_proposal_heads, fc2_offsets),
    FIELD(fp_proposal_heads, n_fc2), FIELD(fp_proposal_heads, n_heads), FIELD(fp_proposal_heads, projection),
};

/* Entry i of the table (struct name, field name or NULL for the struct's size, offset or size); 0 past its end. */
int fp_struct_layout(int64_t i, const char **type, const char **field, int64_t *value) {
    if (i < 0 || i >= (int64_t)(sizeof(LAYOUT) / sizeof(LAYOUT[0]))) return 0;
    *type = LAYOUT[i].type;
    *field = LAYOUT[i].field;
    *value = LAYOUT[i].value;
    return 1;
}
