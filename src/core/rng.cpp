// Parallel, reproducible normal fill (see rng.h).
#include "core/rng.h"

#include <algorithm>

namespace memtrain {

void fill_normal(float* w, std::size_t n, double std, uint64_t seed, std::string_view name) {
    uint64_t stream = 0xCBF29CE484222325ull;  // FNV-1a of the name, mixed with the seed
    for (char c : name) stream = (stream ^ (unsigned char)c) * 0x100000001B3ull;
    uint64_t mix = seed ^ stream;
    stream = splitmix64(mix);
    constexpr std::size_t kBlock = std::size_t{1} << 16;
    const long long blocks = (long long)((n + kBlock - 1) / kBlock);
#pragma omp parallel for schedule(static) if (blocks > 1)
    for (long long b = 0; b < blocks; b++) {
        Rng rng(stream + (uint64_t)b * 0x9E3779B97F4A7C15ull);
        const std::size_t begin = (std::size_t)b * kBlock, end = std::min(n, begin + kBlock);
        for (std::size_t k = begin; k < end; k += 2) {
            const double u1 = ((double)(rng.next_u64() >> 11) + 0.5) * (1.0 / 9007199254740992.0);
            const double u2 = (double)(rng.next_u64() >> 11) * (1.0 / 9007199254740992.0);
            const double r = std::sqrt(-2.0 * std::log(u1)) * std;
            w[k] = (float)(r * std::cos(6.283185307179586 * u2));
            if (k + 1 < end) w[k + 1] = (float)(r * std::sin(6.283185307179586 * u2));
        }
    }
}

}  // namespace memtrain
