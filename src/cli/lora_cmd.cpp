// `memtrain lora merge CKPT --out DIR`: folds a LoRA run's adapters into its base, writing a
// whole model directory (Hugging Face weights and config.json, the tokenizer) that eval, sample,
// quantize and model.init_from read.
#include <cstdio>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "io/hf_weights.h"
#include "io/model_source.h"
#include "io/out_dir.h"
#include "io/text_file.h"
#include "model/gpt.h"

namespace fs = std::filesystem;

namespace memtrain::cli {

void register_lora(CLI::App& app) {
    auto* lora = app.add_subcommand("lora", "LoRA adapters: merge them into their base");
    lora->require_subcommand(1);
    auto* merge = lora->add_subcommand(
        "merge", "write base + (alpha / r) B A of every adapter as a whole model directory");
    struct Args {
        std::string ckpt, out;
    };
    auto a = std::make_shared<Args>();
    merge->add_option("checkpoint", a->ckpt, "a LoRA run's checkpoint, or its out_dir")->required();
    merge->add_option("--out", a->out, "directory for the merged model")->required();
    merge->callback([a]() {
        const ModelSource src = open_model_source(a->ckpt);
        if (!src.lora)
            fail("{} holds no LoRA adapters (adapter_model.safetensors): nothing to merge",
                 src.dir);
        // Written under a fresh name beside --out and swapped in whole (io/out_dir.h): a failure
        // or a kill leaves the old output or the new one, never neither.
        io::StagedDir staged(a->out, "lora_merge.json", "`memtrain lora merge`");
        const RunConfig& run = *src.run;
        GPT model(src.model);
        load_source_weights(src, model.weights());
        const fs::path tmp = staged.dir();
        save_hf_weights(model.weights(), (tmp / "model.safetensors").string());
        io::write_text_file(tmp / "config.json", hf_config_json(src.model, src.tokenizer));
        if (!src.tokenizer.empty() && fs::is_regular_file(src.tokenizer))
            io::write_text_file(
                tmp / "tokenizer.json",
                read_regular_file(src.tokenizer, kMaxTokenizerBytes, "tokenizer.json"));
        nlohmann::ordered_json record = {
            {"adapters", src.dir},         {"base", run.model.init_from},
            {"rank", run.lora.rank},       {"alpha", run.lora.alpha},
            {"targets", run.lora.targets}, {"frozen_base", run.lora.base}};
        io::write_text_file(tmp / "lora_merge.json", record.dump() + "\n");
        staged.commit();
        std::printf("%s\n", fmt::format("merged {} (LoRA r={} alpha={} on {}) into {} -> {}",
                                        src.dir, run.lora.rank, run.lora.alpha, run.lora.targets,
                                        run.model.init_from.empty() ? "its seeded base"
                                                                    : run.model.init_from,
                                        staged.out())
                                .c_str());
    });
}

}  // namespace memtrain::cli
