/* The dot product of the paged engine's C kernels, in one fixed order: LANES partial sums,
   element i going to sum i % LANES, added in a fixed tree. Its bits depend on n and the values
   only (not on the machine's vector width: the kernels are built with -ffp-contract=off, so
   nothing is fused or reassociated). */

#ifndef HYBRID_PD_LANES_DOT_H
#define HYBRID_PD_LANES_DOT_H

#include <stdint.h>

#define LANES 8

static float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++)
            acc[j] += a[i + j] * b[i + j];
    for (int j = 0; i + j < n; j++)
        acc[j] += a[i + j] * b[i + j];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

#endif
