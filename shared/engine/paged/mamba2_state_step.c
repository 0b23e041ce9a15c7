/* The Mamba2 recurrence of one decode step, on fp32 SSM states in their own pages.

   For each request r (its state page page_ids[r]), head h and head channel p, with the
   head's group g = h / heads_per_group:

       state[h, p, :] = state[h, p, :] * decay[r, h] + (dt[r, h] * b[r, g, :]) * x[r, h, p]
       y[r, h, p]     = dot(state[h, p, :], c[r, g, :]) + x[r, h, p] * d_skip[h]

   The state is updated in place, in the page the transfer reads and writes, so nothing is
   gathered out of the pages or scattered back. Each product and sum rounds once, in the order
   written (built with -ffp-contract=off: no fused multiply-adds), which for the state is
   transformers' order; the dot product keeps LANES partial sums, element i going to sum
   i % LANES, added in a fixed tree. A request's bits depend on its own inputs only: not on the
   other requests, their count, the machine's vector width or the thread that runs it.

   Every page id is checked before anything is computed: returns 0, or BAD_PAGE (an id outside
   0..page_count-1) with nothing written. */

#include <stdint.h>

#include "lanes_dot.h"

enum { BAD_PAGE = 1 };

int64_t mamba2_state_step(float *pages, int64_t page_stride, int64_t page_count, const int64_t *page_ids,
                          int64_t requests, int64_t heads, int64_t head_dim, int64_t d_state,
                          int64_t heads_per_group, const float *decay, const float *dt, const float *x,
                          const float *b, const float *c, const float *d_skip, float *y) {
    for (int64_t r = 0; r < requests; r++)
        if (page_ids[r] < 0 || page_ids[r] >= page_count)
            return BAD_PAGE;
    int64_t groups = heads / heads_per_group;
    float dtb[d_state];
    for (int64_t r = 0; r < requests; r++) {
        float *state = pages + page_ids[r] * page_stride;
        for (int64_t h = 0; h < heads; h++) {
            int64_t g = h / heads_per_group;
            const float *bg = b + (r * groups + g) * d_state;
            const float *cg = c + (r * groups + g) * d_state;
            float a = decay[r * heads + h];
            float step = dt[r * heads + h];
            for (int64_t n = 0; n < d_state; n++)
                dtb[n] = step * bg[n];
            for (int64_t p = 0; p < head_dim; p++) {
                float *row = state + (h * head_dim + p) * d_state;
                float xp = x[(r * heads + h) * head_dim + p];
                for (int64_t n = 0; n < d_state; n++)
                    row[n] = row[n] * a + dtb[n] * xp;
                y[(r * heads + h) * head_dim + p] = dot(row, cg, d_state) + xp * d_skip[h];
            }
        }
    }
    return 0;
}
