/* The causal depthwise conv of one decode step, on fp32 conv states in their own pages.

   Each request r keeps, per channel ch, the last K - 1 inputs (oldest first) in its conv page
   page_ids[r] ([channels, K - 1]). With the step's new input x[r, ch]:

       out[r, ch] = ((s[0] * w[0] + s[1] * w[1]) + ...) + x[r, ch] * w[K - 1]  (+ bias[ch])
       s          = s[1..K-2], x[r, ch]  (the window moves on by one, in place)

   The sum starts from zero and adds the products in window order, each rounding once (built
   with -ffp-contract=off): the order of the torch path's sum over the window. The state moves
   on in its page, the bytes the transfer reads and writes, so nothing is gathered out of the
   pages or scattered back. A request's bits depend on its own inputs only.

   Every page id is checked before anything is computed: returns 0, or BAD_PAGE (an id outside
   0..page_count-1) with nothing written. */

#include <stddef.h>
#include <stdint.h>

enum { BAD_PAGE = 1 };

int64_t conv_step_in_pages(float *pages, int64_t page_stride, int64_t page_count, const int64_t *page_ids,
                           int64_t requests, int64_t channels, int64_t width, const float *x, int64_t x_stride,
                           const float *weight, const float *bias, float *out) {
    for (int64_t r = 0; r < requests; r++)
        if (page_ids[r] < 0 || page_ids[r] >= page_count)
            return BAD_PAGE;
    int64_t kept = width - 1;
    for (int64_t r = 0; r < requests; r++) {
        float *state = pages + page_ids[r] * page_stride;
        const float *xr = x + r * x_stride;
        float *o = out + r * channels;
        for (int64_t ch = 0; ch < channels; ch++) {
            float *s = state + ch * kept;
            const float *w = weight + ch * width;
            float newest = xr[ch];
            float sum = 0.0f;
            for (int64_t k = 0; k < kept; k++)
                sum += s[k] * w[k];
            sum += newest * w[kept];
            if (bias != NULL)
                sum += bias[ch];
            for (int64_t k = 0; k + 1 < kept; k++)
                s[k] = s[k + 1];
            if (kept > 0)
                s[kept - 1] = newest;
            o[ch] = sum;
        }
    }
    return 0;
}
