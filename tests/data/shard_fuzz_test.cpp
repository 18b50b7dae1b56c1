// Deterministic mutation fuzzing of TokenShard: thousands of corrupted variants of a valid shard
// (bit flips, truncations, extensions, header field rewrites) must each load or throw
// memtrain::Error, never crash. tests/fuzz/fuzz_shard.cpp is the libFuzzer counterpart.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/rng.h"
#include "data/shard.h"
#include "test_util.h"

namespace memtrain::data {
namespace {

namespace fs = std::filesystem;

TEST(ShardFuzz, MutationsLoadOrThrow) {
    const auto dir = testing::scratch_dir();
    std::vector<uint32_t> tokens;
    for (uint32_t i = 0; i < 64; ++i) tokens.push_back((i * 37) % 300);
    const auto base_path = dir / "base.bin";
    std::string small, wide;
    write_shard(base_path.string(), tokens, 300);
    {
        std::ifstream in(base_path, std::ios::binary);
        small.assign((std::istreambuf_iterator<char>(in)), {});
    }
    write_shard(base_path.string(), tokens, 70000);
    {
        std::ifstream in(base_path, std::ios::binary);
        wide.assign((std::istreambuf_iterator<char>(in)), {});
    }
    Rng rng(1234);
    const auto path = dir / "mutant.bin";
    int loaded = 0, rejected = 0;
    for (int iter = 0; iter < 3000; ++iter) {
        std::string b = (iter % 2) ? wide : small;
        const int kind = static_cast<int>(rng.next_u64() % 5);
        const int edits = 1 + static_cast<int>(rng.next_u64() % 3);
        for (int e = 0; e < edits && !b.empty(); ++e) {
            switch (kind) {
                case 0: {  // bit flip anywhere
                    const size_t at = rng.next_u64() % b.size();
                    b[at] = static_cast<char>(b[at] ^ (1 << (rng.next_u64() % 8)));
                    break;
                }
                case 1:  // truncation
                    b.resize(rng.next_u64() % b.size());
                    break;
                case 2:  // extension with random bytes
                    for (int k = static_cast<int>(rng.next_u64() % 9); k > 0; --k) {
                        b.push_back(static_cast<char>(rng.next_u64()));
                    }
                    break;
                case 3: {  // rewrite a header field with an interesting value
                    const size_t fields[] = {8, 12, 16, 20, 24};
                    const uint32_t values[] = {0,
                                               1,
                                               2,
                                               3,
                                               4,
                                               255,
                                               300,
                                               65536,
                                               65537,
                                               0xFFFFFFFFu,
                                               static_cast<uint32_t>(rng.next_u64())};
                    if (b.size() < 28) break;
                    const size_t at = fields[rng.next_u64() % 5];
                    const uint32_t v = values[rng.next_u64() % 11];
                    for (int i = 0; i < 4; ++i) b[at + i] = static_cast<char>(v >> (8 * i));
                    break;
                }
                default: {  // random byte in the body
                    if (b.size() <= 64) break;
                    b[64 + rng.next_u64() % (b.size() - 64)] = static_cast<char>(rng.next_u64());
                    break;
                }
            }
        }
        testing::write_file(path, b);
        try {
            TokenShard s(path.string());
            // A shard that loads must be internally consistent.
            std::vector<uint32_t> out(s.size());
            if (!out.empty()) s.read(0, out.size(), out.data());
            for (uint32_t t : out) ASSERT_LT(t, s.vocab_size());
            ASSERT_EQ(fs::file_size(path), 64 + s.size() * s.bytes_per_token());
            ++loaded;
        } catch (const Error&) {
            ++rejected;
        }
    }
    EXPECT_GT(loaded, 0);
    EXPECT_GT(rejected, 0);
    fs::remove_all(dir);
}

}  // namespace
}  // namespace memtrain::data
