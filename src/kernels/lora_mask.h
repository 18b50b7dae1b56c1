// LoRA dropout's mask as a pure function, shared by the CPU adapters (model/lora.cpp) and the
// CUDA kernels (kernels/cuda/lora.cu), so that both devices drop the same elements: element i of
// a site's input in one micro-batch is kept with probability 1 - p, decided by a counter-based
// hash (splitmix64's finaliser) of (seed, micro-batch, site, i). Nothing is stored: forward,
// recompute and backward ask again and get the same answer.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(MEMTRAIN_CUDA_SIM)
#define MT_LORA_HD __host__ __device__
#else
#define MT_LORA_HD
#endif

namespace memtrain::lora_mask {

MT_LORA_HD inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The key of site `site`'s mask in micro-batch `micro_batch`.
MT_LORA_HD inline uint64_t site_key(uint64_t seed, uint64_t micro_batch, uint64_t site) {
    return mix64(seed ^ mix64(micro_batch * 0x9E3779B97F4A7C15ull + site));
}

// Element i's factor: 0 (dropped, with probability p) or keep_scale = 1 / (1 - p).
MT_LORA_HD inline float factor(uint64_t key, uint64_t i, double p, float keep_scale) {
    const double u = (double)(mix64(key + i) >> 11) * (1.0 / 9007199254740992.0);
    return u < p ? 0.0f : keep_scale;
}

}  // namespace memtrain::lora_mask
