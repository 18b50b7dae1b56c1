// Dropout masks as pure functions, shared by the CPU and CUDA kernels so that both devices drop
// the same elements. An element is kept with probability 1 - p, decided by a counter-based hash
// (splitmix64's finaliser) of (seed, a row key, a site, the element's index). Nothing is stored:
// the forward, a recompute and the backward ask again and get the same answer, so dropout costs
// no activation memory and remat stays bitwise.
//
// Two users:
// - LoRA's adapter dropout (model/lora.cpp, model/cuda_lora.cpp): the row key is the run's
//   micro-batch index and the site the adapter; element i is i of the site's (N, in) input.
// - model.dropout (model/gpt.cpp, kernels/cpu/dropout.cpp): the row key is the sequence's ordinal
//   in the run (step, micro-batch, data-parallel rank and row: the same sequence gets the same
//   mask at every world size) and the site one of the embedding's, or a block's attention
//   probabilities and two residual branches; element i is its index inside one sequence.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(MEMTRAIN_CUDA_SIM)
#define MT_DROP_HD __host__ __device__
#else
#define MT_DROP_HD
#endif

namespace memtrain::dropout_mask {

MT_DROP_HD inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The key of site `site`'s mask for row key `row` (a micro-batch, or a sequence).
MT_DROP_HD inline uint64_t site_key(uint64_t seed, uint64_t row, uint64_t site) {
    return mix64(seed ^ mix64(row * 0x9E3779B97F4A7C15ull + site));
}

// Element i's factor: 0 (dropped, with probability p) or keep_scale = 1 / (1 - p).
MT_DROP_HD inline float factor(uint64_t key, uint64_t i, double p, float keep_scale) {
    const double u = (double)(mix64(key + i) >> 11) * (1.0 / 9007199254740992.0);
    return u < p ? 0.0f : keep_scale;
}

}  // namespace memtrain::dropout_mask

namespace memtrain {

// One site's dropout over a micro-batch of sequences: sequence b of the micro-batch is the run's
// sequence first + b. A kernel given a null mask, or one with p = 0, drops nothing.
struct DropoutMask {
    double p = 0;
    uint64_t seed = 0;
    uint64_t first = 0;  // the ordinal of the micro-batch's first sequence
    uint64_t site = 0;

    MT_DROP_HD bool on() const { return p > 0; }
    MT_DROP_HD float keep_scale() const { return (float)(1.0 / (1.0 - p)); }
    // The key of sequence b's mask, then element i's factor inside that sequence.
    MT_DROP_HD uint64_t key(int64_t b) const {
        return dropout_mask::site_key(seed, first + (uint64_t)b, site);
    }
    MT_DROP_HD float factor(uint64_t key, uint64_t i) const {
        return dropout_mask::factor(key, i, p, keep_scale());
    }
};

}  // namespace memtrain
