// `memtrain sample CHECKPOINT --prompt "..." [--temperature --top-k --max-tokens --seed]`
#include <cstdio>
#include <filesystem>

#include "cli/commands.h"
#include "core/error.h"
#include "data/tokenizer.h"
#include "io/checkpoint.h"
#include "train/sample.h"

namespace memtrain::cli {

void register_sample(CLI::App& app) {
    auto* cmd = app.add_subcommand("sample", "generate text from a checkpoint");
    struct Args {
        std::string checkpoint, prompt, tokenizer;
        double temperature = 0.8;
        int top_k = 40;
        int max_tokens = 128;
        uint64_t seed = 1;
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("checkpoint", a->checkpoint, "checkpoint dir, or an out_dir with `latest`")
        ->required();
    cmd->add_option("--prompt", a->prompt, "text to continue (default: start of a document)");
    cmd->add_option("--temperature", a->temperature, "softmax temperature (> 0)");
    cmd->add_option("--top-k", a->top_k, "sample among the k most likely tokens (0 = all)");
    cmd->add_option("--max-tokens", a->max_tokens, "tokens to generate");
    cmd->add_option("--seed", a->seed, "sampling seed");
    cmd->add_option("--tokenizer", a->tokenizer,
                    "tokenizer (default: the checkpoint's tokenizer.json)");
    cmd->callback([a]() {
        if (!(a->temperature > 0)) fail("--temperature must be positive, got {}", a->temperature);
        if (a->top_k < 0) fail("--top-k must be >= 0, got {}", a->top_k);
        if (a->max_tokens < 0) fail("--max-tokens must be >= 0, got {}", a->max_tokens);
        std::string dir = resolve_checkpoint_dir(a->checkpoint);
        RunConfig cfg = checkpoint_config(dir);
        GPT model(cfg.model);
        load_hf_weights(model, (std::filesystem::path(dir) / "model.safetensors").string());
        std::string tok_path = a->tokenizer;
        if (tok_path.empty()) {
            tok_path = (std::filesystem::path(dir) / "tokenizer.json").string();
            if (!std::filesystem::exists(tok_path))
                fail("checkpoint {} has no tokenizer.json; pass --tokenizer", dir);
        }
        auto tok = data::Tokenizer::load(tok_path);
        if (tok.vocab_size() > cfg.model.vocab_size)
            fail("tokenizer {} has {} tokens but the model's vocab_size is {}", tok_path,
                 tok.vocab_size(), cfg.model.vocab_size);
        std::vector<int32_t> prompt;
        for (uint32_t t : tok.encode(a->prompt)) prompt.push_back((int32_t)t);
        auto eot = tok.eot_token();
        if (prompt.empty()) {
            if (!eot) fail("the tokenizer has no end-of-text token; give --prompt");
            prompt.push_back((int32_t)*eot);
        }
        Rng rng(a->seed);
        SampleOptions so{a->max_tokens, a->temperature, a->top_k, eot ? (int64_t)*eot : -1};
        auto out = generate(model, prompt, so, rng);
        if (!out.empty() && (int64_t)out.back() == so.stop_token) out.pop_back();
        std::vector<uint32_t> ids(out.begin(), out.end());
        std::printf("%s%s\n", a->prompt.c_str(), tok.decode(ids).c_str());
    });
}

}  // namespace memtrain::cli
