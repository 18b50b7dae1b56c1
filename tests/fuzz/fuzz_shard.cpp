// libFuzzer target for the token shard reader: any byte string written to a file must either
// open as a valid TokenShard or be rejected with memtrain::Error; anything else is a bug.
// Build with clang (CMake adds fuzz_shard), run: ./build/fuzz_shard -max_total_time=60
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/shard.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static const std::string path = "/tmp/memtrain_fuzz_shard_" + std::to_string(::getpid());
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (!f) return 0;
    if (size > 0) std::fwrite(data, 1, size, f);
    std::fclose(f);
    try {
        memtrain::data::TokenShard shard(path);
        std::vector<uint32_t> out(shard.size());
        if (!out.empty()) shard.read(0, out.size(), out.data());
        for (uint32_t t : out) {
            if (t >= shard.vocab_size()) __builtin_trap();  // validation let a bad token through
        }
    } catch (const memtrain::Error&) {
    }
    return 0;
}
