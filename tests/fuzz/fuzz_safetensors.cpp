// libFuzzer target for the safetensors reader: each input is written to a temporary file and
// opened; every tensor of a file that opens is then read. Bad input must give memtrain::Error.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static const std::string path = [] {
        const char* dir = std::getenv("TMPDIR");
        return std::string(dir ? dir : "/tmp") + "/fuzz_safetensors." + std::to_string(::getpid()) +
               ".safetensors";
    }();
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f) std::abort();
    if (size && std::fwrite(data, 1, size, f) != size) std::abort();
    std::fclose(f);
    try {
        auto st = memtrain::io::SafetensorsFile::open(path);
        for (const auto& t : st.tensors()) {
            const auto* p = static_cast<const volatile uint8_t*>(st.data(t));
            uint8_t acc = 0;
            for (uint64_t i = 0; i < t.end - t.begin; i++) acc ^= p[i];
            (void)acc;
            using memtrain::io::DType;
            if ((t.dtype == DType::F32 || t.dtype == DType::BF16 || t.dtype == DType::F16) &&
                t.numel <= (1 << 20)) {
                std::vector<float> out((size_t)t.numel);
                st.read_f32(t, out, t.name, t.shape);
            }
        }
        (void)st.names();
        (void)st.metadata();
    } catch (const memtrain::Error&) {
    }
    return 0;
}
