// Token + position embedding on the CPU (the position table is absent under rotary positions).
#include <algorithm>

#include "kernels/cpu/ops.h"

namespace memtrain::cpu {

void embedding_forward(float* out, const int32_t* inp, const float* wte, const float* wpe, int B,
                       int T, int C) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            float* o = out + ((int64_t)b * T + t) * C;
            const float* e = wte + (int64_t)inp[b * T + t] * C;
            if (wpe) {
                const float* p = wpe + (int64_t)t * C;
                for (int i = 0; i < C; i++) o[i] = e[i] + p[i];
            } else {
                for (int i = 0; i < C; i++) o[i] = e[i];
            }
        }
    }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B,
                        int T, int C) {
    // Threads split the channels, so scattered rows of dwte never race and every element is
    // summed in (b, t) order.
    constexpr int kBlock = 32;
    int nblocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
    for (int blk = 0; blk < nblocks; blk++) {
        int i0 = blk * kBlock, i1 = std::min(C, i0 + kBlock);
        for (int b = 0; b < B; b++) {
            for (int t = 0; t < T; t++) {
                const float* d = dout + ((int64_t)b * T + t) * C;
                float* e = dwte + (int64_t)inp[b * T + t] * C;
                for (int i = i0; i < i1; i++) e[i] += d[i];
                if (dwpe) {
                    float* p = dwpe + (int64_t)t * C;
                    for (int i = i0; i < i1; i++) p[i] += d[i];
                }
            }
        }
    }
}

}  // namespace memtrain::cpu
