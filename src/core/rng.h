// A small, portable, serialisable random number generator (xoshiro256** seeded by splitmix64).
// Portable means the same seed gives the same numbers on every platform and library version,
// which std::normal_distribution does not promise; the state is saved in checkpoints.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace memtrain {

inline uint64_t splitmix64(uint64_t& x) {
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

class Rng {
  public:
    explicit Rng(uint64_t seed = 0) {
        uint64_t x = seed;
        for (auto& s : state_) s = splitmix64(x);
    }
    uint64_t next_u64() {
        const uint64_t result = rotl(state_[1] * 5, 7) * 9;
        const uint64_t t = state_[1] << 17;
        state_[2] ^= state_[0];
        state_[3] ^= state_[1];
        state_[1] ^= state_[2];
        state_[0] ^= state_[3];
        state_[2] ^= t;
        state_[3] = rotl(state_[3], 45);
        return result;
    }
    // Uniform in [0, 1) with 24 bits, exactly representable as float.
    float uniform() { return static_cast<float>(next_u64() >> 40) * (1.0f / 16777216.0f); }
    // Standard normal via Box-Muller in double precision.
    double normal() {
        double u1 = (static_cast<double>(next_u64() >> 11) + 0.5) * (1.0 / 9007199254740992.0);
        double u2 = static_cast<double>(next_u64() >> 11) * (1.0 / 9007199254740992.0);
        return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    }
    const std::array<uint64_t, 4>& state() const { return state_; }
    void set_state(const std::array<uint64_t, 4>& s) { state_ = s; }

  private:
    static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
    std::array<uint64_t, 4> state_{};
};

// Fills w[0..n) with normal(0, std) numbers drawn from the stream named by (seed, name): blocks of
// 64Ki elements, each from its own generator seeded by (seed, name, block index), filled in
// parallel with both Box-Muller outputs used. The values depend on the seed and the name alone:
// not on the number of threads, nor on how a model's tensors are grouped into units, stages or
// shards. A 1.5B-parameter model fills in about a second on 16 cores (one sequential stream took
// 40 s).
void fill_normal(float* w, std::size_t n, double std, uint64_t seed, std::string_view name);

}  // namespace memtrain
