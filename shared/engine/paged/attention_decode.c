/* A decode step's attention, reading each request's K/V straight from its kernel blocks.

   fa: one attention layer's cache, kernel blocks of [2 (K, V), kv_heads, kernel_block_size,
   head_dim] fp32, `block_stride` floats apart. Request r's token t lies in logical block
   table[r][t / block_size], kernel block (that id) * kernels_per_block + (t % block_size) /
   kernel_block_size, slot t % kernel_block_size. For each request r and query head h (KV head
   h / (heads / kv_heads)), with its query q (already scaled) over tokens 0..lengths[r]-1:

       s_t = dot(q, k_t),  p_t = exp(s_t - max s) / sum_t exp(s_t - max s),  out = sum_t p_t v_t

   Every product and sum rounds once in the order written (built with -ffp-contract=off): dot
   products keep LANES partial sums (element i to sum i % LANES) added in a fixed tree, the
   softmax's sum and the output's sum run over t in order. A request's bits depend on its own
   query and K/V only: not on the other requests, their count or where its blocks lie.

   Every request's length and block ids are checked before anything is computed: returns 0, or
   BAD_LENGTH (a length below 1, or beyond the blocks of its table row) or BAD_BLOCK (a block
   id outside the cache's cache_blocks kernel blocks) with nothing written. */

#include <math.h>
#include <stdint.h>

#include "lanes_dot.h"

enum { BAD_LENGTH = 1, BAD_BLOCK = 2 };

static int64_t check(const int64_t *table, int64_t table_width, const int64_t *lengths, int64_t requests,
                     int64_t block_size, int64_t kernels_per_block, int64_t cache_blocks) {
    for (int64_t r = 0; r < requests; r++) {
        int64_t length = lengths[r];
        if (length < 1 || length > table_width * block_size) /* no sum that could overflow */
            return BAD_LENGTH;
        for (int64_t b = 0; b < (length + block_size - 1) / block_size; b++) {
            int64_t id = table[r * table_width + b];
            if (id < 0 || id >= cache_blocks / kernels_per_block)
                return BAD_BLOCK;
        }
    }
    return 0;
}

int64_t attention_decode(const float *fa, int64_t block_stride, int64_t cache_blocks, const int64_t *table,
                         int64_t table_width, const int64_t *lengths, int64_t requests, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t kernels_per_block,
                         int64_t kernel_block_size, const float *q, float *out, float *scores,
                         int64_t *kernel_blocks) {
    /* scores: room for the longest request's tokens; kernel_blocks: for its kernel blocks */
    int64_t bad = check(table, table_width, lengths, requests, block_size, kernels_per_block, cache_blocks);
    if (bad)
        return bad;
    int64_t rep = heads / kv_heads;
    int64_t head_stride = kernel_block_size * head_dim;
    for (int64_t r = 0; r < requests; r++) {
        const int64_t *blocks = table + r * table_width;
        int64_t length = lengths[r];
        int64_t used = (length + kernel_block_size - 1) / kernel_block_size;
        for (int64_t c = 0; c < used; c++) { /* where the request's kernel blocks start, in token order */
            int64_t within = c * kernel_block_size % block_size;
            kernel_blocks[c] = (blocks[c * kernel_block_size / block_size] * kernels_per_block + within / kernel_block_size) * block_stride;
        }
        for (int64_t h = 0; h < heads; h++) {
            const float *query = q + (r * heads + h) * head_dim;
            float *o = out + (r * heads + h) * head_dim;
            int64_t key_at = (h / rep) * head_stride, value_at = (kv_heads + h / rep) * head_stride;
            float top = -INFINITY;
            for (int64_t c = 0, t = 0; c < used; c++) {
                const float *key = fa + kernel_blocks[c] + key_at;
                for (int64_t slot = 0; slot < kernel_block_size && t < length; slot++, t++) {
                    float s = dot(query, key + slot * head_dim, head_dim);
                    scores[t] = s;
                    if (s > top)
                        top = s;
                }
            }
            float total = 0.0f;
            for (int64_t t = 0; t < length; t++) {
                scores[t] = expf(scores[t] - top);
                total += scores[t];
            }
            for (int64_t d = 0; d < head_dim; d++)
                o[d] = 0.0f;
            for (int64_t c = 0, t = 0; c < used; c++) {
                const float *value = fa + kernel_blocks[c] + value_at;
                for (int64_t slot = 0; slot < kernel_block_size && t < length; slot++, t++) {
                    float p = scores[t] / total;
                    const float *v = value + slot * head_dim;
                    for (int64_t d = 0; d < head_dim; d++)
                        o[d] += p * v[d];
                }
            }
        }
    }
    return 0;
}
