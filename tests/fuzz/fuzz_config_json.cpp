// libFuzzer target for the Hugging Face config.json readers: the model one (io/hf_weights.h,
// what sample, eval, quantize and model.init_from read) and the planner's (planner/
// model_shape.h). Any bytes must give a model or memtrain::Error; a model that is accepted must
// be within the bounds that keep its layout's sizes in 64 bits. Build with clang (CMake adds
// fuzz_config_json); the commands are in docs/fuzzing.md.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "io/hf_weights.h"
#include "model/config.h"
#include "model/param_layout.h"
#include "planner/model_shape.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static const std::string path = [] {
        const char* dir = std::getenv("TMPDIR");
        return std::string(dir ? dir : "/tmp") + "/fuzz_config_json." + std::to_string(::getpid()) +
               ".json";
    }();
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (!f) std::abort();
    if (size && std::fwrite(data, 1, size, f) != size) std::abort();
    std::fclose(f);
    try {
        const memtrain::ModelConfig cfg = memtrain::model_config_from_hf(path);
        if (cfg.n_layer > memtrain::kMaxLayers || cfg.n_embd > memtrain::kMaxWidth ||
            cfg.mlp_hidden() > memtrain::kMaxHidden * 2 || cfg.vocab_size > memtrain::kMaxVocab)
            std::abort();
        // The layout of one block (the whole one is n_layer times it): sizes must be exact.
        memtrain::ModelConfig one = cfg;
        one.n_layer = 1;
        const memtrain::ParamLayout layout = memtrain::make_param_layout(one);
        for (const auto& t : layout.tensors) {
            std::size_t n = 1;
            for (int64_t d : t.shape) {
                if (d <= 0) std::abort();
                n *= (std::size_t)d;
            }
            if (n != t.numel) std::abort();
        }
        (void)memtrain::hf_config_json(cfg);
    } catch (const memtrain::Error&) {
    }
    try {
        const std::string text(reinterpret_cast<const char*>(data), size);
        const memtrain::plan::ModelSpec m = memtrain::plan::model_from_hf_json(text, "fuzz");
        if (m.total_params() <= 0) std::abort();
    } catch (const memtrain::Error&) {
    }
    return 0;
}
